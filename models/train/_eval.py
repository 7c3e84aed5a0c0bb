"""Held-out evaluation, data-parallel like the train step: the batch comes as DTensors laid out by the
job's batch placements, each rank scores its examples and the accuracies are averaged over the data dims.

For the digit task with the transformer it is greedy generation: the model sees the digits and SEP and writes
the answer one token at a time, as it would be used; otherwise it is next-token accuracy on the targets.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from placements import ReduceOp, Replicate
from spmd import DeviceMesh, all_reduce, spmd

__all__ = ["make_eval_step"]


def _generate(model: Any, params: Any, batch: dict, n: int) -> jax.Array:
    """Greedy answers to the ``n``-digit problems of an LM-layout batch, compared with the targets."""
    buf = batch["inputs"].at[:, n + 1:].set(0)  # keep the digits and SEP; generate the rest

    def gen(i, carry):
        buf, preds = carry
        logits = model.apply({"params": params}, buf)
        tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, n + i, axis=1, keepdims=False), -1)
        preds = preds.at[:, i].set(tok.astype(preds.dtype))
        buf = jnp.where(jnp.arange(buf.shape[1]) == n + 1 + i, tok[:, None].astype(buf.dtype), buf)
        return buf, preds

    preds = jnp.zeros_like(batch["targets"][:, :n])  # device-varying, like the loop's results
    _, preds = jax.lax.fori_loop(0, n, gen, (buf, preds))
    return preds == batch["targets"][:, n:]


def make_eval_step(model: Any, mesh: DeviceMesh, data_dims: tuple[str, ...], *, digits: int | None) -> Callable:
    """``(params, batch) -> {"token_accuracy", "sequence_accuracy"}`` (replicated scalars).

    ``params`` are replicated; ``batch`` is a dict of DTensors (they carry their placements, split over
    ``data_dims``). ``digits``: the digit count of the task when the answer is generated greedily, else None.
    """

    def local(params, batch):
        if digits is not None:
            right = _generate(model, params, batch, digits)
        else:
            logits = model.apply({"params": params}, batch["inputs"])
            right = (jnp.argmax(logits, -1) == batch["targets"]) | (batch["mask"] == 0)
        acc = {"token_accuracy": jnp.mean(right.astype(jnp.float32)),
               "sequence_accuracy": jnp.mean(jnp.all(right, axis=1).astype(jnp.float32))}
        # Equal blocks on every rank: the mean of the ranks' means is the mean over the whole batch. Over every
        # mesh dim: a DTensor batch is varying on the non-data dims (tp) too, where the ranks hold equal copies.
        return {k: all_reduce(v, ReduceOp.AVG, group=tuple(mesh.mesh_dim_names)) for k, v in acc.items()}

    rep = [Replicate()] * mesh.ndim
    return spmd(local, mesh, in_placements=(rep, None), out_placements=rep)
