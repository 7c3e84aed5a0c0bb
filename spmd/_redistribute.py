"""Execute a redistribute plan as one jitted ``shard_map`` program over a DTensor's storage.

Every device holds its block padded at the end of each dim (see ``spmd/_dtensor.py``).
A step is a collective over a group of mesh dims plus *compactions*: a gather of
indices along one tensor dim with a static table per device (a NumPy array
indexed by the device's linear position, from ``axis_index``). The tables come
from the layout math alone (``local_shape_and_offset``), so uneven and nested
shards need no special case: a collective moves padded chunks, a compaction
drops the padding. When every device's table is a contiguous range the
compaction is a (dynamic) slice, which is what even shards always get.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from placements import Partial, Replicate, Shard, local_shape_and_offset, padded_local_shape
from placements._plan import Plan, Step
from spmd import _collectives as C

__all__ = ["execute_plan", "program"]

_DONT_CARE = -1  # padding: any value
_IDENTITY = -2  # inside the logical block, but held by nobody: the op's identity


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _blocks(global_shape, mesh_shape, placements):
    """(offsets, sizes): int arrays of shape (devices, ndim)."""
    offs, sizes = [], []
    for c in _coords(mesh_shape):
        s, o = local_shape_and_offset(global_shape, mesh_shape, placements, c)
        sizes.append(s)
        offs.append(o)
    shape = (len(offs), len(global_shape))  # explicit: a 0-d tensor has (devices, 0) tables
    return np.array(offs, dtype=np.int64).reshape(shape), np.array(sizes, dtype=np.int64).reshape(shape)


def _members(mesh_shape, group):
    """For every device (linear index), the linear indices of its group, by group rank."""
    coords = _coords(mesh_shape)
    lin = {c: i for i, c in enumerate(coords)}
    out = []
    for c in coords:
        mem = []
        for g in itertools.product(*(range(mesh_shape[d]) for d in group)):
            cc = list(c)
            for d, v in zip(group, g):
                cc[d] = v
            mem.append(lin[tuple(cc)])
        out.append(mem)
    return out


def _group_rank(mesh_shape, group, coord) -> int:
    r = 0
    for d in group:
        r = r * mesh_shape[d] + coord[d]
    return r


def _gather_table(dim, members, boff, bsize, aoff, asize, chunk, out_len, *, need_all=True):
    """Table along ``dim`` after a collective that concatenates group members' padded
    blocks (``chunk`` each): position ``t`` of my new block <- member holding it."""
    n = len(members)
    table = np.full((n, out_len), _DONT_CARE, dtype=np.int64)
    for dev in range(n):
        for t in range(asize[dev, dim]):
            g = aoff[dev, dim] + t
            for r, m in enumerate(members[dev]):
                if boff[m, dim] <= g < boff[m, dim] + bsize[m, dim]:
                    table[dev, t] = r * chunk + g - boff[m, dim]
                    break
            else:
                if need_all:
                    raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} held by no member")
                table[dev, t] = _IDENTITY
    return table


def _split_table(dim, members, boff, bsize, aoff, asize, chunk, k):
    """Table along ``dim`` before a collective that sends chunk ``r`` to group rank ``r``:
    chunk ``r`` (``chunk`` long) holds member ``r``'s new block, taken from my old block."""
    n = len(members)
    table = np.full((n, k * chunk), _DONT_CARE, dtype=np.int64)
    for dev in range(n):
        for r, m in enumerate(members[dev]):
            for u in range(asize[m, dim]):
                g = aoff[m, dim] + u
                if not boff[dev, dim] <= g < boff[dev, dim] + bsize[dev, dim]:
                    raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} not held locally")
                table[dev, r * chunk + u] = g - boff[dev, dim]
    return table


def _local_table(dim, boff, bsize, aoff, asize, out_len, *, fill_missing):
    n = boff.shape[0]
    table = np.full((n, out_len), _DONT_CARE, dtype=np.int64)
    for dev in range(n):
        for t in range(asize[dev, dim]):
            g = aoff[dev, dim] + t
            if boff[dev, dim] <= g < boff[dev, dim] + bsize[dev, dim]:
                table[dev, t] = g - boff[dev, dim]
            elif fill_missing:
                table[dev, t] = _IDENTITY
            else:
                raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} not held locally")
    return table


def _identity(op: str, dtype):
    dtype = np.dtype(dtype)
    if op == "sum":
        return 0
    if op == "product":
        return 1
    if dtype == np.bool_:
        return op == "min"
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.min if op == "max" else info.max
    return -np.inf if op == "max" else np.inf


def _compact(x, dim: int, table: np.ndarray, lin, fill=0):
    """``x`` gathered along ``dim`` by ``table[lin]`` (static table, dynamic device index)."""
    n_in = x.shape[dim]
    out_len = table.shape[1]
    if (table == _IDENTITY).any():
        idx = np.where(table < 0, n_in, table)
        idx = np.where(table == _DONT_CARE, n_in, idx)
        row = jnp.asarray(idx.astype(np.int32))[lin]
        return jnp.take(x, row, axis=dim, mode="fill", fill_value=fill)
    # Contiguous per device? Then a (dynamic) slice.
    starts = []
    contiguous = True
    t = np.arange(out_len)
    for row in table:
        valid = row >= 0
        if not valid.any():
            starts.append(None)
            continue
        s = row[valid] - t[valid]
        if (s != s[0]).any() or s[0] < 0:
            contiguous = False
            break
        starts.append(int(s[0]))
    if contiguous:
        known = [s for s in starts if s is not None]
        starts = [known[0] if s is None and known else (s or 0) for s in starts]
        need = max(s + out_len for s in starts)
        if need > n_in:
            pad = [(0, 0)] * x.ndim
            pad[dim] = (0, need - n_in)
            x = jnp.pad(x, pad)
        if len(set(starts)) == 1:
            return lax.slice_in_dim(x, starts[0], starts[0] + out_len, axis=dim)
        return lax.dynamic_slice_in_dim(x, jnp.asarray(np.array(starts, np.int32))[lin], out_len, axis=dim)
    idx = np.where(table < 0, 0, table)
    row = jnp.asarray(idx.astype(np.int32))[lin]
    return jnp.take(x, row, axis=dim, mode="clip")


def _apply(step: Step, x, lin, *, mesh_shape, names, global_shape):
    group = step.mesh_dims
    axes = tuple(names[d] for d in group)
    k = math.prod(mesh_shape[d] for d in group)
    c, t = step.src, step.dst
    boff, bsize = _blocks(global_shape, mesh_shape, step.before)
    aoff, asize = _blocks(global_shape, mesh_shape, step.after)
    sb = padded_local_shape(global_shape, mesh_shape, step.before)
    sa = padded_local_shape(global_shape, mesh_shape, step.after)
    members = _members(mesh_shape, group)
    if isinstance(c, Shard) and isinstance(t, Replicate):
        a = c.dim
        y = lax.all_gather(x, axes, axis=a, tiled=True) if k > 1 else x
        return _compact(y, a, _gather_table(a, members, boff, bsize, aoff, asize, sb[a], sa[a]), lin)
    if isinstance(c, Shard) and isinstance(t, Shard):
        a, b = c.dim, t.dim
        x = _compact(x, b, _split_table(b, members, boff, bsize, aoff, asize, sa[b], k), lin)
        y = lax.all_to_all(x, axes, b, a, tiled=True) if k > 1 else x
        return _compact(y, a, _gather_table(a, members, boff, bsize, aoff, asize, sb[a], sa[a]), lin)
    if isinstance(c, Shard) and isinstance(t, Partial):
        a = c.dim
        table = _local_table(a, boff, bsize, aoff, asize, sa[a], fill_missing=True)
        return _compact(x, a, table, lin, fill=_identity(t.reduce_op, x.dtype))
    if isinstance(c, Replicate) and isinstance(t, Shard):
        b = t.dim
        return _compact(x, b, _local_table(b, boff, bsize, aoff, asize, sa[b], fill_missing=False), lin)
    if isinstance(c, Replicate) and isinstance(t, Partial):
        op = t.reduce_op
        if op in ("avg", "max", "min") or k == 1:
            return x
        coords = _coords(mesh_shape)
        first = np.array([_group_rank(mesh_shape, group, cc) == 0 for cc in coords])
        keep = jnp.asarray(first)[lin]
        return jnp.where(keep, x, jnp.asarray(_identity(op, x.dtype), x.dtype))
    if isinstance(c, Partial) and isinstance(t, Replicate):
        return C.all_reduce(x, c.reduce_op, group=axes) if k > 1 else x
    if isinstance(c, Partial) and isinstance(t, Shard):
        b = t.dim
        x = _compact(x, b, _split_table(b, members, boff, bsize, aoff, asize, sa[b], k), lin)
        return C.reduce_scatter(x, c.reduce_op, scatter_dim=b, group=axes) if k > 1 else x
    raise AssertionError(f"redistribute: no lowering for {c} -> {t}")


@functools.lru_cache(maxsize=1024)
def program(mesh, plan: Plan):
    """The jitted program ``physical -> physical`` that runs ``plan`` on ``mesh``."""
    names = mesh.mesh_dim_names
    mesh_shape = tuple(mesh.shape)
    nd = len(mesh_shape)
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(nd)]

    empty = math.prod(plan.global_shape) == 0
    out_block = padded_local_shape(plan.global_shape, mesh_shape, plan.dst)

    def body(block):
        if empty:  # zero elements: no collective can (or needs to) run
            return jnp.zeros((1,) * nd + out_block, block.dtype)
        x = block.reshape(block.shape[nd:])
        lin = sum(lax.axis_index(n) * s for n, s in zip(names, strides)) if nd else 0
        for step in plan.steps:
            x = _apply(step, x, lin, mesh_shape=mesh_shape, names=names, global_shape=plan.global_shape)
        return x.reshape((1,) * nd + x.shape)

    f = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=P(*names), out_specs=P(*names), check_vma=False)
    return jax.jit(f)


def execute_plan(mesh, plan: Plan, physical):
    if not plan.steps:
        return physical
    return program(mesh, plan)(physical)


# --- a NumPy simulator of the same plan (tests and property checks) ----------------------------
def _np_compact(x, dim, table, dev, fill=0):
    n_in = x.shape[dim]
    row = table[dev]
    idx = np.where(row < 0, 0, row)
    y = np.take(x, idx, axis=dim) if n_in else np.zeros(
        x.shape[:dim] + (len(row),) + x.shape[dim + 1 :], x.dtype
    )
    shape = [1] * x.ndim
    shape[dim] = len(row)
    return np.where((row >= 0).reshape(shape), y, np.asarray(fill, x.dtype)).astype(x.dtype)


def _np_reduce(vals, op):
    stack = np.stack(vals)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if op == "avg":
        return (stack.sum(0, dtype=stack.dtype) / len(vals)).astype(stack.dtype)
    if op == "product":
        return stack.prod(0, dtype=stack.dtype)
    return stack.max(0) if op == "max" else stack.min(0)


def simulate_plan(plan: Plan, physical: np.ndarray) -> np.ndarray:
    """Run ``plan`` on a NumPy physical array (``mesh_shape + padded block``) with the same
    tables as the jitted program and NumPy stand-ins for the collectives."""
    mesh_shape = plan.mesh_shape
    coords = _coords(mesh_shape)
    xs = [np.asarray(physical[c]) for c in coords]
    gs = plan.global_shape
    for step in plan.steps:
        group = step.mesh_dims
        k = math.prod(mesh_shape[d] for d in group)
        c, t = step.src, step.dst
        boff, bsize = _blocks(gs, mesh_shape, step.before)
        aoff, asize = _blocks(gs, mesh_shape, step.after)
        sb = padded_local_shape(gs, mesh_shape, step.before)
        sa = padded_local_shape(gs, mesh_shape, step.after)
        mem = _members(mesh_shape, group)
        n = len(xs)
        if isinstance(c, Shard) and isinstance(t, Replicate):
            a = c.dim
            tab = _gather_table(a, mem, boff, bsize, aoff, asize, sb[a], sa[a])
            xs = [_np_compact(np.concatenate([xs[m] for m in mem[d]], axis=a), a, tab, d) for d in range(n)]
        elif isinstance(c, Shard) and isinstance(t, Shard):
            a, b = c.dim, t.dim
            tb = _split_table(b, mem, boff, bsize, aoff, asize, sa[b], k)
            pre = [_np_compact(xs[d], b, tb, d) for d in range(n)]
            ta = _gather_table(a, mem, boff, bsize, aoff, asize, sb[a], sa[a])
            new = []
            for d in range(n):
                r = mem[d].index(d)
                pieces = [np.take(pre[m], range(r * sa[b], (r + 1) * sa[b]), axis=b) for m in mem[d]]
                new.append(_np_compact(np.concatenate(pieces, axis=a), a, ta, d))
            xs = new
        elif isinstance(c, Shard) and isinstance(t, Partial):
            a = c.dim
            tab = _local_table(a, boff, bsize, aoff, asize, sa[a], fill_missing=True)
            f = _identity(t.reduce_op, xs[0].dtype)
            xs = [_np_compact(xs[d], a, tab, d, fill=f) for d in range(n)]
        elif isinstance(c, Replicate) and isinstance(t, Shard):
            b = t.dim
            tab = _local_table(b, boff, bsize, aoff, asize, sa[b], fill_missing=False)
            xs = [_np_compact(xs[d], b, tab, d) for d in range(n)]
        elif isinstance(c, Replicate) and isinstance(t, Partial):
            op = t.reduce_op
            if op in ("sum", "product"):
                f = _identity(op, xs[0].dtype)
                xs = [
                    xs[d] if _group_rank(mesh_shape, group, coords[d]) == 0 else np.full_like(xs[d], f)
                    for d in range(n)
                ]
        elif isinstance(c, Partial) and isinstance(t, Replicate):
            xs = [_np_reduce([xs[m] for m in mem[d]], c.reduce_op) for d in range(n)]
        elif isinstance(c, Partial) and isinstance(t, Shard):
            b = t.dim
            tb = _split_table(b, mem, boff, bsize, aoff, asize, sa[b], k)
            pre = [_np_compact(xs[d], b, tb, d) for d in range(n)]
            new = []
            for d in range(n):
                r = mem[d].index(d)
                red = _np_reduce([pre[m] for m in mem[d]], c.reduce_op)
                new.append(np.take(red, range(r * sa[b], (r + 1) * sa[b]), axis=b))
            xs = new
        else:
            raise AssertionError(step)
    if math.prod(gs) == 0:
        return np.zeros(tuple(mesh_shape) + padded_local_shape(gs, mesh_shape, plan.dst), physical.dtype)
    return np.stack(xs).reshape(tuple(mesh_shape) + xs[0].shape)
