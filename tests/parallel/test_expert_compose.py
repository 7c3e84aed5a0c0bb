"""ep composed with the other dims on ``models.MoE``'s blocks as one ``nn.scan`` stack (``scan_layers=True``, experts
in each of its layers): tp (the attention's projections over tp inside the scanned body, dp=2 x tp=2 x ep=2, AdamW:
parameters and moments), gradient accumulation (accum_steps=2 under dp=2 x ep=4 and dp=2 x fsdp=2 x ep=2) and cp
(dp=2 x cp=2 x ep=2: the ring over cp and the experts over ep in the scan's body); each equal to one device's
training within 1e-5 and the compiled step's collectives equal to the step's table (under cp: the ring's permutes
and the gradients' all-reduces over cp counted once per layer of the scan, the cp=2 ring's backward hop its own in
the backward loop, the gradients' all-reduces over cp once per micro-batch; ``models.Llama``'s scanned stack under
dp=4 x cp=2 too). pp x fsdp x ep x tp on 16 devices:
``tests/parallel/pipelining/test_pipeline_experts_16.py``.
"""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest

import spmd
from models import Llama, LlamaConfig, MoE
from spmd.parallel import (ColwiseParallel, ExpertParallel, RowwiseParallel, executed_collectives, fully_shard,
                           hlo_executed_collectives, init_train_state, make_train_step, parallelize_module,
                           unshard_params, unshard_tree)
from tests._one_device import assert_trees_close, train_one_device
from tests.parallel.test_expert_step import CFG, V, _batches, _loss, _router_flops

SCANNED = dataclasses.replace(CFG, num_layers=4, moe_every=1, scan_layers=True)
EP = {"layers.mlp.experts": ExpertParallel()}
SCANNED_TP = {**{f"layers.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
              "layers.self_attn.o_proj": RowwiseParallel()}


def _compiled(step, state, batch):
    return executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)


def _assert_table_is_hlo(comm, hlo, kinds=("all-gather", "reduce-scatter", "all-reduce")):
    for kind in kinds:  # the table counts each array moved (the HLO's buffers: XLA combines some into one op)
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (comm["total"]["all-to-all"]["count"],
                                                                         comm["total"]["all-to-all"]["bytes"])


@pytest.mark.slow
def test_scanned_moe_under_dp2_tp2_ep2_equals_one_device():
    """The scanned stack's attention projections over tp (``layers.self_attn.*``, stacked [L, d, heads x hd]: cut on
    dim 2), its experts over ep ([L, E, d, f] on dim 1), whole over tp; 3 AdamW steps equal one device's,
    parameters and both moments, within 1e-5."""
    model = MoE(SCANNED)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.adamw(1e-3)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "ep"))
    pm = parallelize_module(parallelize_module(model, mesh["ep"], EP), mesh["tp"], SCANNED_TP)
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    e = state.plan.entry("layers/mlp/experts/gate_proj")
    assert ([str(p) for p in e.placements], e.local_shape) == (["R", "R", "S(1)"], (4, 4, 16, 32))
    q = state.plan.entry("layers/self_attn/q_proj/kernel")
    assert ([str(p) for p in q.placements], q.local_shape) == (["R", "S(2)", "R"], (4, 16, 8))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    assert_trees_close(unshard_tree(state.opt_state, state.plan, mesh, optimizer=opt), ref.opt_state)
    _assert_table_is_hlo(comm, hlo)
    # per device: 8 rows / (dp=2 x ep=2) = 2 rows -> buffers [2, 8 experts, capacity 4, 16] float32 = 4,096 B;
    # per layer dispatch and combine forward and their transposes backward: 4 x 4 layers
    assert comm["experts"]["all-to-all"] == {"count": 16, "bytes": 16 * 4096}
    # over tp, an activation [2, 16, 16] float32 (2,048 B) each: o_proj's output forward, q/k/v's input gradients
    # backward, in each of 4 layers
    assert comm["activations"]["all-reduce"] == {"count": 16, "bytes": 16 * 2048}


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 4), ("dp", "ep")), ((2, 2, 2), ("dp", "fsdp", "ep"))])
def test_scanned_moe_with_accumulation_under_ep_equals_one_device(shape, names):
    """accum_steps=2: each device's rows in 2 micro-batches, the scan's body exchanging each micro-batch's tokens
    per layer; with fsdp the stack is one unit (gathered once for both micro-batches). 3 SGD steps equal one
    device's on the whole batch within 1e-5."""
    model = MoE(SCANNED)
    batches = _batches(b=16)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = parallelize_module(model, mesh["ep"], EP)
    if "fsdp" in names:
        pm = fully_shard(pm, mesh=mesh["fsdp"], units=["layers"])
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    step = make_train_step(pm, _loss(model), opt, accum_steps=2)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo)
    # per device and micro-batch: 16 rows / (8 data ranks x 2) = 1 row -> buffers [1, 8, 4, 16] float32 = 2,048 B;
    # 4 a layer (dispatch, combine and their transposes) x 4 layers x 2 micro-batches
    assert comm["experts"]["all-to-all"] == {"count": 32, "bytes": 32 * 2048}
    if "fsdp" in names:  # every parameter gathered once per step (not per micro-batch), its gradient scattered once
        assert comm["total"]["all-gather"]["count"] == comm["total"]["reduce-scatter"]["count"] == 13


def test_a_batch_ep_and_accumulation_do_not_divide_is_refused_by_the_table_too():
    """8 rows over dp=2 x ep=4 (ep's devices take their own rows) x accum_steps=2: the table refuses it as the
    step does, naming the sizes (it used to fail in a reshape of the micro-batches)."""
    model = MoE(SCANNED)
    batch = _batches(1)[0]
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    pm = parallelize_module(model, mesh["ep"], EP)
    opt = optax.sgd(0.1)
    params = model.init(jax.random.key(0), batch["tokens"])["params"]
    state = init_train_state(pm, opt, batch["tokens"], params=params)
    step = make_train_step(pm, _loss(model), opt, accum_steps=2)
    want = re.escape("the batch has 8 examples, not divisible by the data-parallel size dp=2 x ep=4 = 8 times "
                     "accum_steps=2; use a batch size that is a multiple of 16.")
    with pytest.raises(ValueError, match=want):
        step.communication(state, batch)
    with pytest.raises(ValueError, match=want):
        step(state, batch)


def _cp_batches(n=16, b=8):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, V, (b, n)).astype(np.int32),
             "labels": rng.integers(0, V, (b, n)).astype(np.int32)} for _ in range(3)]


def _plain_loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


@pytest.mark.slow
@pytest.mark.parametrize("scan,accum", [(True, 1), (True, 2), (False, 2)])
def test_scanned_moe_under_dp2_cp2_ep2_equals_one_device(scan, accum):
    """The scan's body (4 layers) runs its attention as the zigzag ring over cp, its MoE block's routing on the
    sequence gathered over cp and its experts over ep; 3 SGD steps equal one device's within 1e-5, every kind of
    collective equal to the table: per layer the ring's 16 permutes (K, V forward, their backward hop: a loop of
    its own, dK, dV home, the zigzag's moves of q, k, v and the output), the stacked gradients summed over cp in
    the backward loop, layer by layer (55 all-reduced buffers: 13 over dp, 2 + 4 x 10 over cp, the router's kernel
    among them: its projection runs on the device's positions, 1/cp of its matmul flops). With accum_steps=2
    (scanned or not: the blocks layers_0..3, the ring's backward hop at cp=2 then the forward's) every activation's
    collective and the gradients' sums over cp run once per micro-batch."""
    model = MoE(dataclasses.replace(SCANNED, attn_implementation="sdpa", scan_layers=scan))
    batches = _cp_batches(b=8 * accum)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "ep"))
    pm = parallelize_module(model, mesh["ep"], EP if scan else {"layers_*.mlp.experts": ExpertParallel()})
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    step = make_train_step(pm, _loss(model), opt, accum_steps=accum)
    table = step.table(state, batches[0])
    comm = step.communication(state, batches[0])
    text = step._build(state.plan).jitted.lower(state, batches[0]).compile().as_text()
    hlo = hlo_executed_collectives(text, scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo, KINDS)
    # the scan's body: its last trace's call
    assert table.count("jax.nn.dot_product_attention: ring (zigzag) over cp=2") == (1 if scan else 4)
    # the router's projection on the device's positions: its 3 matmuls (forward, input and kernel gradients) on
    # 2 rows x 8 of the 16 positions x d 16 x E 8, once in the scan's loop bodies (4 blocks unscanned)
    assert table.count("router' on the device's positions, its output gathered, its gradients summed over cp") == (
        1 if scan else 4)
    if accum == 1:
        assert _router_flops(text) == 3 * 2 * (2 * 8 * 16 * 8)
    # per device and micro-batch: 2 rows -> buffers [2, 8 experts, capacity 4, 16] float32, each device of cp
    # sending its row (2,048 B), 4 a layer
    assert comm["experts"]["all-to-all"] == {"count": 16 * accum, "bytes": 16 * 2048 * accum}
    # per layer: K, V [2, 8, 2, 4] float32 (512 B) forward and (scanned) backward, dK, dV twice (512 B), the zigzag's
    # halves of q, o (512 B) and k, v (256 B) each way: 16 permutes, 7,168 B (14, 6,144 B unscanned)
    per = (16, 7168) if scan else (14, 6144)
    assert comm["context"]["collective-permute"] == {"count": 4 * per[0] * accum, "bytes": 4 * per[1] * accum}


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_scanned_llama_under_dp4_cp2_table_equals_its_compiled_collectives(accum):
    """``models.Llama``'s blocks as one nn.scan stack (sdpa) with the sequence over cp: 2 SGD steps equal one
    device's, the table's permutes (the ring's, per layer) and all-reduces (the stacked gradients over cp, per
    layer) equal to the compiled step's; with accum_steps=2 each micro-batch's (the gradients summed over cp in the
    accumulation loop: the table counted them once per step)."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      scan_layers=True, attn_implementation="sdpa")
    model = Llama(cfg)
    batches = _cp_batches(b=8 * accum)[:2]
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _plain_loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "cp"))
    state = init_train_state(model, opt, batches[0]["tokens"], params=params, mesh=mesh)
    step = make_train_step(model, _plain_loss(model), opt, mesh=mesh, accum_steps=accum)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)
    for kind in KINDS:
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind
    # 2 layers x 16 permutes, 7,168 B (as the MoE's: the same attention); 9 stacked gradients x 2 layers + the
    # final norm's and the head's over cp
    assert comm["context"]["collective-permute"] == {"count": 32 * accum, "bytes": 2 * 7168 * accum}
    assert comm["context"]["all-reduce"]["count"] == 20 * accum
