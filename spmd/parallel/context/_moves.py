"""The sequence's moves over cp with their transposes (``custom_vjp``), for ``ContextCalls``
(``spmd.parallel.context._calls``), whose ``_all_gather`` / ``_own_chunk`` do the work in a region manual over cp
(``joint``: over cp and tp, sequence parallelism beside cp):

- ``gather_seq``: a module run on the gathered sequence takes its input whole (an all-gather); backward: each
  device keeps its part of the cotangent (whole on every device: the same);
- ``cut_seq``: its output cut back to the device's positions (nothing moves); backward: the cotangent gathered;
- ``cut_dim`` / ``gather_dim``: the same on another dim (an expert-parallel module's buffers).
"""

from __future__ import annotations

import functools

import jax

__all__ = ["cut_dim", "cut_seq", "gather_dim", "gather_seq"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_seq(x, calls, joint=False):
    return calls._all_gather(x, joint=joint)


def _gather_fwd(x, calls, joint):
    return calls._all_gather(x, joint=joint), None


def _gather_bwd(calls, joint, _, ct):
    return (calls._own_chunk(ct, joint=joint),)


gather_seq.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def cut_seq(y, calls, joint=False):
    return calls._own_chunk(y, joint=joint)


def _cut_fwd(y, calls, joint):
    return calls._own_chunk(y, joint=joint), None


def _cut_bwd(calls, joint, _, ct):
    return (calls._all_gather(ct, joint=joint),)


cut_seq.defvjp(_cut_fwd, _cut_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def cut_dim(x, calls, dim):
    """``x`` (whole on every device of cp) cut over cp on ``dim``; backward: the cotangent all-gathered."""
    return calls._own_chunk(x, dim)


def _cut_dim_fwd(x, calls, dim):
    return calls._own_chunk(x, dim), None


def _cut_dim_bwd(calls, dim, _, ct):
    return (calls._all_gather(ct, dim),)


cut_dim.defvjp(_cut_dim_fwd, _cut_dim_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_dim(y, calls, dim):
    """``y`` (cut over cp on ``dim``) whole on every device of cp; backward: each device keeps its part of the
    cotangent (whole on every device: the same)."""
    return calls._all_gather(y, dim)


def _gather_dim_fwd(y, calls, dim):
    return calls._all_gather(y, dim), None


def _gather_dim_bwd(calls, dim, _, ct):
    return (calls._own_chunk(ct, dim),)


gather_dim.defvjp(_gather_dim_fwd, _gather_dim_bwd)
