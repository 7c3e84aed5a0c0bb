"""Elementwise ops on DTensors (jax.numpy / jax.nn names), NumPy broadcasting, scalars on either side."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from placements import format_placements
from placements._strategy_ops import astype_strategy, pointwise_strategy
from spmd.tensor._ops_exec import check_operands, current_strategy, is_dtensor, operand, run

__all__ = [
    "exp", "log", "tanh", "sqrt", "abs", "negative", "relu", "gelu", "sigmoid",
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "where", "astype",
]


def _is_scalar(x: Any) -> bool:
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return True
    return isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0


def _check_args(op: str, args: tuple) -> list:
    tensors = []
    for i, a in enumerate(args):
        if is_dtensor(a):
            tensors.append(a)
        elif not _is_scalar(a):
            what = f"a {type(a).__name__} of shape {tuple(a.shape)}" if hasattr(a, "shape") else repr(a)
            raise TypeError(
                f"{op}: argument {i} is {what}, not a DTensor or a scalar; lay it out first, e.g. "
                "distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)."
            )
    if not tensors:
        raise TypeError(f"{op}: no argument is a DTensor; call jax.numpy.{op} on plain arrays.")
    check_operands(op, tensors)
    return tensors


def _elementwise(op: str, fn, args: tuple, rules: str, *, params: tuple = ()):
    tensors = _check_args(op, args)
    strat = pointwise_strategy(
        op, tensors[0].device_mesh.shape, [operand(t) for t in tensors], rules, strategy=current_strategy()
    )
    return run(strat, fn, list(args), params=params)


def _float_only(op: str, x) -> None:
    if is_dtensor(x) and not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"{op}: x is a {np.dtype(x.dtype).name} DTensor placed {format_placements(x.placements)}; {op} needs a "
            "floating dtype: cast it first, e.g. x.astype('float32')."
        )


# --- unary ------------------------------------------------------------------------------------
def exp(x):
    """``jnp.exp`` elementwise; ``Shard`` kept, ``Partial(max|min)`` kept (non-decreasing), other Partials reduced."""
    return _elementwise("exp", jnp.exp, (x,), "non_decreasing")


def log(x):
    """``jnp.log`` elementwise; ``Shard`` kept, a ``Partial`` input reduced first."""
    return _elementwise("log", jnp.log, (x,), "none")


def tanh(x):
    """``jnp.tanh`` elementwise; ``Shard`` kept, ``Partial(max|min)`` kept (non-decreasing), other Partials reduced."""
    return _elementwise("tanh", jnp.tanh, (x,), "non_decreasing")


def sqrt(x):
    """``jnp.sqrt`` elementwise; ``Shard`` kept, a ``Partial`` input reduced first."""
    return _elementwise("sqrt", jnp.sqrt, (x,), "none")


def abs(x):  # noqa: A001 - the jax.numpy name
    """``jnp.abs`` elementwise; ``Shard`` kept, a ``Partial`` input reduced first."""
    return _elementwise("abs", jnp.abs, (x,), "none")


def negative(x):
    """``-x``: ``P(sum) -> P(sum)``, ``P(max) -> P(min)``, ``P(min) -> P(max)``; ``Shard`` kept."""
    return _elementwise("negative", jnp.negative, (x,), "neg")


def relu(x):
    """``jax.nn.relu`` elementwise; ``Shard`` and ``Partial(max|min)`` kept (non-decreasing), other Partials reduced."""
    return _elementwise("relu", jax.nn.relu, (x,), "non_decreasing")


def sigmoid(x):
    """``jax.nn.sigmoid`` of a floating DTensor; ``Shard`` and ``Partial(max|min)`` kept, other Partials reduced."""
    _float_only("sigmoid", x)
    return _elementwise("sigmoid", jax.nn.sigmoid, (x,), "non_decreasing")


def _gelu(x, approximate):
    return jax.nn.gelu(x, approximate=approximate)


def gelu(x, approximate: bool = True):
    """``jax.nn.gelu`` (``approximate=False`` is torch's default erf form)."""
    _float_only("gelu", x)
    return _elementwise("gelu", _gelu, (x,), "none", params=(bool(approximate),))


# --- binary -----------------------------------------------------------------------------------
def _binary(op: str, fn, x, y, rules: str, reversed_rules: str):
    # A scalar first (2 - x, 2 / x) is not the same op for the Partial rules as x - 2.
    return _elementwise(op, fn, (x, y), reversed_rules if not is_dtensor(x) else rules)


def add(x, y):
    """``x + y`` with NumPy broadcasting (either may be a scalar); ``P(sum) + P(sum)`` stays ``P(sum)``, as in torch."""
    return _binary("add", jnp.add, x, y, "add", "add")


def subtract(x, y):
    """``x - y`` with NumPy broadcasting (either may be a scalar); ``P(sum) - P(sum)`` stays ``P(sum)``."""
    return _binary("subtract", jnp.subtract, x, y, "add", "none")


def multiply(x, y):
    """``x * y`` with NumPy broadcasting; ``P(sum|avg) * R`` (or a scalar) keeps the Partial, as in torch."""
    return _binary("multiply", jnp.multiply, x, y, "mul", "mul")


def divide(x, y):
    """``x / y`` (true division); a Partial numerator over a ``Replicate`` or scalar denominator is kept."""
    return _binary("divide", jnp.true_divide, x, y, "div", "none")


def power(x, y):
    """``x ** y`` elementwise with NumPy broadcasting; Partial operands are reduced first."""
    return _binary("power", jnp.power, x, y, "none", "none")


def maximum(x, y):
    """``jnp.maximum(x, y)``; ``P(max)`` of both operands (or with a ``Replicate``) is kept."""
    return _binary("maximum", jnp.maximum, x, y, "maximum", "maximum")


def minimum(x, y):
    """``jnp.minimum(x, y)``; ``P(min)`` of both operands (or with a ``Replicate``) is kept."""
    return _binary("minimum", jnp.minimum, x, y, "minimum", "minimum")


def equal(x, y):
    """``x == y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("equal", jnp.equal, x, y, "none", "none")


def not_equal(x, y):
    """``x != y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("not_equal", jnp.not_equal, x, y, "none", "none")


def less(x, y):
    """``x < y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("less", jnp.less, x, y, "none", "none")


def less_equal(x, y):
    """``x <= y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("less_equal", jnp.less_equal, x, y, "none", "none")


def greater(x, y):
    """``x > y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("greater", jnp.greater, x, y, "none", "none")


def greater_equal(x, y):
    """``x >= y`` elementwise (a bool DTensor); Partial operands are reduced first."""
    return _binary("greater_equal", jnp.greater_equal, x, y, "none", "none")


def where(condition, x, y):
    """``jnp.where(condition, x, y)`` elementwise; any of the three may be a scalar."""
    return _elementwise("where", jnp.where, (condition, x, y), "none")


# --- casts ------------------------------------------------------------------------------------
def _astype(x, dtype):
    return x.astype(dtype)


def astype(x, dtype):
    """``x`` cast to ``dtype``; see ``placements._strategy_ops.astype_strategy`` for Partial inputs."""
    if not is_dtensor(x):
        raise TypeError(f"astype: x={x!r} is not a DTensor; use jnp.asarray(x).astype(dtype) for plain arrays.")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"astype: dtype={dtype!r} is not a dtype; use e.g. 'float32' or jnp.int32.") from None
    src = np.dtype(x.dtype)
    fl = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dt, jnp.floating)
    strat = astype_strategy(x.device_mesh.shape, operand(x), float_to_float=bool(fl), strategy=current_strategy())
    return run(strat, _astype, [x], params=(dt.name,))
