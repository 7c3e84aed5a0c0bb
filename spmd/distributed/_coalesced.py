"""``all_reduce_coalesced``: reduce a list of tensors with one all-reduce per dtype."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from placements import ReduceOp
from spmd._x64 import exact_array, x64_for
from spmd.distributed._c10d import all_reduce
from spmd.distributed._groups import members_only
from spmd.distributed._work import Work, write_into

__all__ = ["all_reduce_coalesced"]


@members_only
def all_reduce_coalesced(tensors: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """Reduce every tensor of ``tensors`` over the group, as ``all_reduce`` on each, with one
    collective per dtype (the tensors of a dtype travel flattened into one buffer). Returns the
    results as a list in input order (a ``Work`` with ``async_op=True``); where an input is a
    writable buffer, the result is also written into it, as ``all_reduce`` does."""
    where = "all_reduce_coalesced"
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{where}: tensors={tensors!r} must be a non-empty list of tensors.")
    arrays = []
    for i, t in enumerate(tensors):
        try:
            arrays.append(exact_array(t))
        except Exception:
            raise TypeError(f"{where}: tensors[{i}]={t!r} must be an array (jax, NumPy, or anything np.asarray takes).") from None
    results: list = [None] * len(arrays)
    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(np.dtype(a.dtype), []).append(i)
    for dtype, idx in by_dtype.items():
        with x64_for(dtype):
            flat = jnp.concatenate([arrays[i].reshape(-1) for i in idx])
            out = jnp.asarray(all_reduce(flat, op=op, group=group))
            offsets = np.cumsum([0] + [arrays[i].size for i in idx])
            for k, i in enumerate(idx):
                results[i] = out[offsets[k]:offsets[k + 1]].reshape(arrays[i].shape)
    for t, r in zip(tensors, results):
        write_into(t, r)  # a writable NumPy array / CPU torch tensor gets its result, as all_reduce does
    return Work(results) if async_op else results
