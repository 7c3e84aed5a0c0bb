"""How ``backend="mpi"`` maps a reduction onto MPI with gloo's semantics: buffers and op plans.

The buffers an MPI call reads and writes (host copies, in-place targets), and for each ``ReduceOp`` and
dtype the MPI op and the key functions that give NaN-propagating MAX / MIN (float bits as ordered
integers), bool ops as torch's, and narrow floats summed in float32 (see ``_mpi_ops``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from spmd._reduce import bool_op, check_op, kind
from spmd.distributed import _mpi
from spmd.distributed._work import buffer_of

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


# --- buffers --------------------------------------------------------------------------------------
def _host(x: Any) -> np.ndarray:
    """This rank's block as a C-contiguous NumPy array (a jax.Array's host copy: exact, 64-bit too)."""
    a = np.asarray(x)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _target(into: Any, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
    """The caller's buffer the result can be written straight into, or None."""
    if into is None:
        return None
    buf = buffer_of(into)
    if buf is None or buf.shape != shape or buf.dtype != dtype or not buf.flags.c_contiguous:
        return None
    return buf


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def _narrow(dtype: np.dtype) -> bool:
    return dtype.kind not in "biuc" and dtype.itemsize < 4  # float16, bfloat16, float8s


# --- reductions -----------------------------------------------------------------------------------
def _mpi_op(name: str):
    M = _mpi.MPI
    return {"sum": M.SUM, "product": M.PROD, "max": M.MAX, "min": M.MIN, "band": M.BAND, "bor": M.BOR,
            "bxor": M.BXOR, "lor": M.LOR, "land": M.LAND, "lxor": M.LXOR}[name]


def _key_fns(dtype: np.dtype, name: str):
    """MAX / MIN of floats as integers: the bits mapped to the float order, NaN beyond +-inf."""
    it = _SIGNED[dtype.itemsize]
    info = np.iinfo(it)
    flip = it(info.max)  # negative floats: flip the magnitude bits, so integer order is float order
    nan = it(info.max if name == "max" else info.min)  # beyond +inf (max) or -inf (min)
    nan_value = np.array(np.nan, dtype)

    def pre(x):
        b = x.view(it)
        return np.where(np.isnan(x), nan, np.where(b < 0, b ^ flip, b)).astype(it)

    def post(r):
        out = np.where(r < 0, r ^ flip, r).astype(it).view(dtype)
        return np.where(r == nan, nan_value, out)

    return pre, post


@functools.lru_cache(maxsize=1024)
def _plan(op: Any, dtype: np.dtype, n: int, where: str):
    pre, name, post = _plan_names(op, dtype, n, where)
    return pre, _mpi_op(name), post


def _plan_names(op: Any, dtype: np.dtype, n: int, where: str):
    """How ``op`` reduces ``dtype`` over ``n`` ranks here: (pre, MPI op name, post); ``pre`` turns this
    rank's block into what it sends, ``post`` the reduced buffer into the result (None: as it is).
    Checked first (the same errors as on gloo); cached per (op, dtype, n)."""
    op = check_op(op, dtype, where)
    k = kind(dtype)
    if k == "bool":
        return None, {"max": "lor", "min": "land", "bxor": "lxor"}[bool_op(op)], None
    narrow = _narrow(dtype)
    if op.name in ("sum", "avg", "premul_sum"):
        f32 = np.float32
        if op.name == "premul_sum":
            factor = np.asarray(op.factor).astype(dtype) if not narrow else f32(op.factor)
            if narrow:  # in float32, rounded once to the dtype; summed in float32 (MPI has no 16-bit floats)
                return (lambda x: (x.astype(f32) * factor).astype(dtype).astype(f32)), "sum", (lambda r: r.astype(dtype))
            return (lambda x: x * factor), "sum", None
        if narrow:  # AVG pre-divided (as NCCL, in float32, rounded once), every sum in float32
            if op.name == "avg":
                return (lambda x: (x.astype(f32) / f32(n)).astype(dtype).astype(f32)), "sum", (lambda r: r.astype(dtype))
            return (lambda x: x.astype(f32)), "sum", (lambda r: r.astype(dtype))
        if op.name == "avg":
            return None, "sum", (lambda r: np.divide(r, n, out=r, casting="unsafe"))
        return None, "sum", None
    if op.name in ("max", "min") and k == "float" and dtype.kind != "c":
        pre, post = _key_fns(dtype, op.name)
        return pre, op.name, post
    if narrow:  # PRODUCT of float16 / bfloat16
        return (lambda x: x.astype(np.float32)), op.name, (lambda r: r.astype(dtype))
    return None, op.name, None


def _prepare(x: np.ndarray, op: Any, n: int, where: str):
    """(what this rank sends, the MPI op, the way back from the reduced buffer to the result)."""
    pre, mop, post = _plan(op, x.dtype, n, where)
    return (x if pre is None else pre(x)), mop, post


# --- the collectives ------------------------------------------------------------------------------
