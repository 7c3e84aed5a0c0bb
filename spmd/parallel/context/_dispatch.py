"""The attention functions a step under cp runs across the sequence cut (``jax.nn.dot_product_attention``, flax's
``dot_product_attention`` and ``make_causal_mask``), dispatched per context.

Each is replaced once (``install_dispatchers``: idempotent, under a lock) by a dispatcher that runs the active
``ContextCalls``' version of it (``ACTIVE``, a ``contextvars.ContextVar`` set by ``ContextCalls.installed``) and
the original everywhere else: another thread or context tracing at the same time sees its own, or the original.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import threading
from typing import Callable

__all__ = ["ACTIVE", "install_dispatchers"]

_JAX = (("jax.nn", "dot_product_attention"),)
_FLAX = (("flax.linen", "dot_product_attention"), ("flax.linen.attention", "dot_product_attention"),
         ("flax.nnx", "dot_product_attention"), ("flax.nnx.nn.attention", "dot_product_attention"))
_MASKS = (("flax.linen", "make_causal_mask"), ("flax.linen.attention", "make_causal_mask"),
          ("flax.nnx", "make_causal_mask"), ("flax.nnx.nn.attention", "make_causal_mask"))

# the ContextCalls whose attention runs across the cut in this context (``ContextCalls.installed``), or None
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("spmd_context_calls", default=None)
_LOCK = threading.Lock()


def _dispatching(orig: Callable, kind: str) -> Callable:
    """``orig`` (a module attribute such as ``jax.nn.dot_product_attention``) as a dispatcher: the active
    ``ContextCalls``' version of it (``ContextCalls.version(kind, orig)``) inside ``ContextCalls.installed``, else
    ``orig`` itself, unchanged."""

    @functools.wraps(orig)
    def dispatch(*args, **kwargs):
        calls = ACTIVE.get()
        fn = orig if calls is None else calls.version(kind, orig)
        return fn(*args, **kwargs)

    dispatch.__spmd_original__ = orig
    return dispatch


def install_dispatchers() -> None:
    """Put the dispatchers in place of the attention functions, once (idempotent, under a lock); each defers to
    the original outside ``ContextCalls.installed``."""
    with _LOCK:
        for targets, kind in ((_JAX, "jax"), (_FLAX, "flax"), (_MASKS, "causal_mask")):
            for modname, attr in targets:
                mod = importlib.import_module(modname)
                orig = getattr(mod, attr)
                if not hasattr(orig, "__spmd_original__"):
                    setattr(mod, attr, _dispatching(orig, kind))
