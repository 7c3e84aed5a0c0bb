"""How a reduce op reduces: its checks, and the arithmetic around the XLA collective.

Shared by the functional collectives (``spmd/_collectives.py``). Semantics follow
torch and NumPy where XLA:CPU's primitives differ:

* MAX / MIN propagate NaN (XLA:CPU's ``pmax``/``pmin`` drop it): the float's bits
  are mapped to integers of the same width in the float order, NaN beyond +-inf,
  and reduced with one integer all-reduce (the same bytes). ``-0.0 < +0.0``.
* AVG of floats narrower than float32 (float16, bfloat16) is pre-divided, as
  NCCL does for floating AVG: each rank contributes ``x / n`` (computed in
  float32, rounded once), so the sum cannot overflow where the average does not.
  Wider floats sum, then divide (exact for the values the sum holds exactly).
* PREMUL_SUM multiplies in float32 at least, then rounds once to the input dtype.
* Complex PRODUCT and AVG keep infinities where the value is exact: a complex multiply by the identity
  ``1+0j`` (what a ``Replicate -> Partial(product)`` puts on the other ranks) gives the other factor
  (``(inf+0j) * (1+0j)`` is ``inf+nanj`` in IEEE arithmetic), and AVG divides the real and imaginary parts
  by the group size (a complex division by ``n+0j`` turns ``inf+0j`` into ``inf+nanj``). So a redistribute
  through ``Partial(product)`` / ``Partial(avg)`` never changes a complex value, as the placements promise.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from placements import ReduceOp, as_reduce_op

__all__ = ["kind", "check_op", "bool_op", "reduce_stacked", "sum_contribution", "divide_by", "extreme"]

_SIGNED = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def kind(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    return "float"


def check_op(op: Any, dtype, where: str) -> ReduceOp:
    op = as_reduce_op(op, where=f"{where}: op")
    k = kind(dtype)
    if op.is_bitwise and k == "float":
        raise TypeError(
            f"{where}: op={op!r} is a bitwise op and the input is {np.dtype(dtype).name}; bitwise ops take "
            "integer or bool inputs (as in torch); cast the input, or use MAX/MIN/SUM."
        )
    if op.name in ("max", "min") and jnp.issubdtype(np.dtype(dtype), jnp.complexfloating):
        raise TypeError(
            f"{where}: op={op!r} is refused on an input of dtype {np.dtype(dtype).name}: complex numbers have no "
            "order (torch refuses it too); reduce the real part or abs(x), or use SUM, AVG or PRODUCT."
        )
    if op.name == "avg" and k != "float":
        raise TypeError(
            f"{where}: op={op!r} is refused on an input of dtype {np.dtype(dtype).name} (torch allows AVG only "
            "on floating inputs); reduce with SUM and divide, or cast to a float dtype."
        )
    if op.name == "premul_sum" and k == "bool":
        raise TypeError(f"{where}: op={op!r} needs a numeric input, got bool; cast it first.")
    if op.name == "premul_sum" and k == "int" and op.factor != int(op.factor):
        raise ValueError(
            f"{where}: op={op!r} on an input of dtype {np.dtype(dtype).name} would truncate the factor "
            f"{op.factor!r} to an integer; use an integral factor, or cast the input to a float dtype."
        )
    return op


def bool_op(op: ReduceOp) -> str:
    # torch (ProcessGroupNCCL) reduces bools as SUM -> max, PRODUCT -> min.
    return {"sum": "max", "product": "min", "max": "max", "min": "min", "band": "min", "bor": "max", "bxor": "bxor"}[op.name]


def _complex_times(a, b):
    """``a * b`` where a factor that is exactly ``1+0j`` gives the other one unchanged (infinities too)."""
    return jnp.where(b == 1, a, jnp.where(a == 1, b, a * b))


def reduce_stacked(g, name: str, axis: int):
    """Reduce the gathered contributions ``g`` along ``axis`` with a non-primitive op."""
    complex_ = jnp.issubdtype(g.dtype, jnp.complexfloating)
    if name == "product" and not complex_:
        return jnp.prod(g, axis=axis, dtype=g.dtype)
    fn = {"band": lax.bitwise_and, "bor": lax.bitwise_or, "bxor": lax.bitwise_xor, "max": lax.max, "min": lax.min,
          "product": _complex_times}[name]
    parts = [lax.index_in_dim(g, i, axis, keepdims=False) for i in range(g.shape[axis])]
    return functools.reduce(fn, parts)


def _narrow_float(dtype) -> bool:
    return kind(dtype) == "float" and not jnp.issubdtype(dtype, jnp.complexfloating) and np.dtype(dtype).itemsize < 4


def sum_contribution(x, op: ReduceOp, n: int):
    """(what this rank adds to the sum, whether to divide the sum by ``n`` after) for a
    sum-like ``op`` (``sum``, ``avg``, ``premul_sum``) over ``n`` ranks."""
    narrow = _narrow_float(x.dtype)
    if op.name == "premul_sum":
        if narrow:
            return (x.astype(jnp.float32) * np.float32(op.factor)).astype(x.dtype), False
        return x * jnp.asarray(op.factor, x.dtype), False
    if op.name == "avg" and narrow:
        return (x.astype(jnp.float32) / np.float32(n)).astype(x.dtype), False
    return x, op.name == "avg"


def divide_by(y, n: int):
    """``y / n`` for an AVG over ``n`` ranks; complex parts are divided one by one (exact as for floats)."""
    if jnp.issubdtype(y.dtype, jnp.complexfloating):
        d = np.asarray(n, jnp.real(y).dtype)
        return lax.complex(jnp.real(y) / d, jnp.imag(y) / d)
    return y / n


def extreme(x, name: str, axes):
    """``pmax`` / ``pmin`` of ``x`` over ``axes``; for floats, NaN wins (as torch and NumPy)."""
    reduce = lax.pmax if name == "max" else lax.pmin
    if kind(x.dtype) != "float" or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return reduce(x, axes)
    it = _SIGNED[np.dtype(x.dtype).itemsize]
    info = np.iinfo(it)
    flip = np.array(info.max, it)  # negative floats: flip the magnitude bits, so integer order is float order
    nan = np.array(info.max if name == "max" else info.min, it)  # beyond +inf (max) or -inf (min)
    b = lax.bitcast_convert_type(x, it)
    key = jnp.where(jnp.isnan(x), nan, jnp.where(b < 0, b ^ flip, b))
    r = reduce(key, axes)
    out = lax.bitcast_convert_type(jnp.where(r < 0, r ^ flip, r), x.dtype)
    return jnp.where(r == nan, jnp.asarray(np.nan, x.dtype), out)
