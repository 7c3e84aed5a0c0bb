"""Grouped-query attention with fewer key/value heads than the tp size (Megatron's rule: the key / value
projections run whole over tp, each device reading the head its query heads use).

A Llama (``models.Llama``) with 4 query heads and 2 key/value heads on tp=4, and with 1 key/value head on
tp=2, under tp, dp x tp and fsdp x tp, trains 3 SGD steps equal to 1-device training within 1e-5; the
compiled step's collectives (buffers and bytes per kind) equal the printed table, whose key / value terms
are checked against the model's shapes here; heads with no even split over tp are refused.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from _one_device import train_one_device
from models import Llama, LlamaConfig
from spmd.parallel import (ColwiseParallel, RowwiseParallel, executed_collectives, fully_shard, init_train_state,
                           make_train_step, parallelize_module, unshard_params)

OPT = optax.sgd(0.1)
STEPS, BATCH, SEQ, VOCAB, HIDDEN, LAYERS = 3, 8, 8, 32, 32, 2


def _config(heads, kv):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_layers=LAYERS,
                       num_heads=heads, num_kv_heads=kv)


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def _loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


def _plan(kv_in_plan: bool) -> dict:
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"layers_*.self_attn.q_proj": col, "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col,
            "layers_*.mlp.up_proj": col, "layers_*.mlp.down_proj": row}
    if kv_in_plan:
        plan |= {"layers_*.self_attn.k_proj": col, "layers_*.self_attn.v_proj": col}
    return plan


@functools.lru_cache(maxsize=None)
def _params(heads, kv):
    return Llama(_config(heads, kv)).init(jax.random.key(0), _batches()[0]["inputs"])["params"]


@functools.lru_cache(maxsize=None)
def _reference(heads, kv):
    model = Llama(_config(heads, kv))
    return train_one_device(_params(heads, kv), _batches(), _loss(model), OPT)


# (query heads, kv heads, mesh, the k / v projections in the plan (cut over tp) or left out (whole))
CASES = [
    (4, 2, (("tp", 4),), True),
    (4, 2, (("dp", 2), ("tp", 4)), True),
    (4, 1, (("dp", 2), ("tp", 2)), True),
    (4, 2, (("fsdp", 2), ("tp", 4)), False),  # re-gathering layers: their k / v outputs saved (reduce_precision)
]


def _id(c):
    return f"h{c[0]}kv{c[1]}-" + ",".join(f"{n}={s}" for n, s in c[2]) + ("-kv_cut" if c[3] else "-kv_whole")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fewer_kv_heads_than_tp_trains_as_one_device_and_its_table_is_the_hlo(case):
    heads, kv, dims, kv_in_plan = case
    mesh = spmd.init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    model = parallelize_module(Llama(_config(heads, kv)), mesh["tp"], _plan(kv_in_plan))
    if "fsdp" in mesh.mesh_dim_names:
        model = fully_shard(model, mesh=mesh["fsdp"], units=["layers_*"])
    state = init_train_state(model, OPT, params=_params(heads, kv))
    if kv_in_plan:  # stored cut over tp as planned (gathered at the call)
        kernel = state.params["layers_0"]["self_attn"]["k_proj"]["kernel"]
        n_tp = dict(dims)["tp"]
        assert {s.data.shape[1] for s in kernel.addressable_shards} == {kv * (HIDDEN // heads) // n_tp}
    step = make_train_step(model, _loss(model), OPT)
    losses = []
    for b in _batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref_losses, ref = _reference(heads, kv)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)

    batch = _batches()[0]
    hlo = executed_collectives(step, state, batch, scalars=False)
    comm = step.communication(state, batch)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), (kind, hlo, comm)
    assert hlo["all-to-all"]["count"] == hlo["collective-permute"]["count"] == 0
    # the k / v terms from the model's shapes: per layer and projection, its output (a data rank's batch,
    # kv heads x head dim, f32) made whole backward: an all-reduce of one head's part within the devices
    # sharing it (tp > kv), an all-gather across the heads (kv > 1); its (D, kv x hd) kernel all-gathered
    # forward when the plan cuts it
    sizes = dict(dims)
    n_data = sizes.get("dp", 1) * sizes.get("fsdp", 1)
    out = BATCH // n_data * SEQ * kv * (HIDDEN // heads) * 4
    kernel = HIDDEN * kv * (HIDDEN // heads) * 4
    whole = [r for r in comm["modules"] if r.get("whole_heads")]
    assert sorted(r["module"] for r in whole) == sorted(f"layers_{i}.self_attn.{p}_proj" for i in range(LAYERS)
                                                         for p in "kv")
    k = 2 * LAYERS
    act = comm["activations"]
    megatron_ar = LAYERS * (3 * BATCH // n_data * SEQ * HIDDEN * 4 + 2 * BATCH // n_data * SEQ * HIDDEN * 4)
    assert act["all-reduce"]["bytes"] == megatron_ar + k * (out // kv)  # q, gate, up's inputs; o, down's outputs
    assert act["all-gather"]["bytes"] == k * ((out if kv > 1 else 0) + (kernel if kv_in_plan else 0))


def test_a_projection_output_a_checkpoint_saves_is_still_read_into_heads():
    """``jax.checkpoint`` puts a ``reduce_precision`` (the identity at the value's own precision) after each value
    it saves: a re-gathering FSDP unit's policy saves a projection's output and recomputes its reshape into heads
    (``_fully_shard._saved``). Read through it, or the key / value projections of a re-gathering layer no longer
    run whole over tp (fsdp=2,tp=4: the step's HLO 45 all-gathers / 72,832 B where 39 / 66,688 B are its
    table)."""
    from jax.ad_checkpoint import checkpoint_name

    from spmd.parallel.step._heads import head_splits
    from spmd.parallel.styles._fully_shard import _saved
    from spmd.parallel.styles._tp_calls import WHOLE_MARK

    def f(w, x):
        y = checkpoint_name(x @ w, f"{WHOLE_MARK}attn.v_proj|4")
        h = y.reshape(*y.shape[:-1], 2, 8)  # 2 heads of 8
        return jnp.einsum("bhd,bhd->", h, h)

    jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=_saved("fsdp"))))(jnp.ones((16, 16)), jnp.ones((4, 16)))
    assert "reduce_precision" in str(jaxpr)  # between the marked output and its reshape
    assert head_splits(jaxpr.jaxpr) == {"attn.v_proj": (False, 4, 2, 16)}


def test_heads_with_no_even_split_over_tp_are_refused():
    """3 key/value heads over tp=2: neither divides the other (the query heads, 6, divide)."""
    model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_layers=1, num_heads=6,
                              num_kv_heads=3))
    params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = parallelize_module(model, mesh["tp"], _plan(True))
    state = init_train_state(pm, OPT, params=params)
    step = make_train_step(pm, _loss(pm), OPT)
    with pytest.raises(ValueError, match=re.escape(
            "parallelize_module: ColwiseParallel on 'layers_0.self_attn.k_proj' cuts its 12 output features over "
            "tp=2, and the model splits them into 3 heads of 4: 3 heads neither divide by tp=2 nor divide it")):
        step(state, _batches()[0])


@pytest.mark.slow
def test_fewer_kv_heads_than_tp_in_pipeline_stages_trains_as_one_device_and_its_table_is_the_hlo():
    """1 KV head at pp=2 x dp=2 x tp=2, 1F1B over 2 micro-batches: the stages' k / v projections run whole over
    tp as in make_train_step's step; 3 SGD steps equal 1-device training, the HLO's bytes the table's."""
    from spmd.parallel import pipeline

    heads, kv = 2, 1
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    model = pipeline(parallelize_module(Llama(_config(heads, kv)), mesh["tp"], _plan(True)), mesh["pp"],
                     units="layers_*", num_microbatches=2, schedule="1f1b")
    state = init_train_state(model, OPT, params=_params(heads, kv))
    step = make_train_step(model, _loss(model), OPT)
    losses = []
    for b in _batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref_losses, ref = _reference(heads, kv)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    batch = _batches()[0]
    hlo = executed_collectives(step, state, batch, scalars=False)
    table = step.communication(state, batch)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == table[kind]["bytes"], (kind, hlo, table)
    assert hlo["all-gather"]["count"] == table["tp"]["program"]["all-gather"]["count"] > 0  # the kernels, the heads
    assert hlo["all-to-all"]["count"] == 0


def test_a_projection_run_whole_over_tp_with_its_input_cut_on_the_batch_is_refused():
    """1 KV head over tp=2 whose style takes its input cut on the batch (the weight-stationary layout)."""
    from spmd import Shard

    model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1))
    params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = parallelize_module(model, mesh["tp"], {"layers_*.self_attn.k_proj": ColwiseParallel(input_layouts=Shard(0))})
    step = make_train_step(pm, _loss(pm), OPT)
    with pytest.raises(ValueError, match=re.escape(
            "parallelize_module: ColwiseParallel on 'layers_0.self_attn.k_proj' takes its input cut (Shard(dim=0): "
            "the weight-stationary layout's batch cut), and its output is split into 1 heads, fewer than tp=2")):
        step(init_train_state(pm, OPT, params=params), _batches()[0])


@pytest.mark.slow
def test_fewer_kv_heads_than_tp_under_sequence_parallelism_trains_as_one_device_and_its_table_is_the_hlo():
    """2 KV heads at dp=2 x tp=4 with sequence parallelism: the k / v projections gather their sequence-cut
    input whole (one all-gather each, its gradient sliced back) and run whole over tp."""
    from spmd import Replicate, Shard
    from spmd.parallel import SequenceParallel

    heads, kv = 4, 2
    col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    plan = {f"layers_*.self_attn.{p}_proj": col for p in "qkv"} | {
        "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
        "layers_*.mlp.down_proj": row, "layers_*.input_layernorm": SequenceParallel(),
        "layers_*.post_attention_layernorm": SequenceParallel(), "norm": SequenceParallel(),
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(Llama(_config(heads, kv)), mesh["tp"], plan)
    state = init_train_state(model, OPT, params=_params(heads, kv))
    step = make_train_step(model, _loss(model), OPT)
    losses = []
    for b in _batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref_losses, ref = _reference(heads, kv)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    batch = _batches()[0]
    hlo = executed_collectives(step, state, batch, scalars=False)
    comm = step.communication(state, batch)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), (kind, hlo, comm)
    whole = [r for r in comm["modules"] if r.get("whole_heads")]
    assert len(whole) == 2 * LAYERS and all(r["in_layout"] == Shard(1) for r in whole)
    assert hlo["all-to-all"]["count"] == hlo["collective-permute"]["count"] == 0


@pytest.mark.slow
def test_fewer_kv_heads_than_tp_inside_a_linen_scan_trains_as_one_device_and_its_table_is_the_hlo():
    """The blocks as one nn.scan (parameters stacked by layer), 2 KV heads at dp=2 x tp=4: the rule applies
    inside the scan's body, once per layer."""
    import dataclasses

    heads, kv = 4, 2
    cfg = dataclasses.replace(_config(heads, kv), scan_layers=True)
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {f"layers.self_attn.{p}_proj": col for p in "qkv"} | {
        "layers.self_attn.o_proj": row, "layers.mlp.gate_proj": col, "layers.mlp.up_proj": col,
        "layers.mlp.down_proj": row}
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(Llama(cfg), mesh["tp"], plan)
    params = Llama(cfg).init(jax.random.key(0), _batches()[0]["inputs"])["params"]
    state = init_train_state(model, OPT, _batches()[0]["inputs"], params=params)
    step = make_train_step(model, _loss(model), OPT)
    losses = []
    for b in _batches():
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref_losses, ref = train_one_device(params, _batches(), _loss(Llama(cfg)), OPT)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    batch = _batches()[0]
    hlo = executed_collectives(step, state, batch, scalars=False)
    comm = step.communication(state, batch)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), (kind, hlo, comm)
    # per layer and k / v projection: its kernel gathered forward, its output's heads gathered backward
    out = BATCH // 2 * SEQ * kv * (HIDDEN // heads) * 4
    assert comm["total"]["all-gather"]["bytes"] == 2 * LAYERS * (HIDDEN * kv * (HIDDEN // heads) * 4 + out)
    assert hlo["all-to-all"]["count"] == hlo["collective-permute"]["count"] == 0
