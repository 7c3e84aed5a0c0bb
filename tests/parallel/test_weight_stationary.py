"""The weight-stationary layout (``Layout(weight_stationary=True)``, ``weight_stationary_plan``): applied through
the contract (``apply_layout``), its compiled step's collectives equal the analytic table exactly, the weights
never move (every byte it communicates is an activation, or a whole parameter's gradient), training equals one
device, and its errors. Each configuration compiles once (lru_cache) and trains a few AdamW steps of a tiny
transformer whose heads (8), vocabulary (8) and MLP width (32) divide every tp size."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _one_device import train_one_device
from _sort_task import sort_loss, sort_task
from models import Transformer
from models._plans import transformer_tp_plan
from spmd import Replicate, Shard
from spmd.parallel import (Calibration, ColwiseParallel, Layout, RowwiseParallel, SequenceParallel, apply_layout,
                           executed_collectives, init_train_state, make_train_step, unshard_params, unshard_tree,
                           weight_stationary_plan)
from spmd.parallel.auto._auto import candidate_layouts, evaluate_layout

STEPS, BATCH, SEQ = 4, 16, 8
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
MODEL = Transformer(vocab_size=8, max_len=SEQ, num_layers=2, d_model=16, num_heads=8, mlp_ratio=2)
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


WS = tuple(weight_stationary_plan(transformer_tp_plan(True)).items())  # every tp size divides its cuts


def _cal() -> Calibration:
    return Calibration(collectives={k: (1e-4, 1e9) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                             "collective-permute")},
                       matmul_flops_per_s=1e10, elementwise_bytes_per_s=1e10, dispatch_s=1e-4, group_size=8)


CONFIGS = {  # name -> layout
    "dp=1,tp=8 ws": Layout(tp=8, tp_plan=WS, weight_stationary=True),
    "fsdp=2,tp=4 ws regather accum=2": Layout(fsdp=2, tp=4, tp_plan=WS, weight_stationary=True,
                                               units=("block_*",), accum_steps=2),
    "dp=2,fsdp=2,tp=2 ws keep": Layout(dp=2, fsdp=2, tp=2, tp_plan=WS, weight_stationary=True, units=("block_*",),
                                       reshard_after_forward=False),
}


def _cases():
    return [pytest.param(n, id=n.replace(" ", "-"), marks=pytest.mark.xdist_group("ws-" + n)) for n in CONFIGS]


@functools.lru_cache(maxsize=None)
def _data():
    return sort_task(MODEL, STEPS, BATCH, SEQ, seed=1)


loss_fn = sort_loss(MODEL)


@functools.lru_cache(maxsize=None)
def _run(name):
    lay = CONFIGS[name]
    params, batches = _data()
    model, mesh = apply_layout(MODEL, 8, lay)
    state = init_train_state(model, OPT, params=params)
    step = make_train_step(model, loss_fn, OPT, accum_steps=lay.accum_steps)
    hlo = executed_collectives(step, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return mesh, model, losses, state, hlo, table


def test_the_plan_moves_the_sequence_cuts_to_the_batch():
    sp = transformer_tp_plan(True)
    ws = weight_stationary_plan(sp)
    assert list(ws) == list(sp)
    assert ws["block_*.ln1"] == SequenceParallel(sequence_dim=0)
    assert ws["block_*.fc"] == ColwiseParallel(input_layouts=Shard(0))
    assert ws["block_*.fc_out"] == RowwiseParallel(output_layouts=Shard(0))
    assert ws["block_*.attn.proj"] == RowwiseParallel(input_layouts=Shard(2), output_layouts=Shard(0))  # heads kept
    assert ws["block_*.attn.qkv"] == ColwiseParallel(dim=2, input_layouts=Shard(0))
    assert ws["embed"] == RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    lay = CONFIGS["dp=1,tp=8 ws"]
    assert lay.name == "dp=1,tp=8 ws" and CONFIGS["dp=2,fsdp=2,tp=2 ws keep"].name == "dp=2,fsdp=2,tp=2 ws keep"
    # the kernels are cut as under sequence parallelism: the same parameter plan
    p = _data()[0]
    a = apply_layout(MODEL, 8, lay)[0].plan(p)
    b = apply_layout(MODEL, 8, Layout(tp=8, tp_plan=tuple(sp.items()), sequence_parallel=True))[0].plan(p)
    assert [e.placements for e in a.entries] == [e.placements for e in b.entries]


@pytest.mark.parametrize("name", _cases())
def test_collectives_equal_the_table_exactly(name):
    """Every tensor collective of the compiled step (buffers and bytes per kind) is the table's, the position
    table's gradient all-reduce over tp included; nothing else (no all-to-all, no permute)."""
    *_, hlo, table = _run(name)
    for k in KINDS:
        assert (hlo[k]["buffers"], hlo[k]["bytes"]) == (table["total"][k]["count"], table["total"][k]["bytes"]), \
            (k, hlo[k], table["total"][k])
    assert hlo["all-to-all"]["count"] == hlo["collective-permute"]["count"] == 0
    # per micro-batch: each block all-gathers qkv's and fc's inputs (forward) and the row-parallel outputs of
    # attn.proj and fc_out (backward): 4; the embedding's output (backward), the head's input and logits: 3
    assert table["activations"]["all-gather"]["count"] == CONFIGS[name].accum_steps * (4 * MODEL.num_layers + 3)


def test_the_weights_never_move():
    """On dp=1,tp=8 every byte is an activation (or a whole parameter's gradient): no parameter term at all,
    and what the activations move is the batch's: per layer input / output, not the weights."""
    *_, hlo, table = _run("dp=1,tp=8 ws")
    assert all(v["count"] == 0 for v in table["parameters"].values())
    d, tokens = MODEL.d_model, BATCH * SEQ
    # each block: q/k/v's and fc's inputs and the two row-parallel outputs, gathered / scattered whole
    # (4 x tokens x d floats each way); the embedding's reduce-scatter, the head's input and logits
    per_block = 4 * tokens * d * 4
    logits = tokens * MODEL.vocab_size * 4
    assert table["activations"]["all-gather"]["bytes"] == 2 * per_block + tokens * d * 4 * 2 + logits
    assert table["activations"]["reduce-scatter"]["bytes"] == 2 * per_block + tokens * d * 4 * 2 + logits
    # the whole parameters' gradients: 5 norms (scale, bias), 4 row-parallel biases, the position table
    assert table["activations"]["all-reduce"]["bytes"] == 4 * (5 * 2 * d + 4 * d + SEQ * d)
    assert hlo["all-reduce"]["bytes"] == table["total"]["all-reduce"]["bytes"]


@pytest.mark.parametrize("name", _cases())
def test_matches_one_device(name):
    mesh, model, losses, state, *_ = _run(name)
    params, batches = _data()
    ref_losses, ref = train_one_device(params, batches, loss_fn, OPT)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    opt = unshard_tree(state.opt_state, state.plan, mesh, optimizer=OPT)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_a_whole_embedding_is_counted_too():
    """A vocabulary tp does not divide (11 over 8) keeps the embedding whole (``PrepareModuleOutput``: its
    output sliced onto the batch, the gradient all-gathered back) and the tied head runs on the device's
    sequences (the table's gradient all-reduced over tp): the HLO still equals the table."""
    model = Transformer(vocab_size=11, max_len=SEQ, num_layers=1, d_model=16, num_heads=8, mlp_ratio=2)
    plan = tuple(weight_stationary_plan(transformer_tp_plan(True, vocab_size=11, tp_size=8)).items())
    laid, mesh = apply_layout(model, 8, Layout(tp=8, tp_plan=plan, weight_stationary=True))
    batch = {k: v % 11 for k, v in _data()[1][0].items()}
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, OPT, params=params)

    def loss(p, b):
        logp = jax.nn.log_softmax(model.apply({"params": p}, b["inputs"]))
        return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], axis=-1))

    step = make_train_step(laid, loss, OPT)
    hlo, table = executed_collectives(step, state, batch, scalars=False), step.communication(state, batch)
    for k in KINDS:
        assert (hlo[k]["buffers"], hlo[k]["bytes"]) == (table["total"][k]["count"], table["total"][k]["bytes"]), k
    assert any(r["style"] == "PrepareModuleOutput" for r in table["modules"])


def test_the_chooser_weighs_it_and_its_bytes_are_the_steps():
    def plan(sequence_parallel, tp_size):
        return transformer_tp_plan(sequence_parallel, vocab_size=8, tp_size=tp_size)

    names = [c.name for c in candidate_layouts(8, plan, ("block_*",))]
    assert {"dp=1,tp=8 ws", "dp=2,tp=4 ws", "fsdp=2,tp=4 ws regather", "dp=2,fsdp=2,tp=2 ws keep"} <= set(names)
    params, batches = _data()
    c = evaluate_layout(MODEL, OPT, batches[0], 8, CONFIGS["dp=1,tp=8 ws"], loss_fn=loss_fn, params=params,
                        calibration=_cal())
    assert c.name == "dp=1,tp=8 ws" and c.communication["total"] == _run("dp=1,tp=8 ws")[5]["total"]


def test_bad_weight_stationary_layouts_are_clear_errors():
    sp = tuple(transformer_tp_plan(True).items())
    with pytest.raises(ValueError, match=re.escape("Layout: weight_stationary=True needs a tp_plan that cuts the "
                                                   "activations on the batch (dim 0)")):
        Layout(tp=8, tp_plan=sp, weight_stationary=True)
    with pytest.raises(ValueError, match=re.escape("Layout: weight_stationary=True with tp=1")):
        Layout(dp=8, weight_stationary=True)
    with pytest.raises(ValueError, match=re.escape("weight_stationary_plan: the plan cuts no activation on dim 1")):
        weight_stationary_plan(transformer_tp_plan(False))
    with pytest.raises(TypeError, match=re.escape("weight_stationary_plan: plan=None must be")):
        weight_stationary_plan(None)
    params, batches = _data()
    odd = {k: v[:12] for k, v in batches[0].items()}  # 12 sequences over tp=8
    with pytest.raises(ValueError, match=re.escape("auto_layout: layout 'dp=1,tp=8 ws' cuts each micro-batch of a "
                                                   "data replica (batch 12 / (dp x fsdp x accum_steps = 1)) over "
                                                   "tp=8 on the batch, which does not divide it; use a batch that "
                                                   "is a multiple of 8.")):
        evaluate_layout(MODEL, OPT, odd, 8, CONFIGS["dp=1,tp=8 ws"], loss_fn=loss_fn, params=params,
                        calibration=_cal())
