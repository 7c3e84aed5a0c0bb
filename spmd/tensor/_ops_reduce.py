"""Reductions, softmax and normalisation on DTensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from placements import format_placements
from placements._strategy_ops import normalize_strategy, reduction_strategy, softmax_strategy
from spmd.tensor._ops_exec import current_strategy, is_dtensor, operand, run

__all__ = ["sum", "mean", "max", "min", "prod", "softmax", "log_softmax", "layer_norm"]

#: jnp function -> the Partial op a reduction over a sharded dim leaves (torch's LINEAR_REDUCTION_OP_MAP).
_REDUCE_OP = {"sum": "sum", "mean": "avg", "max": "max", "min": "min", "prod": "product"}


def _check_x(op: str, x) -> None:
    if not is_dtensor(x):
        raise TypeError(f"{op}: x={x!r} is not a DTensor; call jax.numpy.{op} on plain arrays.")


def _reduce(x, name, axis, keepdims):
    return getattr(jnp, name)(x, axis=axis, keepdims=keepdims)


def _reduction(name: str, x, axis, keepdims: bool):
    _check_x(name, x)
    if not isinstance(keepdims, bool):
        raise TypeError(f"{name}: keepdims={keepdims!r} must be a bool.")
    strat = reduction_strategy(name, _REDUCE_OP[name], x.device_mesh.shape, operand(x), axis, keepdims)
    axes = tuple(range(x.ndim)) if axis is None else tuple(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))
    if name in ("max", "min") and any(x.shape[a] == 0 for a in axes):
        raise ValueError(
            f"{name}: axis={axis!r} of a tensor of shape {x.shape} (placed {format_placements(x.placements)}) is "
            "empty, and a max/min of nothing is undefined (as in NumPy); reduce a non-empty axis."
        )
    fill = {"mean": "sum", "prod": "product"}.get(name, name)
    return run(strat, _reduce, [x], params=(name, axes, keepdims), fill=fill)


def sum(x, axis=None, keepdims: bool = False):  # noqa: A001 - the jax.numpy name
    """``jnp.sum`` over ``axis`` (all dims if None); a sharded reduced dim gives ``Partial(sum)``, no communication."""
    return _reduction("sum", x, axis, keepdims)


def mean(x, axis=None, keepdims: bool = False):
    """``jnp.mean`` over ``axis``; an even sharded dim gives ``Partial(avg)``, an uneven one is gathered first."""
    return _reduction("mean", x, axis, keepdims)


def max(x, axis=None, keepdims: bool = False):  # noqa: A001
    """``jnp.max`` over ``axis``; a sharded reduced dim gives ``Partial(max)`` (empty shards hold the identity)."""
    return _reduction("max", x, axis, keepdims)


def min(x, axis=None, keepdims: bool = False):  # noqa: A001
    """``jnp.min`` over ``axis``; a sharded reduced dim gives ``Partial(min)`` (empty shards hold the identity)."""
    return _reduction("min", x, axis, keepdims)


def prod(x, axis=None, keepdims: bool = False):
    """``jnp.prod`` over ``axis``; a sharded reduced dim gives ``Partial(product)``."""
    return _reduction("prod", x, axis, keepdims)


def _float_x(op: str, x) -> None:
    _check_x(op, x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{op}: x is a {np.dtype(x.dtype).name} DTensor placed {format_placements(x.placements)}; {op} needs a "
            "floating dtype: cast it first, e.g. x.astype('float32')."
        )


def _softmax(x, axis, log):
    return jax.nn.log_softmax(x, axis=axis) if log else jax.nn.softmax(x, axis=axis)


def softmax(x, axis: int = -1):
    """``jax.nn.softmax`` over ``axis``; a sharded ``axis`` is gathered first (as torch)."""
    _float_x("softmax", x)
    strat = softmax_strategy("softmax", x.device_mesh.shape, operand(x), axis)
    return run(strat, _softmax, [x], params=(axis, False))


def log_softmax(x, axis: int = -1):
    """``jax.nn.log_softmax`` over ``axis``; a sharded ``axis`` and every Partial are gathered first (as torch)."""
    _float_x("log_softmax", x)
    strat = softmax_strategy("log_softmax", x.device_mesh.shape, operand(x), axis)
    return run(strat, _softmax, [x], params=(axis, True))


def _layer_norm(x, axes, eps):
    mu = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=axes, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps)


def layer_norm(x, axis=-1, eps: float = 1e-5):
    """``(x - mean) / sqrt(var + eps)`` over ``axis`` (an int or a tuple): torch's layer norm
    without the affine part (scale and shift with ``*`` and ``+``). The normalised dims are
    replicated first and other dims keep their shards, as in torch (under
    ``placement_strategy("cheapest")`` a sharded normalised dim may move to another dim instead)."""
    _float_x("layer_norm", x)
    strat = normalize_strategy("layer_norm", x.device_mesh.shape, operand(x), axis, strategy=current_strategy())
    axes = tuple(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))
    return run(strat, _layer_norm, [x], params=(axes, float(eps)))
