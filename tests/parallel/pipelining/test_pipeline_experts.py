"""Expert parallelism inside pipeline stages: ``pipeline(parallelize_module(model, mesh["ep"], {experts:
ExpertParallel()}), mesh["pp"])``.

``models.MoE`` with experts in every block (``moe_every=1``: the blocks are units of one shape) on ``pp=2 x ep=2``
(1F1B), ``pp=2 x dp=2 x ep=2`` (GPipe, 1F1B), ``pp=2 x fsdp=2 x ep=2`` (1F1B, the stages cut over fsdp too),
``pp=2 x ep=2 x tp=2`` (the attention's projections over tp inside the stages too) and the blocks as one ``nn.scan``
stack on ``pp=2 x fsdp=2 x ep=2`` (its layers the units): the stage parameters carry the experts cut over ep (``Shard(1)``
of the stacked experts), the experts module runs under ExpertParallel inside each stage's ticks, expert gradients
are averaged over the data dims but ep; 3 SGD steps equal one device's within 1e-5, and the compiled program's
all-to-alls, all-reduces and collective-permutes equal the pipeline's table (the all-to-alls counted per branch of
each tick: a forward 2, a backward 4, the recomputed forward's and their transposes). What the units sow (each MoE
block's dropped assignments) reaches the step's metrics, ``metrics["intermediates/layers_i/mlp/dropped"]``, equal
to a NumPy count of the capacity routing."""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest

import spmd
from models import MoE, MoEConfig
from spmd.parallel import (ColwiseParallel, ExpertParallel, RowwiseParallel, fully_shard, hlo_executed_collectives, init_train_state,
                           make_train_step, parallelize_module, pipeline, unshard_params)
from tests._one_device import assert_trees_close, train_one_device

T, V = 16, 24
CFG = MoEConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                num_experts=8, top_k=2, capacity_factor=1.0, moe_every=1)
PLAN = {"layers_*.mlp.experts": ExpertParallel()}


def _loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,schedule", [((2, 2), ("pp", "ep"), "1f1b"),
                                                  ((2, 2, 2), ("pp", "dp", "ep"), "gpipe"),
                                                  ((2, 2, 2), ("pp", "dp", "ep"), "1f1b"),
                                                  ((2, 2, 2), ("pp", "fsdp", "ep"), "1f1b")])
def test_moe_pipeline_with_experts_over_ep_equals_one_device(shape, names, schedule):
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(3)]
    model = MoE(CFG)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    laid = parallelize_module(model, mesh["ep"], PLAN)
    if "fsdp" in names:  # the stages cut over fsdp too, on another dim than the experts'
        laid = fully_shard(laid, mesh=mesh["fsdp"])
    pm = pipeline(laid, mesh["pp"], num_microbatches=2, schedule=schedule)
    state = init_train_state(pm, opt, params=params)
    e = state.plan.entry("stages/mlp/experts/gate_proj")  # [stages, E, d, f]: stages over pp, experts over ep
    fsdp = "fsdp" in names  # fsdp cuts the largest other dim: f (32)
    assert [str(p) for p in e.placements] == ["S(0)", "S(3)" if fsdp else "R", "S(1)"][:len(shape) - 1] + ["S(1)"]
    local = (1, 4, 16, 16 if fsdp else 32)
    assert e.local_shape == local
    assert state.params["stages"]["mlp/experts/gate_proj"].addressable_shards[0].data.shape == local
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    # per device and micro-batch: 8 rows / (data ranks x M=2) -> buffers [rows, 8 experts, capacity 4, 16] float32
    rows = 8 // (int(np.prod(shape)) // 2 * 2)
    nbytes = rows * 8 * 4 * 16 * 4
    # the program: rank 0 (first stage) 2 forwards (dispatch + combine) and 2 backwards (the recomputed forward's
    # 2 and their transposes), rank 1 (last) 2 backwards; each tick's switch holds each branch some rank runs
    # then: 1F1B and GPipe at M=2 hold F-first x2, B-first x2, B-last x2
    assert comm["ep"]["per_rank"] == [{"count": 12, "bytes": 12 * nbytes}, {"count": 8, "bytes": 8 * nbytes}]
    assert comm["all-to-all"] == {"count": 20, "bytes": 20 * nbytes}
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (20, 20 * nbytes)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind
    assert hlo["collective-permute"]["count"] == comm["collective-permute"]["count"]
    # the all-reduces: with dp, every stage gradient (the experts over dp only: 24,576 B of experts a device)
    # and the rest (3,136 B); without dp, the non-expert stage gradients over ep (3,712 B) and the rest
    if "fsdp" in names:  # each stage parameter gathered once over fsdp, its gradient reduce-scattered once
        assert (hlo["all-gather"]["count"], hlo["reduce-scatter"]["count"]) == (10, 10)
    else:
        assert comm["all-reduce"]["bytes"] == (3136 + 3712 + 24576 if "dp" in names else 3136 + 3712)


TP_PLAN = {"layers_*.self_attn.q_proj": ColwiseParallel(), "layers_*.self_attn.k_proj": ColwiseParallel(),
           "layers_*.self_attn.v_proj": ColwiseParallel(), "layers_*.self_attn.o_proj": RowwiseParallel()}


@pytest.mark.slow
def test_moe_pipeline_with_tp_stages_and_experts_over_ep_equals_one_device():
    """pp=2 x ep=2 x tp=2 (1F1B, M=2): the attention's projections cut over tp, the experts over ep, both inside the
    stages; 3 AdamW steps equal one device's (the parameters and the optimizer's moments) within 1e-5, and every
    collective of the compiled program equal to the table. (lr 1e-3: Adam divides a gradient by its own size, so an
    entry whose gradient is near 0 moves by up to lr on float32 rounding of the sums in another order; at 1e-2
    one expert entry of 4,096 differed by 1.6e-5.)"""
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(3)]
    model = MoE(CFG)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.adamw(1e-3)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "ep", "tp"))
    laid = parallelize_module(parallelize_module(model, mesh["ep"], PLAN), mesh["tp"], TP_PLAN)
    pm = pipeline(laid, mesh["pp"], num_microbatches=2, schedule="1f1b")
    state = init_train_state(pm, opt, params=params)
    e = state.plan.entry("stages/mlp/experts/gate_proj")  # [stages, E, d, f]: experts over ep, whole over tp
    assert ([str(p) for p in e.placements], e.local_shape) == (["S(0)", "S(1)", "R"], (1, 4, 16, 32))
    q = state.plan.entry("stages/self_attn/q_proj/kernel")  # [stages, d, heads x head_dim]: columns over tp
    assert ([str(p) for p in q.placements], q.local_shape) == (["S(0)", "R", "S(2)"], (1, 16, 8))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    own = pm.unstack_state(state, opt)
    assert_trees_close(own.params, ref.params)
    assert_trees_close(own.opt_state, ref.opt_state)
    for kind in ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind
    assert hlo["all-to-all"]["count"] == comm["all-to-all"]["count"] == 20
    assert hlo["collective-permute"]["count"] == comm["collective-permute"]["count"]
    # per device and micro-batch: 8 rows / (ep=2 x M=2) = 2 rows; the buffers [2, 8 experts, capacity 4, 16] float32
    assert comm["all-to-all"]["bytes"] == 20 * 2 * 8 * 4 * 16 * 4
    # the all-reduces over tp, an activation [2, 16, 16] float32 (2,048 B) each: o_proj's in each forward (F-first
    # x2; the recomputed ones of B-first x2 and B-last x2: live, the experts' router reads them) and q/k/v's input
    # gradients in each backward (x4); then the gradients: the stage ones but the experts over ep (their tp blocks,
    # 2,176 B), the rest over pp and ep (3,136 B)
    assert comm["all-reduce"]["bytes"] == 6 * 2048 + 4 * 3 * 2048 + 2176 + 3136


@pytest.mark.slow
def test_scanned_moe_pipeline_with_experts_over_ep_equals_one_device():
    """models.MoE's 4 blocks as one nn.scan stack (scan_layers=True), its layers the units (units='layers'): 2
    stages, each a scan over 2 layers, on pp=2 x fsdp=2 x ep=2 (1F1B, M=2); the stacked experts cut over ep on their
    experts dim inside the stages, the rest over fsdp; 3 steps of SGD with momentum equal one device's (parameters
    and momenta) within 1e-5, every collective of the compiled program equal to the table. (AdamW at 1e-3: one
    expert entry of 16,384 off by 1.6e-5, Adam dividing a near-zero gradient by its own size; the momenta carry
    the gradients' sums as they are.)"""
    cfg = dataclasses.replace(CFG, num_layers=4, scan_layers=True)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(3)]
    model = MoE(cfg)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1, momentum=0.9)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "fsdp", "ep"))
    laid = fully_shard(parallelize_module(model, mesh["ep"], {"layers.mlp.experts": ExpertParallel()}),
                       mesh=mesh["fsdp"])
    pm = pipeline(laid, mesh["pp"], units="layers", num_microbatches=2, schedule="1f1b")
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    e = state.plan.entry("stages/mlp/experts/gate_proj")  # [layers, E, d, f]: layers over pp, experts over ep
    assert ([str(p) for p in e.placements], e.local_shape) == (["S(0)", "S(3)", "S(1)"], (2, 4, 16, 16))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    own = pm.unstack_state(state, opt)
    assert_trees_close(own.params, ref.params)
    assert_trees_close(own.opt_state, ref.opt_state)
    for kind in ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind
    # a micro-batch's row a device: buffers [1, 8 experts, capacity 4, 16] float32 = 2,048 B; each stage's 2 layers
    # 2 all-to-alls forward: F-first x2 (8), B-first x2 and B-last x2 (the recomputed forward's and the backward's:
    # 16 each)
    assert hlo["all-to-all"]["count"] == comm["all-to-all"]["count"] == 40
    assert comm["all-to-all"]["bytes"] == 40 * 2048


@pytest.mark.slow
def test_moe_interleaved_pipeline_with_experts_over_ep_equals_one_device():
    """4 blocks in 4 stages, 2 a rank (interleaved 1F1B, M=2) on pp=2 x dp=2 x ep=2: equal to one device, every
    collective equal to the table. Per rank, per micro-batch: a forward on each chunk but the last stage (2
    all-to-alls), a backward on each (4): rank 0 (stages 0, 2) 2 x (2 + 2 + 4 + 4) = 24, rank 1 (stages 1, 3)
    2 x (2 + 4 + 4) = 20; the program holds a branch two ranks run at one tick once."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    rng = np.random.default_rng(1)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(3)]
    model = MoE(cfg)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "ep"))
    pm = pipeline(parallelize_module(model, mesh["ep"], PLAN), mesh["pp"], num_microbatches=2,
                  schedule="interleaved", stages_per_rank=2)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    nbytes = 1 * 8 * 4 * 16 * 4  # a micro-batch's row: buffers [1, 8 experts, capacity 4, 16] float32
    assert comm["ep"]["per_rank"] == [{"count": 24, "bytes": 24 * nbytes}, {"count": 20, "bytes": 20 * nbytes}]
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (comm["all-to-all"]["count"],
                                                                         comm["all-to-all"]["bytes"])
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind


@pytest.mark.slow
def test_the_drops_sown_in_the_stages_reach_the_metrics():
    from tests.parallel.test_expert_step import _loss as _sowing_loss
    from tests.parallel.test_expert_step import _numpy_drops

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(2)]
    model = MoE(CFG)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _sowing_loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pm = pipeline(parallelize_module(model, mesh["ep"], PLAN), mesh["pp"], num_microbatches=2, schedule="1f1b")
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, _sowing_loss(model), opt)
    # the loss's own aux 'dropped' reads the units' sown drops: warned, the step's metrics carry them
    with pytest.warns(UserWarning, match=re.escape("pipeline: loss_fn's aux['dropped'] reads 'mlp/dropped', which "
                                                   "unit 'layers_0' sows")):
        comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (20, comm["all-to-all"]["bytes"])
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind
    assert hlo["collective-permute"]["count"] == comm["collective-permute"]["count"]
    p, losses = params, []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        sown = {k: v for k, v in m.items() if k.startswith("intermediates/")}
        assert sorted(sown) == [f"intermediates/layers_{i}/mlp/{n}" for i in (0, 1)
                                for n in ("dropped", "load_balancing")]
        # averaged over the data ranks (ep=2) and the 2 micro-batches, as the loss: x4 is the batch's count
        got = 4 * sum(float(sown[f"intermediates/layers_{i}/mlp/dropped"]) for i in (0, 1))
        assert got == _numpy_drops(MoE(CFG), p, b["tokens"]) > 0
        p = unshard_params(pm, state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
