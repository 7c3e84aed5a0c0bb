"""A fused attention call priced as the target GPU runs it, when ``auto_layout(hardware=)`` plans on a CPU.

``jax.nn.dot_product_attention(..., implementation="cudnn")`` runs on an H100 / H200 / A100 as cuDNN's fused
flash-attention kernel: the scores ``Q K^T`` are made and consumed one tile at a time in on-chip memory
(FlashAttention, Dao et al. 2022, Algorithm 1; its backward recomputes each tile from ``Q``, ``K`` and the
saved row statistics, Algorithm 2), so no ``T x T`` buffer ever reaches HBM and a causal call skips the
tiles above the diagonal. A CPU cannot lower that call, and XLA's own lowering of the same attention
(``implementation="xla"`` or ``None``) materializes the ``[B, heads, T, T]`` scores in float32 and their
gradient: at ``T = 8192`` and 32 heads 8.6 GB a layer, which would make every compiled peak and every
``bytes accessed`` of the plan the XLA lowering's, not the GPU's.

So while a plan for such hardware (``Hardware.fused_attention``) is traced, a ``cudnn`` call is traced as
the same algorithm written in JAX (``flash_attention``): a ``lax.scan`` over the ``(query tile, key tile)``
pairs the kernel computes (with ``is_causal``, those on or below the diagonal: ``n (n + 1) / 2`` of ``n^2``),
each tile's online-softmax update, and a ``custom_vjp`` whose backward recomputes each tile's scores from the
saved ``Q, K, V``, output and log-sum-exp. Its compiled program has what the kernel has:

- **flops**: per computed tile, ``Q K^T`` and ``P V`` forward (``2 x 2 b^2 d`` per head) and, backward,
  ``Q K^T`` again, ``dP = dO V^T``, ``dV``, ``dQ``, ``dK`` (``5 x 2 b^2 d``); the softmax's elementwise work;
- **memory**: the saved operands and output, the log-sum-exp (``O(T d)`` a head), float32 accumulators
  for the output and ``dQ, dK, dV``, and one tile's scores (``b x b`` a head) at a time, never ``T x T``.

Calls the kernel path does not cover here (a ``bias`` or ``mask`` array, sequence lengths, a local window,
``return_residual``, a rank other than 4) are refused with the argument named. A float32 call is traced alike
(the planner's one-device profile traces the loss before a mixed-precision policy casts it); on the GPU
cuDNN's kernel takes float16 / bfloat16 operands, which the layouts computing in bfloat16 give it. Calls with
``implementation=None`` or ``"xla"`` run as XLA lowers them on that hardware too (materialized), unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd.parallel.context._attention import _grads, _group, _update
from spmd.parallel.context._dispatch import kernel_installed
from spmd.parallel.cost._hardware import Hardware
from spmd.parallel.cost._loops import ON_CHIP

__all__ = ["BLOCK", "flash_attention", "fused_attention", "planned_fused"]

BLOCK = 512  # the tile (queries and keys) of the planning kernel; cuDNN's are 64-128, the difference is in
# the work buffers only (one tile's scores a head: 512 x 512 float32 = 1 MiB), not in flops or HBM traffic
_F32 = jnp.float32


def _tile(t: int, block: int) -> int:
    """The largest tile <= ``block`` dividing ``t``."""
    return max(b for b in range(1, min(block, t) + 1) if t % b == 0)


def _pairs(nq: int, nk: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    got = [(i, j) for i in range(nq) for j in range(nk) if not causal or j <= i]
    return np.array([i for i, _ in got], np.int32), np.array([j for _, j in got], np.int32)


def _tile_mask(i, j, b: int, causal: bool):
    if not causal:
        return None
    q_pos, k_pos = i * b + jnp.arange(b), j * b + jnp.arange(b)
    return (q_pos[:, None] >= k_pos[None, :])[None, None, None]


def _forward(q, k, v, causal: bool, scale: float, b: int):
    """q [B, T, K, G, D], k/v [B, S, K, D] -> (out [B, T, K, G, D] in q's dtype, lse [B, K, G, T] f32)."""
    bb, t, h, g, d = q.shape
    qi, kj = _pairs(t // b, k.shape[1] // b, causal)
    # the carries made from q (times 0), not broadcast constants: XLA:CPU copies a constant carry for each loop
    # and schedules the copies at the start of the step, every layer's held to its backward pass (_zeros_of)
    o0 = _zeros_of(q).transpose(0, 2, 3, 1, 4)
    row = o0[..., 0]
    init = (o0, row - jnp.inf, row)

    def body(state, ij):
        i, j = ij
        o, m, l = state
        part = (lax.dynamic_slice_in_dim(o, i * b, b, 3), lax.dynamic_slice_in_dim(m, i * b, b, 3),
                lax.dynamic_slice_in_dim(l, i * b, b, 3))
        new = _update(part, lax.dynamic_slice_in_dim(q, i * b, b, 1), lax.dynamic_slice_in_dim(k, j * b, b, 1),
                      lax.dynamic_slice_in_dim(v, j * b, b, 1), _tile_mask(i, j, b, causal), scale)
        return tuple(lax.dynamic_update_slice_in_dim(x, y, i * b, 3) for x, y in zip(state, new)), None

    with jax.named_scope(ON_CHIP):  # its tiles stay on chip: only what it slices and writes back counts
        (o, m, l), _ = lax.scan(body, init, (qi, kj))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse


def _backward(q, k, v, out, lse, do, causal: bool, scale: float, b: int):
    t = q.shape[1]
    qi, kj = _pairs(t // b, k.shape[1] // b, causal)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", do.astype(_F32), out.astype(_F32))
    init = (_zeros_of(do), _zeros_of(k), _zeros_of(v))  # not constants: see _forward

    def body(acc, ij):
        i, j = ij
        dq, dk, dv = acc
        part = (lax.dynamic_slice_in_dim(dq, i * b, b, 1), lax.dynamic_slice_in_dim(dk, j * b, b, 1),
                lax.dynamic_slice_in_dim(dv, j * b, b, 1))
        gq, gk, gv = _grads(part, lax.dynamic_slice_in_dim(q, i * b, b, 1), lax.dynamic_slice_in_dim(k, j * b, b, 1),
                            lax.dynamic_slice_in_dim(v, j * b, b, 1), lax.dynamic_slice_in_dim(do, i * b, b, 1),
                            lax.dynamic_slice_in_dim(lse, i * b, b, 3), lax.dynamic_slice_in_dim(delta, i * b, b, 3),
                            _tile_mask(i, j, b, causal), scale)
        return (lax.dynamic_update_slice_in_dim(dq, gq, i * b, 1), lax.dynamic_update_slice_in_dim(dk, gk, j * b, 1),
                lax.dynamic_update_slice_in_dim(dv, gv, j * b, 1)), None

    with jax.named_scope(ON_CHIP):
        (dq, dk, dv), _ = lax.scan(body, init, (qi, kj))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _zeros_of(x):
    """float32 zeros shaped like ``x``, computed from it (``x * 0``: XLA keeps a float multiply by 0, whose result
    is not 0 for inf / nan): a loop's initial carry made when its operand exists. From a broadcast constant,
    XLA:CPU's copy insertion gives each loop a copy of it, scheduled at the start of the step and held until
    the loop: Llama 3 70B fsdp=32,tp=8 sp ac=full bf16 held every layer's attention accumulators (f32, 0.57
    GiB a layer on 256 devices) from the first op to the layer's backward pass."""
    return x.astype(_F32) * 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, causal, scale, b):
    return _forward(q, k, v, causal, scale, b)[0]


def _flash_fwd(q, k, v, causal, scale, b):
    out, lse = _forward(q, k, v, causal, scale, b)
    return out, (q, k, v, out, lse)


def _flash_bwd(causal, scale, b, res, do):
    q, k, v, out, lse = res
    return _backward(q, k, v, out, lse, do, causal, scale, b)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(query, key, value, *, is_causal: bool = False, scale: float | None = None,
                    block: int = BLOCK):
    """``jax.nn.dot_product_attention(query, key, value, is_causal=, scale=)`` computed as FlashAttention does
    (see the module doc): ``[B, T, N, D]`` queries, ``[B, S, K, D]`` keys and values (``K`` dividing ``N``),
    tiles of the largest size <= ``block`` dividing ``T`` and ``S``."""
    bq, t, n, d = query.shape
    s = key.shape[1]
    if is_causal and s != t:
        raise ValueError(f"flash_attention: is_causal=True with {t} queries and {s} keys; the planning kernel's "
                         "causal mask is self-attention's (equal lengths).")
    b = _tile(math.gcd(t, s), block)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q = _group(query, key)
    return _flash(q, key, value, bool(is_causal), scale, b).reshape(bq, t, n, d)


def _refuse(arg: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"jax.nn.dot_product_attention(implementation='cudnn') traced for auto_layout(hardware=): "
                      f"{arg}={value!r} {rule}; the planning kernel (spmd.parallel.auto._fused) prices causal or "
                      "unmasked attention on rank-4 operands. Drop the argument, or call it "
                      "with implementation='xla' to plan XLA's materialized attention.")


def _planned(orig: Callable) -> Callable:
    """``orig`` (``jax.nn.dot_product_attention``) with its ``implementation="cudnn"`` calls traced as
    ``flash_attention`` (see the module doc); other calls go to ``orig`` as they are."""

    def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                              implementation=None, return_residual=False):
        if implementation != "cudnn":
            return orig(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                        local_window_size=local_window_size, implementation=implementation,
                        return_residual=return_residual)
        for arg, val in (("bias", bias), ("mask", mask), ("query_seq_lengths", query_seq_lengths),
                         ("key_value_seq_lengths", key_value_seq_lengths), ("local_window_size", local_window_size)):
            if val is not None:
                raise _refuse(arg, type(val).__name__ if hasattr(val, "shape") else val, "is not None")
        if return_residual:
            raise _refuse("return_residual", return_residual, "is not False")
        for name, x in (("query", query), ("key", key), ("value", value)):
            if np.ndim(x) != 4:
                raise _refuse(f"{name}.shape", tuple(np.shape(x)), "is not [batch, seq, heads, head_dim]")
        return flash_attention(query, key, value, is_causal=is_causal, scale=scale)

    return dot_product_attention


@contextlib.contextmanager
def fused_attention(hardware: Any):
    """While active, in this context only, ``jax.nn.dot_product_attention(..., implementation="cudnn")`` is
    traced as ``flash_attention`` where ``hardware.fused_attention`` (see the module doc); other calls as they
    are. The call is dispatched per context (``spmd.parallel.context._dispatch.kernel_installed``, the
    dispatcher cp's attention uses): another thread tracing meanwhile runs its own, or the original; under cp the
    sequence cut's version wraps this one. Nothing changes for hardware without the kernel."""
    if not getattr(hardware, "fused_attention", False):
        yield
        return
    with kernel_installed("jax", _planned):
        yield


def planned_fused(fn):
    """``fn`` (``auto_layout``) run inside ``fused_attention`` of its ``hardware=`` argument, where that names
    hardware (any other value goes to ``fn`` as given, for its own error)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            hw = Hardware.named(kwargs["hardware"]) if kwargs.get("hardware") is not None else None
        except (TypeError, ValueError):
            hw = None
        with fused_attention(hw):
            return fn(*args, **kwargs)

    return wrapper
