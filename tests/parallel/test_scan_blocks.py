"""FSDP and tensor parallelism on blocks under ``nn.scan``, the model unchanged: the same Llama with
``scan_layers=True`` (its parameters stacked by layer) trains per-layer FSDP, HSDP, keep, accumulation and
tp (each block cut by its heads) equal to 1-device training, each layer gathered inside the scan (one all-gather per layer and buffer: the compiled loop's
collectives times its trip count equal the plan's table)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import (ColwiseParallel, RowwiseParallel, executed_collectives, fully_shard, init_train_state, make_train_step,
                           parallelize_module, unshard_params)
from tests._one_device import assert_trees_close, train_one_device
from tests.third_party.llama import Llama, LlamaConfig

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
STEPS = 10
VOCAB = 64
LAYERS = 3
MODEL = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=8,
                          num_kv_heads=4, scan_layers=True))
EXAMPLE = jnp.zeros((2, 8), jnp.int32)


def _batch():
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, 9))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def _loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


@functools.lru_cache(maxsize=None)
def _reference():
    params = MODEL.init(jax.random.key(0), EXAMPLE)["params"]
    step_fn = jax.jit(_one)
    s, losses = OPT.init(params), []
    for _ in range(STEPS):
        params, s, value = step_fn(params, s)
        losses.append(float(value))
    return losses, params


def _one(p, s):
    value, g = jax.value_and_grad(_loss(MODEL))(p, _batch())
    u, s = OPT.update(g, s, p)
    return optax.apply_updates(p, u), s, value


LAYOUTS = {"fsdp=8": ((8,), ("fsdp",), {}, 1), "dp=2,fsdp=4": ((2, 4), ("dp", "fsdp"), {}, 1),
           "fsdp=8 keep": ((8,), ("fsdp",), {"reshard_after_forward": False}, 1),
           "fsdp=8 accum=2": ((8,), ("fsdp",), {}, 2)}


# HSDP's data dim beside fsdp changes nothing the scan does (test_fsdp covers it unscanned): the slow tier
@pytest.mark.parametrize("spec", [pytest.param(s, marks=pytest.mark.slow) if s == "dp=2,fsdp=4" else s for s in LAYOUTS])
def test_scanned_blocks_train_per_layer_fsdp_equal_to_one_device(spec):
    shape, names, kw, accum = LAYOUTS[spec]
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = fully_shard(MODEL, mesh=mesh, units=["layers"], **kw)
    state = init_train_state(model, OPT, jax.random.key(0), EXAMPLE)  # initialized straight into the shards
    # (3, 64, 96): the layer axis is never cut; the example inputs show each layer's [64, 96] is a Dense kernel
    # (its gradient a dot's output transposed): cut on its output dim, as torch's FSDP cuts a Linear's weight
    kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(LAYERS, 64, 96 // shape[-1])}
    step = make_train_step(model, _loss(model), OPT, accum_steps=accum)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
    ref_losses, ref_params = _reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    hlo = executed_collectives(step, state, _batch(), scalars=False)
    plan = step.communication(state, _batch())["total"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (plan[kind]["count"], plan[kind]["bytes"]), (kind, hlo, plan)
    # per layer (inside the loop): its 7 matrices and one flat buffer of its 2 norm weights, gathered again for
    # the backward pass unless kept; the root (embedding, head, final norm) once; with accumulation every
    # unit once, whole: the stacked layers' 9 arrays (a stacked norm weight is 2-D: a buffer of its own)
    per_layer = 8 * (1 if "keep" in spec else 2)
    assert plan["all-gather"]["count"] == (LAYERS * per_layer if accum == 1 else 9) + 3


def test_given_params_without_example_inputs_is_a_clear_error_at_the_first_step():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    model = fully_shard(MODEL, mesh=mesh, units=["layers"])
    params = MODEL.init(jax.random.key(0), EXAMPLE)["params"]
    step = make_train_step(model, _loss(model), OPT)
    with pytest.raises(ValueError, match=r"module 'layers' runs under nn\.scan .* pass example inputs .*"
                                         r"init_train_state\(model, optimizer, \*example_inputs, params=params\)"):
        step(init_train_state(model, OPT, params=params), _batch())
    state = init_train_state(model, OPT, EXAMPLE, params=params)  # with them: the same plan as from an rng
    assert state.plan == init_train_state(model, OPT, jax.random.key(0), EXAMPLE).plan
    assert dict(state.plan.scans) == {"layers": LAYERS}


@pytest.mark.slow
def test_tensor_parallel_inside_a_scan_cuts_each_layer_by_its_heads_and_trains_equal_to_one_device():
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {f"layers.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {"layers.self_attn.o_proj": row, "layers.mlp.gate_proj": col, "layers.mlp.up_proj": col,
             "layers.mlp.down_proj": row}
    model = parallelize_module(MODEL, mesh["tp"], plan)
    params = MODEL.init(jax.random.key(0), EXAMPLE)["params"]
    sgd = optax.sgd(0.1)  # 3 SGD steps: Adam's first steps divide near-zero gradients by their own size
    state = init_train_state(model, sgd, EXAMPLE, params=params)
    kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"]  # (3, 64, 96): its block's columns cut, not the layers
    assert {s.data.shape for s in kernel.addressable_shards} == {(LAYERS, 64, 96 // 4)}
    step = make_train_step(model, _loss(model), sgd)
    losses = []
    for _ in range(3):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
    ref_losses, ref = train_one_device(params, [_batch()] * 3, _loss(MODEL), sgd)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)
    hlo = executed_collectives(step, state, _batch(), scalars=False)
    table = step.communication(state, _batch())["total"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), (kind, hlo)
