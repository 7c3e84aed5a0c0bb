"""The attention functions a step under cp runs across the sequence cut (``jax.nn.dot_product_attention``, flax's
``dot_product_attention`` and ``make_causal_mask``), and ``jnp.take_along_axis`` (a loss's label logits, cut
over cp and tp: ``_take``), dispatched per context.

Each is replaced once (``install_dispatchers``: idempotent, under a lock) by a dispatcher that runs the active
``ContextCalls``' version of it (``ACTIVE``, a ``contextvars.ContextVar`` set by ``ContextCalls.installed``) and
the original everywhere else: another thread or context tracing at the same time sees its own, or the original.

A kernel of another layer (``kernel_installed``: the planner's fused attention, ``spmd.parallel.auto._fused``) is
dispatched the same way (``KERNELS``, per context) and runs beneath the active ``ContextCalls``: the cp version of
a call wraps the kernel, which wraps the original.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
from typing import Callable

__all__ = ["ACTIVE", "KERNELS", "install_dispatchers", "kernel_installed"]

_JAX = (("jax.nn", "dot_product_attention"),)
_FLAX = (("flax.linen", "dot_product_attention"), ("flax.linen.attention", "dot_product_attention"),
         ("flax.nnx", "dot_product_attention"), ("flax.nnx.nn.attention", "dot_product_attention"))
# jnp.take_along_axis: a loss's label logits over a vocabulary cut over tp (``_take``)
_TAKE = (("jax.numpy", "take_along_axis"),)
_MASKS = (("flax.linen", "make_causal_mask"), ("flax.linen.attention", "make_causal_mask"),
          ("flax.nnx", "make_causal_mask"), ("flax.nnx.nn.attention", "make_causal_mask"))

# the ContextCalls whose attention runs across the cut in this context (``ContextCalls.installed``), or None
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("spmd_context_calls", default=None)
# ``{kind: make}``: the kernels installed in this context (``kernel_installed``); ``make(orig)`` is the function run
# in place of ``orig``
KERNELS: contextvars.ContextVar = contextvars.ContextVar("spmd_attention_kernels", default={})
_LOCK = threading.Lock()


def _dispatching(orig: Callable, kind: str) -> Callable:
    """``orig`` (a module attribute such as ``jax.nn.dot_product_attention``) as a dispatcher: the active
    ``ContextCalls``' version of it (``ContextCalls.version(kind, orig)``) inside ``ContextCalls.installed``, of
    the context's kernel for ``kind`` (``kernel_installed``) where one is installed, else ``orig`` itself,
    unchanged."""

    @functools.wraps(orig)
    def dispatch(*args, **kwargs):
        make = KERNELS.get().get(kind)
        fn = orig if make is None else make(orig)
        calls = ACTIVE.get()
        if calls is not None:
            fn = calls.version(kind, fn)
        return fn(*args, **kwargs)

    dispatch.__spmd_original__ = orig
    return dispatch


def install_dispatchers() -> None:
    """Put the dispatchers in place of the attention functions, once (idempotent, under a lock); each defers to
    the original outside ``ContextCalls.installed``."""
    with _LOCK:
        for targets, kind in ((_JAX, "jax"), (_FLAX, "flax"), (_MASKS, "causal_mask"), (_TAKE, "take")):
            for modname, attr in targets:
                mod = importlib.import_module(modname)
                orig = getattr(mod, attr)
                if not hasattr(orig, "__spmd_original__"):
                    setattr(mod, attr, _dispatching(orig, kind))


@contextlib.contextmanager
def kernel_installed(kind: str, make: Callable[[Callable], Callable]):
    """While open, in this context only (a ``contextvars.ContextVar``: other threads and contexts see theirs, or
    the original), the functions of ``kind`` (``"jax"``: ``jax.nn.dot_product_attention``) run as ``make(orig)``,
    beneath an active ``ContextCalls``' version. Nested, the innermost ``make`` of a kind wins; restored on exit."""
    install_dispatchers()
    token = KERNELS.set({**KERNELS.get(), kind: make})
    try:
        yield
    finally:
        KERNELS.reset(token)
