"""64-bit dtypes on a JAX that runs 32-bit by default.

torch's default integer is int64 and users send float64 statistics; JAX, unless
``jax_enable_x64`` is set, turns int64 into int32 and float64 into float32 when
it makes an array or traces a program (``2**40 + 1`` arrives as ``1``). The
project runs exactly the work that touches a 64-bit dtype (int64, uint64,
float64, complex128) inside ``jax.enable_x64(True)``, JAX's own scoped switch:

* values come back with their dtype and exact value: XLA's collectives (psum,
  all-gather, all-to-all, collective-permute; gloo across processes) are
  64-bit native on CPU and GPU, so sums of int64 carry as they should;
* everything else keeps running as before (same dtypes, same HLO, same cached
  programs): the switch is a no-op for 8/16/32-bit inputs, and the user's own
  JAX code outside the project's calls keeps the user's setting.

Rejected alternatives: turning ``jax_enable_x64`` on globally at import changes
every user's default dtypes (``jnp.arange(3)`` becomes int64) and every compiled
program; moving 64-bit values as pairs of 32-bit words is exact for data
movement only (a sum of int64 needs carries between the words, a float64 sum is
not a sum of its halves), so reductions would still be wrong.

A 64-bit result is a ``jax.Array`` of that dtype. Reading it (``np.asarray``,
printing) is exact anywhere; computing on it with ``jax.numpy`` outside x64 mode
truncates it again (JAX's rule: enable x64 in your program, or use NumPy).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WIDE_DTYPES", "is_wide", "dtype_of", "x64_for", "exact_array"]

WIDE_DTYPES = frozenset(np.dtype(d) for d in (np.int64, np.uint64, np.float64, np.complex128))


def is_wide(dtype: Any) -> bool:
    """Whether JAX's default (32-bit) mode would narrow ``dtype``."""
    try:
        return np.dtype(dtype) in WIDE_DTYPES
    except TypeError:
        return False


def dtype_of(x: Any) -> np.dtype | None:
    """The dtype ``x`` has (an array's, a tensor's through NumPy, a Python number's as NumPy
    reads it: int -> int64, float -> float64), or None if it has none."""
    dt = getattr(x, "dtype", None)
    if dt is not None:
        try:
            return np.dtype(dt)
        except TypeError:
            pass  # e.g. a torch dtype: ask NumPy below
    try:
        return np.asarray(x).dtype
    except Exception:
        return None


def x64_for(*values: Any) -> ContextManager:
    """``jax.enable_x64(True)`` if any of ``values`` (arrays, dtypes, pytrees of arrays) is
    64-bit, else a no-op context."""
    if any(_has_wide(v) for v in values):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _has_wide(v: Any) -> bool:
    dt = getattr(v, "dtype", None)
    if isinstance(dt, np.dtype):  # a NumPy / JAX array or scalar: the fast path of every collective
        return dt in WIDE_DTYPES
    if isinstance(v, (np.dtype, type)):
        return is_wide(v)
    return any(is_wide(dtype_of(leaf)) for leaf in jax.tree.leaves(v))


def exact_array(x: Any) -> jax.Array:
    """``jnp.asarray(x)`` keeping a 64-bit dtype (a ``jax.Array`` is returned as is)."""
    if isinstance(x, jax.Array):
        return x
    a = np.asarray(x)
    with x64_for(a.dtype):
        return jnp.asarray(a)
