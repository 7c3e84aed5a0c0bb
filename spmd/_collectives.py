"""Functional collectives for use inside an SPMD region (``@spmd`` or ``jax.shard_map``).

Each takes ``group=``: a mesh dim name, an int mesh dim, a tuple of them (one
flattened group, ranked row-major in the order given), a ``ProcessGroup``, or
``None`` for every mesh dim of the region (torch's WORLD). Each lowers to XLA
collectives; see the lowering notes on every function.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from placements import ReduceOp
from spmd._arrays import as_array
from spmd._groups import group_axes
from spmd._reduce import bool_op, check_op, divide_by, extreme, kind, reduce_stacked, sum_contribution

try:  # the same all-gather, typed as replicated over the group (so Replicate outputs pass check_vma)
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - older/newer JAX without it: the varying all_gather
    _all_gather_invariant = lax.all_gather

__all__ = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce",
    "scatter",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "permute",
    "axis_index",
    "group_axes",
]


def _check_rank(value: Any, n: int, where: str, arg: str, axes) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {arg}={value!r} must be an int rank in the group {axes}, e.g. {arg}=0.")
    if not 0 <= value < n:
        raise ValueError(
            f"{where}: {arg}={value!r} is out of range for group {axes} of size {n}; use 0 <= {arg} < {n}."
        )
    return int(value)


def _check_axis(axis: Any, ndim: int, where: str, arg: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{where}: {arg}={axis!r} must be an int.")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{where}: {arg}={axis!r} is out of range for an input of rank {ndim}; use a value in [{-ndim}, {ndim - 1}]."
        )
    return int(axis) % ndim


def _check_divisible(x, axis: int, n: int, where: str, arg: str, axes) -> None:
    if x.shape[axis] % n:
        raise ValueError(
            f"{where}: the input's dim {arg}={axis} has size {x.shape[axis]}, not divisible by the group {axes} "
            f"of size {n}; pad it to a multiple of {n}, or use a DTensor, which handles uneven shards."
        )


def varying_axes(x) -> frozenset | None:
    """The mesh axes over which ``x`` may differ (JAX's vma type), or None if untracked."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return None if mat is None else frozenset(mat.varying)


def _vary(x, axes, where: str):
    """Mark ``x`` device-varying over ``axes`` (a no-op outside ``check_vma``), so that a
    replicated value is reduced as torch reduces it: each rank contributes its copy.
    Every collective's input passes here: a str, object or ragged ``x`` gets the project's TypeError."""
    as_array(x, where, "x")
    x = jnp.asarray(x)
    vma = varying_axes(x)
    if vma is None:
        return x
    missing = tuple(a for a in axes if a not in vma)
    return lax.pcast(x, missing, to="varying") if missing else x


def all_reduce(x, op: Any = ReduceOp.SUM, *, group: Any = None):
    """Reduce ``x`` over the group with ``op``; every rank gets the result.

    Lowers to one all-reduce (``psum``/``pmax``/``pmin``; MAX/MIN of floats as an
    integer all-reduce that keeps NaN, see ``spmd/_reduce.py``); PRODUCT and the
    bitwise ops have no XLA primitive and gather then reduce locally.
    """
    where = "all_reduce"
    axes, n = group_axes(group, where)
    x = _vary(x, axes, where)
    op = check_op(op, x.dtype, where)
    if kind(x.dtype) == "bool":
        name = bool_op(op)
        y = x.astype(jnp.uint8)
        if name == "bxor":
            return (lax.psum(y.astype(jnp.int32), axes) % 2).astype(jnp.bool_)
        return (lax.pmax(y, axes) if name == "max" else lax.pmin(y, axes)).astype(jnp.bool_)
    if op.name in ("sum", "avg", "premul_sum"):
        y, divide = sum_contribution(x, op, n)
        y = lax.psum(y, axes)
        return divide_by(y, n) if divide else y
    if op.name in ("max", "min"):
        return extreme(x, op.name, axes)
    return reduce_stacked(_all_gather_invariant(x, axes, axis=0), op.name, 0)


def _bits(x):
    """``x`` as unsigned integers of the same width, and the way back.

    A masked integer sum is exact; a float sum is not (XLA:CPU starts the sum
    at +0.0, turning -0.0 into +0.0, and flushes denormals to zero).
    """
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8), lambda b: b.astype(jnp.bool_)
    if jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return x, lambda b: b
    dtype = x.dtype
    u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[dtype.itemsize]
    return lax.bitcast_convert_type(x, u), lambda b: lax.bitcast_convert_type(b, dtype)


def broadcast(x, src: int, *, group: Any = None):
    """Every rank gets rank ``src``'s ``x``, bit for bit: one all-reduce of ``x``'s bits,
    the other ranks contributing zeros."""
    where = "broadcast"
    axes, n = group_axes(group, where)
    src = _check_rank(src, n, where, "src", axes)
    bits, back = _bits(_vary(x, axes, where))
    mine = lax.axis_index(axes) == src
    return back(lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), axes))


def all_gather(x, *, axis: int = 0, tiled: bool = False, group: Any = None):
    """Every rank gets all ranks' ``x``: stacked on a new ``axis`` (or concatenated if ``tiled``)."""
    where = "all_gather"
    axes, n = group_axes(group, where)
    if not isinstance(tiled, (bool, np.bool_)):
        raise TypeError(
            f"{where}: tiled={tiled!r} must be a bool: True concatenates the ranks' blocks along axis, False "
            "stacks them on a new axis."
        )
    x = _vary(x, axes, where)
    axis = _check_axis(axis, x.ndim + (0 if tiled else 1), where, "axis")
    # Tracked (check_vma=True): typed replicated over the group, so it can be returned as Replicate.
    # Untracked (check_vma=False: redistribute's programs, @spmd(check_vma=False)): the varying all-gather,
    # whose transpose sums every copy's cotangent (reduce-scatter), as jax.grad needs when nothing says
    # the copies are equal. The same HLO all-gather either way.
    tracked = set(axes) <= (varying_axes(x) or frozenset())
    gather = _all_gather_invariant if tracked else lax.all_gather
    return gather(x, axes, axis=axis, tiled=tiled)


def reduce(x, dst: int, op: Any = ReduceOp.SUM, *, group: Any = None):
    """Rank ``dst`` gets the reduction; the other ranks keep their input (as torch)."""
    where = "reduce"
    axes, n = group_axes(group, where)
    dst = _check_rank(dst, n, where, "dst", axes)
    x = _vary(x, axes, where)
    check_op(op, x.dtype, where)
    return jnp.where(lax.axis_index(axes) == dst, all_reduce(x, op, group=axes), x)


def scatter(x, src: int, *, group: Any = None):
    """Rank ``i`` gets ``x[i]`` of rank ``src``; ``x`` has a leading axis of the group's size.

    Lowers to one all-to-all.
    """
    where = "scatter"
    axes, n = group_axes(group, where)
    src = _check_rank(src, n, where, "src", axes)
    x = _vary(x, axes, where)
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(
            f"{where}: the input has shape {x.shape}; it must have a leading axis of the group {axes}'s "
            f"size {n} (piece i goes to rank i)."
        )
    return lax.all_to_all(x, axes, 0, 0, tiled=True)[src]


def gather(x, dst: int, *, group: Any = None):
    """Rank ``dst`` gets all ranks' ``x`` stacked on a new leading axis; the others get zeros.

    (torch gives the others nothing; a traced program needs a value of one shape.)
    """
    where = "gather"
    axes, n = group_axes(group, where)
    dst = _check_rank(dst, n, where, "dst", axes)
    g = lax.all_gather(_vary(x, axes, where), axes, axis=0)
    return jnp.where(lax.axis_index(axes) == dst, g, jnp.zeros_like(g))


def reduce_scatter(x, op: Any = ReduceOp.SUM, *, scatter_dim: int = 0, group: Any = None):
    """Reduce ``x`` over the group and give rank ``i`` the ``i``-th chunk of ``scatter_dim``.

    SUM/AVG/PREMUL_SUM lower to one reduce-scatter; the other ops to one
    all-to-all and a local reduction (the same bytes).
    """
    where = "reduce_scatter"
    axes, n = group_axes(group, where)
    x = _vary(x, axes, where)
    op = check_op(op, x.dtype, where)
    d = _check_axis(scatter_dim, x.ndim, where, "scatter_dim")
    _check_divisible(x, d, n, where, "scatter_dim", axes)
    name = bool_op(op) if kind(x.dtype) == "bool" else op.name
    if name in ("sum", "avg", "premul_sum"):
        y, divide = sum_contribution(x, op, n)
        y = lax.psum_scatter(y, axes, scatter_dimension=d, tiled=True)
        return divide_by(y, n) if divide else y
    c = x.shape[d] // n
    xs = x.reshape(x.shape[:d] + (n, c) + x.shape[d + 1 :])
    if xs.dtype == jnp.bool_:
        xs = xs.astype(jnp.uint8)
        got = lax.all_to_all(xs, axes, d, d, tiled=True)
        return reduce_stacked(got, name, d).astype(jnp.bool_)
    got = lax.all_to_all(xs, axes, d, d, tiled=True)
    return reduce_stacked(got, name, d)


def all_to_all(x, split_axis: int = 0, concat_axis: int = 0, *, group: Any = None):
    """Cut ``split_axis`` into group-size chunks, send chunk ``i`` to rank ``i``, concatenate
    what arrives along ``concat_axis`` in rank order (one all-to-all)."""
    where = "all_to_all"
    axes, n = group_axes(group, where)
    x = _vary(x, axes, where)
    s = _check_axis(split_axis, x.ndim, where, "split_axis")
    c = _check_axis(concat_axis, x.ndim, where, "concat_axis")
    _check_divisible(x, s, n, where, "split_axis", axes)
    return lax.all_to_all(x, axes, s, c, tiled=True)


def permute(x, pairs: Sequence[tuple[int, int]], *, group: Any = None):
    """Send/recv: for each ``(src, dst)`` in ``pairs`` rank ``dst`` gets rank ``src``'s ``x``.

    Ranks that receive nothing get zeros. Each rank sends at most once and
    receives at most once (one collective-permute).
    """
    where = "permute"
    axes, n = group_axes(group, where)
    try:
        pairs = [tuple(p) for p in pairs]
    except TypeError:
        raise TypeError(f"{where}: pairs={pairs!r} must be a sequence of (src, dst) rank pairs.") from None
    for p in pairs:
        if len(p) != 2:
            raise ValueError(f"{where}: pairs holds {p!r}; each pair is (src, dst).")
        _check_rank(p[0], n, where, "pairs src", axes)
        _check_rank(p[1], n, where, "pairs dst", axes)
    for i, name in ((0, "source"), (1, "destination")):
        seen = [p[i] for p in pairs]
        if len(set(seen)) != len(seen):
            raise ValueError(
                f"{where}: pairs={pairs!r} uses a {name} rank twice; each rank sends at most once and "
                "receives at most once (split it into several permutes)."
            )
    # lax.ppermute numbers the ranks of several axes in mesh order, whatever order they are named in
    # (all_gather and axis_index follow the order named): renumber the pairs into mesh order.
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    ordered = tuple(a for a in mesh.axis_names if a in axes)

    def to_mesh_order(r: int) -> int:
        coord = {}
        for a in reversed(axes):
            r, coord[a] = divmod(r, sizes[a])
        out = 0
        for a in ordered:
            out = out * sizes[a] + coord[a]
        return out

    perm = [(to_mesh_order(int(a)), to_mesh_order(int(b))) for a, b in pairs]
    return lax.ppermute(_vary(x, axes, where), ordered, perm=perm)


def axis_index(group: Any = None):
    """This rank's index in the group (row-major over the group's mesh dims)."""
    axes, _ = group_axes(group, "axis_index")
    return lax.axis_index(axes)
