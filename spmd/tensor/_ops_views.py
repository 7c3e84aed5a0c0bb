"""Views of DTensors: transpose, reshape, basic indexing (no communication)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from placements import Shard, padded_local_shape
from placements._strategy_views import index_strategy, reshape_strategy, transpose_strategy
from spmd.tensor._ops_exec import is_dtensor, operand, run

__all__ = ["transpose", "reshape", "getitem"]


def _check_x(op: str, x) -> None:
    if not is_dtensor(x):
        raise TypeError(f"{op}: x={x!r} is not a DTensor; call jax.numpy.{op} on plain arrays.")


def _transpose(x, axes):
    return jnp.transpose(x, axes)


def transpose(x, axes=None):
    """``jnp.transpose``: reversed dims by default; each ``Shard(d)`` follows its dim."""
    _check_x("transpose", x)
    nd = x.ndim
    if axes is None:
        axes = tuple(reversed(range(nd)))
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise TypeError(f"transpose: axes={axes!r} must be a tuple of ints, a permutation of range({nd}).")
    norm = tuple(a % nd if -nd <= a < nd else a for a in axes)
    if sorted(norm) != list(range(nd)):
        raise ValueError(f"transpose: axes={tuple(axes)!r} is not a permutation of range({nd}) for a tensor of shape {x.shape}.")
    strat = transpose_strategy(x.device_mesh.shape, operand(x), norm)
    return run(strat, _transpose, [x], params=(norm,))


def _reshape(x, shape):
    return jnp.reshape(x, shape)


def _new_shape(shape: Any, size: int, old) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"reshape: shape={shape!r} must be ints, e.g. x.reshape(4, -1) or x.reshape((4, -1)).")
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise ValueError(f"reshape: shape={tuple(shape)!r} may hold one -1 and otherwise sizes >= 0.")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if rest == 0 or size % rest:
            raise ValueError(f"reshape: cannot reshape a tensor of shape {old} ({size} elements) into {tuple(shape)}.")
        shape[shape.index(-1)] = size // rest
    if int(np.prod(shape)) != size:
        raise ValueError(f"reshape: cannot reshape a tensor of shape {old} ({size} elements) into {tuple(shape)}.")
    return tuple(shape)


def reshape(x, *shape):
    """``x.reshape(shape)`` keeping the shards that stay contiguous blocks; otherwise a
    ValueError naming the redistribute that makes it possible (no hidden communication)."""
    _check_x("reshape", x)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    new = _new_shape(shape, int(np.prod(x.shape)), x.shape)
    strat = reshape_strategy(x.device_mesh.shape, operand(x), new)
    local = padded_local_shape(strat.out_shape, x.device_mesh.shape, strat.output)
    return run(strat, _reshape, [x], params=(local,))


def _expand_index(index: Any, ndim: int) -> tuple:
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        ok = it is None or it is Ellipsis or isinstance(it, slice) or (isinstance(it, (int, np.integer)) and not isinstance(it, bool))
        if not ok:
            raise TypeError(
                f"indexing: index {it!r} is not supported on a DTensor; use ints, slices, None and ... on dims that "
                "are not sharded."
            )
    n_real = sum(1 for it in items if it is not None and it is not Ellipsis)
    if sum(it is Ellipsis for it in items) > 1:
        raise IndexError("indexing: an index can only have a single ellipsis ('...').")
    if n_real > ndim:
        raise IndexError(f"indexing: too many indices ({n_real}) for a DTensor of rank {ndim}.")
    out: list = []
    for it in items:
        if it is Ellipsis:
            out.extend([slice(None)] * (ndim - n_real))
        else:
            out.append(int(it) if isinstance(it, (int, np.integer)) else it)
    out.extend([slice(None)] * (ndim - sum(1 for it in out if it is not None)))
    return tuple(out)


def _getitem(x, key):
    idx = tuple(None if k is None else k[1] if k[0] == "i" else slice(*k[1:]) for k in key)
    return x[idx]


def getitem(x, index):
    """``x[index]`` with ints, slices, None and ``...``; sharded dims must be taken whole."""
    _check_x("indexing", x)
    idx = _expand_index(index, x.ndim)
    d = 0
    norm = []
    for it in idx:
        if it is None:
            norm.append(None)
            continue
        n = x.shape[d]
        if isinstance(it, int):
            if not -n <= it < n:
                raise IndexError(f"indexing: index {it} is out of bounds for dim {d} of size {n} (shape {x.shape}).")
            norm.append(it % n)
        else:
            norm.append(it)
        d += 1
    strat = index_strategy(x.device_mesh.shape, operand(x), tuple(norm))
    sharded = {p.dim for p in x.placements if isinstance(p, Shard)}
    key, d = [], 0
    for it in norm:
        if it is None:
            key.append(None)
            continue
        if isinstance(it, int):
            key.append(("i", it))
        elif d in sharded:
            key.append(("s", None, None, None))  # taken whole: the local block is all of it
        else:
            key.append(("s", it.start, it.stop, it.step))
        d += 1
    return run(strat, _getitem, [x], params=(tuple(key),))
