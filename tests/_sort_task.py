"""The toy task the tensor-parallel tests train on: sort 8-symbol sequences (next-symbol cross-entropy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sort_task(model, steps: int, batch: int, seq: int, *, seed: int) -> tuple:
    """``(params, batches)``: ``model``'s initial parameters and ``steps`` batches of ``batch`` random
    sequences of ``seq`` symbols (0-7), the targets their sorted copies."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        toks = rng.integers(0, 8, (batch, seq)).astype(np.int32)
        batches.append({"inputs": toks, "targets": np.sort(toks, axis=1)})
    return model.init(jax.random.key(0), batches[0]["inputs"])["params"], batches


def sort_loss(model):
    """``loss_fn(params, batch)``: the mean cross-entropy of ``model``'s logits against the sorted targets."""

    def loss_fn(p, b):
        logp = jax.nn.log_softmax(model.apply({"params": p}, b["inputs"]))
        return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], axis=-1))

    return loss_fn
