"""auto_layout's compute estimate reads the model's matmuls off its traced program, not off names or the batch's
first leaf: a batch whose first leaf (by key order) is a [B] label vector, an embedding table named ``tok`` that a
tied head multiplies, a Dense named ``embedding_proj``. The expected flops are counted by hand (2 m k n per
matmul, 3x for forward and backward)."""

from __future__ import annotations

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
