"""torch's ``SyncBatchNorm`` for a linen model's ``nn.BatchNorm`` in the train step (``batch_norm="sync"``): each
BatchNorm computes its batch statistics over the data dims, and tells the step's table what that moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.cost._recompute import SYNC_BN

__all__ = ["BATCH_STATS_REASON", "sync_batch_norm", "sync_nnx_batch_norm"]

# why a pipeline refuses batch statistics (init_train_state's batch_stats=, a linen model's collection, an nnx
# model's nnx.BatchStat variables)
BATCH_STATS_REASON = ("each micro-batch passes a stage at a tick of its own, so a BatchNorm there would normalize "
                      "by one micro-batch's statistics, not the batch's as on one device (nor the global batch's, "
                      "as SyncBatchNorm does). Train a model with batch statistics under dp / fsdp / tp layouts "
                      "(make_train_step(batch_norm='broadcast' | 'sync')), or use a normalization without running "
                      "statistics (LayerNorm, GroupNorm).")


def sync_batch_norm(axes: tuple[str, ...], calls: list | None = None):
    """``nn.intercept_methods`` interceptor: every ``nn.BatchNorm`` without an ``axis_name`` of its own computes
    its batch statistics over ``axes`` (flax's own ``axis_name`` mean: torch's ``SyncBatchNorm``). ``calls``:
    each such call that computes statistics appends its reductions' buffer sizes in bytes (flax's
    ``_compute_stats``: the mean and the mean of squares stacked in one ``pmean``, or one ``pmean`` each without
    ``use_fast_variance``; in float32 at least), and runs under ``SYNC_BN`` (the backward pass's transposes of
    those means are read off it)."""
    import flax.linen as nn

    name = axes[0] if len(axes) == 1 else axes

    def interceptor(next_fun, args, kwargs, context):
        mod = context.module
        if not (isinstance(mod, nn.BatchNorm) and context.method_name == "__call__" and mod.axis_name is None):
            return next_fun(*args, **kwargs)
        if calls is not None and not mod.is_initializing():
            running = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
            if not nn.merge_param("use_running_average", mod.use_running_average, running):
                x = args[0]
                feats = [x.shape[a % x.ndim] for a in (mod.axis if isinstance(mod.axis, (tuple, list)) else (mod.axis,))]
                dt = jnp.result_type(x) if mod.dtype is None else jnp.dtype(mod.dtype)
                if mod.force_float32_reductions:
                    dt = jnp.promote_types(dt, jnp.float32)
                c = int(np.prod(feats)) * np.dtype(dt).itemsize
                calls.extend([2 * c] if mod.use_fast_variance else [c, c])
        object.__setattr__(mod, "axis_name", name)  # read by BatchNorm.__call__ only; restored right after
        try:
            with jax.named_scope(SYNC_BN):
                return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(mod, "axis_name", None)

    return interceptor


def sync_nnx_batch_norm(axes: tuple[str, ...], calls: list):
    """``prepare`` of ``nnx_loss``: every ``nnx.BatchNorm`` of the merged copy without an ``axis_name`` of its own
    computes its batch statistics over ``axes`` (torch's ``SyncBatchNorm``), under ``SYNC_BN``, each call that
    computes statistics appending its reductions' bytes to ``calls`` (as ``sync_batch_norm`` does for linen)."""
    from flax import nnx

    name = axes[0] if len(axes) == 1 else axes

    def synced(cls: type) -> type:
        def __call__(self, x, *args, **kwargs):
            running = kwargs.get("use_running_average", args[0] if args else None)
            if not (self.use_running_average if running is None else running):
                feats = [x.shape[a % x.ndim] for a in (self.axis if isinstance(self.axis, (tuple, list)) else
                                                       (self.axis,))]
                dt = jnp.promote_types(jnp.result_type(x) if self.dtype is None else jnp.dtype(self.dtype),
                                       jnp.float32)
                c = int(np.prod(feats)) * np.dtype(dt).itemsize
                calls.extend([2 * c] if self.use_fast_variance else [c, c])
            with jax.named_scope(SYNC_BN):
                return cls.__call__(self, x, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})

    def prepare(m):
        for _, sub in list(nnx.iter_modules(m)):
            if isinstance(sub, nnx.BatchNorm) and sub.axis_name is None:
                object.__setattr__(sub, "axis_name", name)
                sub.__class__ = synced(type(sub))

    return prepare
