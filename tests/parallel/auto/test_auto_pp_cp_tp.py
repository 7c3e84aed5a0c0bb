"""auto_layout's pp x cp x tp candidates (``spmd.parallel.auto._cpep.pipelined``): a ``models.Llama`` (sdpa, 2 KV
heads) on 8 devices, given Megatron's plan (``models._plans.decoder_tp_plan``) and a sequence that cp=2 divides,
gets ``pp=2,cp=2,tp=2`` (the blocks in 2 stages, the sequence over cp, the projections over tp inside them: the
ring manual over tp too) beside the pp x cp ones, and none without a plan; ranked by ``auto_layout`` it prices its
step's table, whose every collective equals the compiled program's. With 1 KV head (fewer than tp) the stages run
k / v whole over tp, and ``models.Transformer``'s own einsum attention runs as GSPMD partitions it, over cp
uncounted (the table says so): refused with that reason, not standing for the tp-free pp x cp candidate weighed
beside it."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest

from models._plans import decoder_tp_plan
from spmd.parallel import apply_layout, auto_layout, hlo_executed_collectives, init_train_state, make_train_step
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._cpep import context_expert_layouts
from tests.parallel.auto.test_auto_cpep import CAL, KINDS, LLAMA, _batch

PLAN = decoder_tp_plan(LLAMA)  # q/k/v, gate/up column-, o/down row-parallel
ONE_KV = type(LLAMA)(dataclasses.replace(LLAMA.cfg, num_kv_heads=1))


def _pipelined_cp(model, plan, units="layers_*"):
    batch = _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    lays = [lay for lay in context_expert_layouts(8, plan, (units,), params, batch) if lay.pp > 1]
    return lays, params, batch


def test_a_llama_pipeline_gets_cp_times_tp_candidates_where_a_plan_is_given():
    lays, _, _ = _pipelined_cp(LLAMA, PLAN)
    # 8 rows over 16 tokens: pp=2 x cp x (dp, fsdp, tp) = 8; a replica of tp=2 (no data dim) has 8 rows (M=2, 4)
    assert sorted(lay.name for lay in lays) == sorted([
        "pp=2,dp=2,cp=2 1f1b M=2", "pp=2,dp=2,cp=2 1f1b M=4", "pp=2,fsdp=2,cp=2 1f1b M=2",
        "pp=2,fsdp=2,cp=2 1f1b M=4", "pp=2,cp=4 1f1b M=2", "pp=2,cp=4 1f1b M=4",
        "pp=2,cp=2,tp=2 1f1b M=2", "pp=2,cp=2,tp=2 1f1b M=4"])
    tp = next(lay for lay in lays if lay.tp == 2)
    assert tp.mesh_dims == (("pp", 2), ("dp", 1), ("cp", 2), ("tp", 2)) and dict(tp.tp_plan) == PLAN
    assert all(lay.tp == 1 for lay in _pipelined_cp(LLAMA, None)[0])  # no plan: no tp stages


@pytest.mark.slow  # one pipelined layout traced and compiled (~90 s on a loaded 2-core host)
def test_a_ranked_pipeline_with_cp_and_tp_prices_its_compiled_collectives():
    lays, params, batch = _pipelined_cp(LLAMA, PLAN)
    lay = next(lay for lay in lays if lay.name == "pp=2,cp=2,tp=2 1f1b M=2")
    got = auto_layout(LLAMA, optax.sgd(0.1), batch, 8, layouts=[lay], calibration=CAL, params=params, plan=PLAN)
    best = got.best
    assert best.name == lay.name and not got.rejected
    laid, _ = apply_layout(LLAMA, 8, best.layout)
    real = LLAMA.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), params=real)
    step = make_train_step(laid, default_loss(laid), optax.sgd(0.1))
    assert {r["method"] for r in step.attention(state, batch)} == {"ring (zigzag)"}
    hlo = hlo_executed_collectives(step.compiled(state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers (as tests/parallel/pipelining/test_pipeline_cp.py)
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind
    # the 4 sends of activations between the stages and the rings (zigzag, 108 permutes), as at pp=2,cp=2 without tp
    assert table["collective-permute"]["count"] == 4 + 108
    # priced from that table: the permutes, the all-reduces (tp's f and g inside the stages among them)
    assert best.comm_s["collective-permute"] > 0 and best.comm_s["all-reduce"] > 0
    # tp's all-reduces in the stages, as at pp=2 x cp=2 x tp=2 with Megatron's plan (test_pipeline_cp: 2 x 4 + 13 +
    # 13 + 12 over the ticks' switches)
    assert best.communication["activations"]["all-reduce"]["count"] == 46
    row = next(line for line in got.table().splitlines() if line.startswith("1 "))
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):  # the printed MiB
        assert f"{hlo[kind]['bytes'] / 2**20:.2f}" in row.split(), kind


def _transformer_plan(sequence_parallel: bool, tp_size: int):
    from models._plans import transformer_tp_plan

    return None if sequence_parallel else transformer_tp_plan(False, vocab_size=24, tp_size=tp_size)


@pytest.mark.slow  # two pipelined layouts traced, none compiled
@pytest.mark.parametrize("which", ["one-kv-head", "einsum-attention"])
def test_tp_stages_whose_table_leaves_cp_out_are_refused_with_the_reason(which):
    """1 KV head (fewer than tp): k / v run whole over tp; ``models.Transformer``'s own einsum attention under tp:
    GSPMD partitions it over cp. Either way the table says what it leaves out (``uncounted``), and the candidate
    is refused with it (before the ring in tp stages no pp x cp x tp candidate was offered)."""
    from models import Transformer

    model, plan, units, said = {
        "one-kv-head": (ONE_KV, PLAN, "layers_*", "the projections run whole over tp (fewer heads than tp: "),
        "einsum-attention": (Transformer(24, 16, num_layers=2, d_model=16, num_heads=2), _transformer_plan,
                             "block_*", "the units' own attention ('attn') runs as GSPMD partitions it over 'cp'")}[which]
    lays, params, batch = _pipelined_cp(model, plan, units)
    # the tp candidate first: its refusal must not stand for the tp-free pp x cp one
    picked = [next(lay for lay in lays if lay.name == name)
              for name in ("pp=2,cp=2,tp=2 1f1b M=2", "pp=2,dp=2,cp=2 1f1b M=2")]
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=picked, calibration=CAL, params=params, plan=plan)
    assert [c.name for c in got] == ["pp=2,dp=2,cp=2 1f1b M=2"]
    ((name, why),) = got.rejected
    assert name == "pp=2,cp=2,tp=2 1f1b M=2"
    assert why.startswith("auto_layout: layout 'pp=2,cp=2,tp=2 1f1b M=2': not weighed, its table leaving "
                          "collectives out (it would be priced below what its program moves; the pp x cp layouts "
                          "without tp in the stages are weighed): cp=2 with tp in the stages: " + said), why
