"""auto_layout's compute estimate reads the model's matmuls off its traced program, not off names or the batch's
first leaf: a batch whose first leaf (by key order) is a [B] label vector, an embedding table named ``tok`` that a
tied head multiplies, a Dense named ``embedding_proj``. The expected flops are counted by hand (2 m k n per
matmul, 3x for forward and backward)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from spmd import Replicate, init_device_mesh
from spmd.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.parallel.auto._auto import abstract_state, as_parallel
from spmd.parallel.cost._compute_cost import compute_cost
from spmd.parallel.cost._memory import Profile

V, D, H, B, T = 16, 8, 32, 4, 6


class Odd(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        tok = nn.Embed(V, D, name="tok")
        x = tok(tokens)
        x = x + nn.Dense(D, name="out")(nn.relu(nn.Dense(H, name="embedding_proj")(x)))
        return tok.attend(x)


def loss_fn(params, batch):
    logits = Odd().apply({"params": params}, batch["tokens"])[:, -1]
    return -jnp_take(jax.nn.log_softmax(logits), batch["a_label"]).mean()


def jnp_take(logp, label):
    return jax.numpy.take_along_axis(logp, label[:, None], axis=1)[:, 0]


def test_tp_flops_from_the_program_not_names():
    rng = np.random.default_rng(0)
    batch = {"a_label": rng.integers(0, V, (B,)).astype(np.int32),  # sorts first: a [B] leaf, not [B, T]
             "tokens": rng.integers(0, V, (B, T)).astype(np.int32)}
    params = Odd().init(jax.random.key(0), batch["tokens"])["params"]
    opt = optax.sgd(0.1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    laid = parallelize_module(Odd(), mesh["tp"], {"embedding_proj": ColwiseParallel(), "out": RowwiseParallel(),
                                                  "tok": RowwiseParallel(),
                                                  "tok.attend": ColwiseParallel(output_layouts=Replicate())})
    state = abstract_state(laid, params, opt, mesh, batch["tokens"])
    prof = Profile(loss_fn, params, opt)
    flops, _, _ = compute_cost(prof, state.plan, as_parallel(laid, mesh, "test"), batch, accum_steps=1)
    whole, _ = prof.grad_cost(batch)
    # the cut matmuls: embedding_proj (D x H) and out (H x D) on every token, the tied head (D x V) on every token
    cut = 3 * 2 * B * T * (D * H + H * D + D * V)
    assert flops == pytest.approx(whole - min(cut, whole) * (1 - 1 / 2), rel=1e-9)


def _cal():
    from spmd.parallel import Calibration

    return Calibration(collectives={k: (1e-4, 1e9) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                            "collective-permute")},
                       matmul_flops_per_s=1e10, elementwise_bytes_per_s=1e10, dispatch_s=1e-4, group_size=8)


def test_auto_layout_checks_the_batch_it_reads_and_names_the_leaf():
    from spmd.parallel import auto_layout

    tokens = np.zeros((B, T), np.int32)
    params = Odd().init(jax.random.key(0), tokens)["params"]
    # the default loss reads batch['inputs'] and batch['targets']: another batch is refused, naming the fix
    with pytest.raises(ValueError, match=re.escape("auto_layout: loss_fn=None takes the default loss, next-token "
                                                   "cross-entropy of model(batch['inputs']) against batch['targets'], "
                                                   "but example_batch has ['a_label', 'tokens']; pass loss_fn=")):
        auto_layout(Odd(), optax.sgd(0.1), {"a_label": np.zeros((B,), np.int32), "tokens": tokens}, 2,
                    params=params, calibration=_cal())
    # a leaf without the batch's leading dim is named (the candidates' micro-batches cut every leaf's dim 0)
    with pytest.raises(ValueError, match=re.escape("auto_layout: example_batch['b_pos'] has shape (6,) and "
                                                   "example_batch['a_label'] (4,); every layout cuts each batch leaf "
                                                   "along its leading (batch) dim")):
        auto_layout(Odd(), optax.sgd(0.1), {"a_label": np.zeros((B,), np.int32), "b_pos": np.arange(T),
                                            "tokens": tokens}, 2, params=params, loss_fn=loss_fn, calibration=_cal())
