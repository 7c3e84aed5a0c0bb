"""``jnp.take_along_axis`` of one entry on the last dim, as a masked sum, under cp and tp.

A loss over a column-parallel head's output (``"lm_head": ColwiseParallel()``: the logits cut over tp on the
vocabulary) reads each position's label logit with ``jnp.take_along_axis(logits, labels[..., None], -1)``
(optax's ``softmax_cross_entropy_with_integer_labels``): a gather whose operand is cut over tp on the gathered
dim and over cp on the sequence, a batching dim of the gather (its indices, the labels, cut over cp too). Inside
the step's region manual over the data dims, XLA's SPMD partitioner aborts the process on that gather
(``spmd_partitioner_util.cc``: ``Check failed: partition_group_list.num_replica_groups() * ...``; XLA of jax
0.10.2). While a step over cp and tp traces, such a call runs as torch's ``loss_parallel`` reads the target
logit: each device compares the labels with its vocabulary positions and sums its hits (its own rows of the
vocabulary, zeros elsewhere), the sum over the cut dim an all-reduce over tp of one value per position; its
gradient is a select on each device's rows (no collective). Equal to the gather, out-of-bounds labels included
(``mode="fill"``: NaN for a float operand, negative labels wrapped).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

__all__ = ["masked_take_along_axis"]


def _applies(arr, indices, axis, mode, fill_value, kwargs) -> bool:
    """The loss's form: a float operand, one index per position on its last dim, the default (fill) mode."""
    if kwargs.get("wrap_negative_indices") is False or fill_value is not None or mode not in (None, "fill"):
        return False
    if not isinstance(axis, int) or not hasattr(arr, "ndim") or not hasattr(indices, "ndim"):
        return False
    nd = arr.ndim
    if nd < 1 or indices.ndim != nd or axis % nd != nd - 1 or indices.shape[-1] != 1:
        return False
    if not jnp.issubdtype(arr.dtype, jnp.inexact) or not jnp.issubdtype(indices.dtype, jnp.integer):
        return False
    return all(i in (1, a) for i, a in zip(indices.shape[:-1], arr.shape[:-1]))


def masked_take_along_axis(orig: Callable) -> Callable:
    """``orig`` (``jnp.take_along_axis``) with the loss's form run as a masked sum (see the module doc); any
    other call runs ``orig`` unchanged."""

    def take(arr, indices, axis=-1, mode=None, fill_value=None, **kwargs):
        if not _applies(arr, indices, axis, mode, fill_value, kwargs):
            return orig(arr, indices, axis, mode=mode, fill_value=fill_value, **kwargs)
        n = arr.shape[-1]
        idx = jnp.where(indices < 0, indices + n, indices)
        hit = lax.broadcasted_iota(idx.dtype, arr.shape, arr.ndim - 1) == idx
        picked = jnp.sum(jnp.where(hit, arr, jnp.zeros((), arr.dtype)), axis=-1, keepdims=True)
        return jnp.where((idx >= 0) & (idx < n), picked, jnp.full((), jnp.nan, arr.dtype))

    take.__wrapped__ = orig
    return take
