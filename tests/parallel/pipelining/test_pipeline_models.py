"""Pipeline stages of models the project did not write, unchanged: Hugging Face's FlaxGPT2LMHeadModel and
FlaxLlamaForCausalLM (their blocks take an attention mask and position ids beside the activation and return
a tuple), and a flax.nnx model (its blocks in an ``nnx.List``).

Each layout trains 20 AdamW steps equal to 1-device training within 1e-5 (f32), and its compiled step's
collectives (permutes, all-reduces, all-gathers, reduce-scatters: count and bytes) equal the step's table.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import (ColwiseParallel, RowwiseParallel, fully_shard, hlo_executed_collectives, init_train_state,
                           make_train_step, parallelize_module, pipeline, unshard_params)
from tests._one_device import assert_trees_close, train_one_device

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
STEPS = 20
VOCAB = 64


def _batch(n=16, t=8):
    tok = np.random.default_rng(0).integers(0, VOCAB, (n, t + 1))
    return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def _ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _hf_loss(mod):
    return lambda p, b: _ce(mod(b["inputs"], params=p).logits, b)


def _model(name):
    """(model, params or None, loss_fn of a model, units glob, tp plan)."""
    if name == "nnx":
        from flax import nnx

        from tests.third_party.nnx_mlp import TokenMLP

        return TokenMLP(vocab=VOCAB, depth=4, rngs=nnx.Rngs(0)), None, lambda mod: lambda m, b: _ce(m(b["inputs"]), b), \
            "blocks.*", None
    transformers = pytest.importorskip("transformers")
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        hf = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
        plan = {"transformer.h.*.mlp.c_fc": ColwiseParallel(dim=0), "transformer.h.*.mlp.c_proj": RowwiseParallel(dim=1)}
        return hf, hf.params, _hf_loss, "transformer.h.*", plan
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
    hf = transformers.FlaxLlamaForCausalLM(cfg, seed=0)
    return hf, hf.params, _hf_loss, "model.layers.*", None


@functools.lru_cache(maxsize=None)
def _reference(name):
    """Per-step losses and final parameters of 1-device training."""
    m, params, loss, *_ = _model(name)
    if name == "nnx":
        from flax import nnx

        graphdef, params = nnx.split(m, nnx.Param)
        lf = lambda p, b: loss(None)(nnx.merge(graphdef, p), b)  # noqa: E731
    else:
        lf = loss(m)
    losses, state = train_one_device(params, [_batch()] * STEPS, lf, OPT)
    return losses, state.params


CONFIGS = {  # name: (model, mesh, schedule, M, v, accum_steps)
    "hf_gpt2-pp2dp4-1f1b": ("hf_gpt2", {"pp": 2, "dp": 4}, "1f1b", 2, 1, 1),
    "hf_gpt2-pp2dp2tp2-1f1b": ("hf_gpt2", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 2, 1, 1),
    "hf_llama-pp4dp2-1f1b-accum": ("hf_llama", {"pp": 4, "dp": 2}, "1f1b", 4, 1, 2),
    "hf_llama-pp2fsdp4-gpipe": ("hf_llama", {"pp": 2, "fsdp": 4}, "gpipe", 2, 1, 1),
    "nnx-pp2dp4-interleaved": ("nnx", {"pp": 2, "dp": 4}, "interleaved", 2, 2, 1),
    "nnx-pp2fsdp4-1f1b": ("nnx", {"pp": 2, "fsdp": 4}, "1f1b", 2, 1, 1),
}


@functools.lru_cache(maxsize=None)
def _run(config):
    name, dims, sched, m_count, v, accum = CONFIGS[config]
    model, params, loss, units, plan = _model(name)
    mesh = spmd.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    if "tp" in dims:
        model = parallelize_module(model, mesh["tp"], plan)
    if "fsdp" in dims:
        model = fully_shard(model, mesh=mesh["fsdp"])
    pm = pipeline(model, mesh["pp"], units=units, num_microbatches=m_count, schedule=sched, stages_per_rank=v)
    state = init_train_state(pm, OPT, params=params) if params is not None else init_train_state(pm, OPT)
    step = make_train_step(pm, loss(pm), OPT, accum_steps=accum)
    batch = _batch()
    text = step.compiled(state, batch).as_text()
    table = step.communication(state, batch)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return dict(losses=losses, params=unshard_params(pm, state), text=text, table=table, pm=pm)


def _cases():  # each configuration's tests on one xdist worker: they share its compiled run
    return [pytest.param(c, id=c, marks=pytest.mark.xdist_group("ppm-" + c)) for c in CONFIGS]


@pytest.mark.parametrize("config", _cases())
def test_equals_one_device_training(config):
    run = _run(config)
    ref_losses, ref_params = _reference(CONFIGS[config][0])
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(run["params"], ref_params, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.2  # it trained


@pytest.mark.parametrize("config", _cases())
def test_hlo_collectives_equal_table(config):
    run = _run(config)
    got, want = hlo_executed_collectives(run["text"], scalars=False), run["table"]
    for kind in ("collective-permute", "all-reduce", "all-gather", "reduce-scatter"):
        assert got[kind]["bytes"] == want[kind]["bytes"], kind
    assert got["collective-permute"]["count"] == want["collective-permute"]["count"]
    s, accum = run["pm"].schedule, CONFIGS[config][-1]
    per_pass = s.num_microbatches * (s.num_stages - 1)  # one per micro-batch and stage boundary, each way
    assert want["collective-permute"]["pairs"] == {"forward": per_pass * accum, "backward": per_pass * accum}
    dims = CONFIGS[config][1]
    assert (got["all-gather"]["bytes"] > 0) == ("fsdp" in dims)  # the stages gathered once per step under fsdp


# --- what a stage cannot compute again is refused ----------------------------------------------------------
class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, bias):
        return x + nn.Dense(x.shape[-1])(x) + bias


class _Biased(nn.Module):
    """Blocks that take a side array: the same parameter (``shared``), a constant of its own per block
    (``per_unit``: a head mask's row), or one per block computed from the batch (``per_unit_batch``)."""
    mode: str

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8)(tok)
        bias = self.param("bias", nn.initializers.zeros, (8,))
        for i in range(4):
            side = {"shared": bias, "per_unit": jnp.full((8,), 0.1 * i), "zero": jnp.zeros((8,)),
                    "per_unit_batch": jnp.full((8,), 0.1 * i) * tok.mean()}[self.mode]
            x = _Block(name=f"layers_{i}")(x, side)
        return x


def _biased(mode):
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    m = _Biased(mode)
    params = m.init(jax.random.key(0), jnp.zeros((2, 4), jnp.int32))["params"]
    pm = pipeline(m, mesh["pp"], units="layers_*", num_microbatches=2, schedule="1f1b")
    return m, params, pm


@pytest.mark.parametrize("mode,match", [("shared", "depends on the parameters"),
                                        ("per_unit_batch", "pipeline: unit 'layers_1' is called with other arguments "
                                                           "than 'layers_0' (besides the activation): its argument 0 "
                                                           "after the activation (flattened) differs between units and "
                                                           "depends on the batch")])
def test_side_arrays_a_stage_cannot_compute_again_are_refused(mode, match):
    m, params, pm = _biased(mode)
    state = init_train_state(pm, OPT, params=params)
    step = make_train_step(pm, lambda p, b: pm.apply({"params": p}, b["inputs"]).sum(), OPT)
    with pytest.raises(ValueError, match=re.escape(match)):
        step.lower(state, {"inputs": np.zeros((16, 4), np.int32)})


@pytest.mark.slow
def test_a_constant_of_its_own_per_unit_is_carried():
    """Each block gets a constant of its own (Hugging Face's BERT: a row of the head mask it builds from
    ``head_mask=None``): each stage holds the rows and picks its units'; 3 SGD steps equal 1-device training
    (on pp=2 x dp=4, 1F1B, two blocks per stage), the compiled collectives equal the table."""
    m, params, pm = _biased("per_unit")
    opt = optax.sgd(0.1)

    head = (0.3 * np.random.default_rng(1).normal(size=(8, VOCAB))).astype(np.float32)  # fixed: to logits

    def loss(mod):
        return lambda p, b: _ce(mod.apply({"params": p}, b["inputs"]) @ head, b)

    batch = _batch(n=16)
    ref_losses, ref = train_one_device(params, [batch] * 3, loss(m), opt)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss(pm), opt)
    got = hlo_executed_collectives(step.compiled(state, batch).as_text(), scalars=False)
    want = step.communication(state, batch)
    for kind in ("collective-permute", "all-reduce", "all-gather", "reduce-scatter"):
        assert got[kind]["bytes"] == want[kind]["bytes"], kind
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
    (lay,) = pm._layouts.values()
    np.testing.assert_array_equal(lay.calls.unit_consts[0], np.array([[0.1 * i] * 8 for i in range(4)], np.float32))
    assert ref_losses[-1] < ref_losses[0]
    # every block given the first block's constant (zero) trains to other values, far beyond the tolerance
    zero_losses, _ = train_one_device(params, [batch] * 3, loss(_Biased("zero")), opt)
    assert abs(zero_losses[-1] - ref_losses[-1]) > 1e-3


@pytest.mark.slow
def test_tensor_parallel_stages_of_an_nnx_model_train_as_one_device_and_their_table_is_the_hlo():
    """An nnx TokenMLP on pp=2 x dp=2 x tp=2 (its blocks' up / down Megatron's way, its head column-parallel):
    the stages' merged copies route their styled calls through the tp hooks as the step's do; 3 SGD steps
    equal 1-device training, the compiled step's bytes per kind are the table's."""
    from flax import nnx

    from tests.third_party.nnx_mlp import TokenMLP
    from spmd import Replicate
    from spmd.parallel import executed_collectives, unshard_params

    def model():
        return TokenMLP(vocab=VOCAB, width=16, hidden=32, depth=2, rngs=nnx.Rngs(0))

    def loss_fn(m, b):
        return _ce(m(b["inputs"]), b)

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        tok = rng.integers(0, VOCAB, (8, 9)).astype(np.int32)
        batches.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    sgd = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    m = parallelize_module(model(), mesh["tp"], {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel(),
                                                 "head": ColwiseParallel(output_layouts=Replicate())})
    pm = pipeline(m, mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, sgd)
    up = state.params["stages"]["up/kernel/value"]  # (2 units, 16, 32): a unit per stage, its outputs cut over tp
    assert {s.data.shape for s in up.addressable_shards} == {(1, 16, 16)}
    step = make_train_step(pm, loss_fn, sgd)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    graphdef, params = nnx.split(model(), nnx.Param)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), sgd)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    hlo = executed_collectives(step, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == table[kind]["bytes"], (kind, hlo, table)
    assert table["tp"]["program"]["all-reduce"]["count"] > 0 and hlo["all-to-all"]["count"] == 0
