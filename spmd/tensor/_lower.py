"""The JAX lowering of a redistribute plan: one function per transition (``Step.lowering``).

A plan runs as one jitted ``shard_map`` program over a DTensor's storage (built
by ``spmd/_program.py``, with ``check_vma``: a ``Replicate`` result must be
typed invariant, so JAX checks it and transposes it as torch's autograd does).
Each step's lowering function takes this device's padded block, ``at`` (this
device's row of a static per-device table, :func:`device_row`) and the step's
:class:`Geometry` (index tables, ``_tables.py``), and calls the project's
collectives (``spmd/_collectives.py``) over the step's mesh dims. Which function runs is
the transition table's (``placements/_transitions.py``): the executor only
dispatches on ``step.lowering``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from placements import padded_local_shape
from placements._plan import Plan, Step
from spmd import _collectives as C
from spmd._program import block_program
from spmd.tensor._storage import op_identity, spec
from spmd.tensor._tables import DONT_CARE, IDENTITY, Geometry, geometry, size_table

__all__ = ["LOWERINGS", "build_program", "device_row", "fill_padding"]


def device_row(table, names: tuple[str, ...], mesh_shape: tuple[int, ...]):
    """This device's row of ``table`` (row = linear device position), indexed through only the mesh
    dims along which the rows differ: a row equal along a mesh dim stays typed invariant there
    (``check_vma``), as a ``Replicate`` result must be."""
    table = np.asarray(table)
    nd = len(mesh_shape)
    t = table.reshape(tuple(mesh_shape) + table.shape[1:])
    dims = [d for d in range(nd) if mesh_shape[d] > 1 and not (t == t.take([0], axis=d)).all()]
    sub = t[tuple(slice(None) if d in dims else 0 for d in range(nd))]
    if not dims:
        return jnp.asarray(sub)
    sizes = [mesh_shape[d] for d in dims]
    lin = sum(lax.axis_index(names[d]) * math.prod(sizes[i + 1:]) for i, d in enumerate(dims))
    return jnp.asarray(sub.reshape((-1,) + table.shape[1:]))[lin]


def fill_padding(block, shape, placements, dims, value, names: tuple[str, ...], mesh_shape: tuple[int, ...]):
    """This device's padded ``block`` of a tensor of global ``shape``, every element past the device's
    local size along ``dims`` set to ``value`` (padding holds anything until then)."""
    sizes = device_row(size_table(shape, mesh_shape, placements, dims), names, mesh_shape)
    keep = jnp.ones(block.shape, bool)
    for j, d in enumerate(dims):
        keep &= lax.broadcasted_iota(jnp.int32, block.shape, d) < sizes[j]
    return jnp.where(keep, block, jnp.asarray(value, block.dtype))


def _compact(x, dim: int, table: np.ndarray, at, fill=0):
    """``x`` gathered along ``dim`` by this device's row of ``table`` (``at``: static table, dynamic device)."""
    n_in = x.shape[dim]
    out_len = table.shape[1]
    if (table == IDENTITY).any():
        idx = np.where(table < 0, n_in, table)
        idx = np.where(table == DONT_CARE, n_in, idx)
        return jnp.take(x, at(idx.astype(np.int32)), axis=dim, mode="fill", fill_value=fill)
    # Contiguous per device? Then a (dynamic) slice.
    starts = []
    t = np.arange(out_len)
    for row in table:
        valid = row >= 0
        if not valid.any():
            starts.append(None)
            continue
        s = row[valid] - t[valid]
        if (s != s[0]).any() or s[0] < 0:
            break
        starts.append(int(s[0]))
    else:
        known = [s for s in starts if s is not None]
        starts = [known[0] if s is None and known else (s or 0) for s in starts]
        need = max(s + out_len for s in starts)
        if need > n_in:
            pad = [(0, 0)] * x.ndim
            pad[dim] = (0, need - n_in)
            x = jnp.pad(x, pad)
        if len(set(starts)) == 1:
            return lax.slice_in_dim(x, starts[0], starts[0] + out_len, axis=dim)
        return lax.dynamic_slice_in_dim(x, at(np.array(starts, np.int32)), out_len, axis=dim)
    idx = np.where(table < 0, 0, table)
    return jnp.take(x, at(idx.astype(np.int32)), axis=dim, mode="clip")


# --- one lowering per transition kind (placements/_transitions.py) ------------------------------
def _all_gather(step: Step, g: Geometry, x, at, axes):
    a = step.src.dim
    # (the block varies over the group, so C.all_gather is the invariant all-gather: a Replicate result,
    # whose transpose is a local slice, as torch's backward of Shard -> Replicate.)
    y = C.all_gather(x, axis=a, tiled=True, group=axes) if g.k > 1 else x
    return _compact(y, a, g.gather(a), at)


def _all_to_all(step: Step, g: Geometry, x, at, axes):
    a, b = step.src.dim, step.dst.dim
    x = _compact(x, b, g.split(b), at)
    y = C.all_to_all(x, b, a, group=axes) if g.k > 1 else x
    return _compact(y, a, g.gather(a), at)


def _fill_identity(step: Step, g: Geometry, x, at, axes):
    a = step.src.dim
    return _compact(x, a, g.local(a, fill_missing=True), at, fill=op_identity(step.dst.reduce_op, x.dtype))


def _slice(step: Step, g: Geometry, x, at, axes):
    b = step.dst.dim
    return _compact(x, b, g.local(b, fill_missing=False), at)


def _partition(step: Step, g: Geometry, x, at, axes):
    op = step.dst.reduce_op
    if op in ("avg", "max", "min") or g.k == 1:
        return x
    keep = at(np.asarray(g.first))
    return jnp.where(keep, x, jnp.asarray(op_identity(op, x.dtype), x.dtype))


def _all_reduce(step: Step, g: Geometry, x, at, axes):
    return C.all_reduce(x, step.src.reduce_op, group=axes) if g.k > 1 else x


def _reduce_scatter(step: Step, g: Geometry, x, at, axes):
    b = step.dst.dim
    x = _compact(x, b, g.split(b), at)
    return C.reduce_scatter(x, step.src.reduce_op, scatter_dim=b, group=axes) if g.k > 1 else x


LOWERINGS = {f.__name__[1:]: f for f in (
    _all_gather, _all_to_all, _fill_identity, _slice, _partition, _all_reduce, _reduce_scatter
)}  # by Step.lowering


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """The per-device body of a plan: each step's lowering, in order."""

    plan: Plan
    names: tuple[str, ...]

    def __call__(self, x):
        plan = self.plan
        mesh_shape = plan.mesh_shape
        if math.prod(plan.global_shape) == 0:  # zero elements: no collective can (or needs to) run
            return jnp.zeros(padded_local_shape(plan.global_shape, mesh_shape, plan.dst), x.dtype)
        at = functools.partial(device_row, names=self.names, mesh_shape=tuple(mesh_shape))
        for step in plan.steps:
            g = geometry(step, mesh_shape, plan.global_shape)
            axes = tuple(self.names[d] for d in step.mesh_dims)
            x = LOWERINGS[step.lowering](step, g, x, at, axes)
        return x


def build_program(mesh, plan: Plan):
    """The jitted program ``storage -> storage`` that runs ``plan`` on ``mesh`` (not cached:
    ``_dispatch.py`` holds the one cache)."""
    return block_program(mesh.jax_mesh, _RunPlan(plan, mesh.mesh_dim_names),
                         specs=(spec(mesh, plan.src), spec(mesh, plan.dst)), check_vma=True)
