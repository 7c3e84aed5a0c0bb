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
    return _elementwise("exp", jnp.exp, (x,), "non_decreasing")


def log(x):
    return _elementwise("log", jnp.log, (x,), "none")


def tanh(x):
    return _elementwise("tanh", jnp.tanh, (x,), "non_decreasing")


def sqrt(x):
    return _elementwise("sqrt", jnp.sqrt, (x,), "none")


def abs(x):  # noqa: A001 - the jax.numpy name
    return _elementwise("abs", jnp.abs, (x,), "none")


def negative(x):
    return _elementwise("negative", jnp.negative, (x,), "neg")


def relu(x):
    return _elementwise("relu", jax.nn.relu, (x,), "non_decreasing")


def sigmoid(x):
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
    return _binary("add", jnp.add, x, y, "add", "add")


def subtract(x, y):
    return _binary("subtract", jnp.subtract, x, y, "add", "none")


def multiply(x, y):
    return _binary("multiply", jnp.multiply, x, y, "mul", "mul")


def divide(x, y):
    return _binary("divide", jnp.true_divide, x, y, "div", "none")


def power(x, y):
    return _binary("power", jnp.power, x, y, "none", "none")


def maximum(x, y):
    return _binary("maximum", jnp.maximum, x, y, "maximum", "maximum")


def minimum(x, y):
    return _binary("minimum", jnp.minimum, x, y, "minimum", "minimum")


def equal(x, y):
    return _binary("equal", jnp.equal, x, y, "none", "none")


def not_equal(x, y):
    return _binary("not_equal", jnp.not_equal, x, y, "none", "none")


def less(x, y):
    return _binary("less", jnp.less, x, y, "none", "none")


def less_equal(x, y):
    return _binary("less_equal", jnp.less_equal, x, y, "none", "none")


def greater(x, y):
    return _binary("greater", jnp.greater, x, y, "none", "none")


def greater_equal(x, y):
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
