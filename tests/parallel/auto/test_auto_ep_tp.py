"""auto_layout's ep x tp candidates cut the experts over tp too, as ``models.train`` does (``layout_model``):
``models.MoE`` (experts in every block, d=16, f=32) on 8 devices with Megatron's plan of its attention
(``decoder_tp_plan``) gets, in its ``dp=2,ep=2,tp=2`` candidate (and the pipelined ``pp=2,ep=2,tp=2`` ones), the
experts' ``ExpertTensorParallel`` beside that plan: gate/up ``[E, d, f]`` on ``Shard(2)``, down ``[E, f, d]`` on
``Shard(1)`` over tp. Its table equals the compiled step's collectives, and it prices 1/(ep x tp) of the experts'
bytes per device. With the sequence over cp too (``cp=2,ep=2,tp=2``, sdpa attention: the ring) the experts are cut
over tp as well, and that candidate's table equals its compiled step's collectives; so are a scanned MoE's stacked
experts ``[L, E, d, f]`` (past the layer axis: ``dp=2,ep=2,tp=2``, table equal to its compiled step's). Where the
shapes do not tell d from f (or tp does not divide f), the experts stay whole over tp and the layout's note says
why."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from models import MoE
from models._plans import decoder_tp_plan
from spmd.parallel import (ExpertTensorParallel, apply_layout, auto_layout, hlo_executed_collectives,
                           init_train_state, make_train_step)
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._cpep import context_expert_layouts, expert_tp
from tests.parallel.auto.test_auto_cpep import CAL, KINDS, MOE_EVERY, _batch

PLAN = decoder_tp_plan(MOE_EVERY)


def _layouts():
    batch = _batch(16)
    params = jax.eval_shape(MOE_EVERY.init, jax.random.key(0), batch["inputs"])["params"]
    return context_expert_layouts(8, PLAN, ("layers_*",), params, batch), params, batch


def test_ep_times_tp_candidates_cut_the_experts_over_tp():
    lays, _, _ = _layouts()
    tps = [lay for lay in lays if lay.ep > 1 and lay.tp > 1]
    names = {lay.name for lay in tps}
    assert {"dp=2,ep=2,tp=2", "pp=2,ep=2,tp=2 1f1b M=2"} <= names, names
    assert any(lay.cp > 1 for lay in tps) and any(lay.cp == 1 for lay in tps)
    for lay in tps:  # f=32: tp=2 and tp=4 divide it; under cp too
        got = dict(lay.tp_plan)
        assert isinstance(got.pop("layers_*.mlp.experts"), ExpertTensorParallel) and got == PLAN, lay.name
        assert lay.note is None
    assert all("layers_*.mlp.experts" not in dict(lay.tp_plan) for lay in lays if lay.ep == 1 and lay.tp > 1)


def test_experts_kept_whole_over_tp_say_why():
    params = {"layers_0": {"mlp": {"experts": {"w_in": np.zeros((4, 8, 24)), "w_out": np.zeros((4, 24, 8))}}}}
    extra, note = expert_tp(params, "layers_*.mlp.experts", 2)  # one projection in, one out: d not told from f
    assert extra == () and "kept whole over tp=2" in note and "model_dim=d" in note
    params["layers_0"]["mlp"]["experts"]["w_gate"] = np.zeros((4, 8, 24))  # gated: d=8, f=24
    assert expert_tp(params, "layers_*.mlp.experts", 2)[0][0][0] == "layers_*.mlp.experts"
    extra, note = expert_tp(params, "layers_*.mlp.experts", 16)
    assert extra == () and "tp does not divide their hidden f=24" in note


@pytest.mark.slow  # two ep x tp layouts traced, one compiled
def test_the_dp2_ep2_tp2_candidate_cuts_the_experts_and_prices_its_compiled_collectives():
    lays, params, batch = _layouts()
    lay = next(lay for lay in lays if lay.name == "dp=2,ep=2,tp=2")
    plain = type(lay)(**{**lay.__dict__, "tp_plan": tuple(PLAN.items())})  # the experts whole over tp
    got = auto_layout(MOE_EVERY, optax.sgd(0.1), batch, 8, layouts=[lay, plain], calibration=CAL, params=params)
    assert not got.rejected
    cand = {id(c.layout.tp_plan): c for c in got.candidates}
    best, whole = cand[id(lay.tp_plan)], cand[id(plain.tp_plan)]
    laid, _ = apply_layout(MOE_EVERY, 8, best.layout)
    real = MOE_EVERY.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), params=real)
    experts = 0
    for i in range(2):
        for name, dim in (("gate_proj", 2), ("up_proj", 2), ("down_proj", 1)):
            e = state.plan.entry(f"layers_{i}/mlp/experts/{name}")
            assert [str(p) for p in e.placements] == ["R", "S(0)", f"S({dim})"], name  # (dp, ep, tp)
            assert e.local_shape[0] * 2 == e.shape[0] and e.local_shape[dim] * 2 == e.shape[dim]
            experts += 8 * 16 * 32 * 4  # [8, 16, 32] float32
    # the experts' bytes priced per device: 1/ep of them whole over tp, 1/(ep x tp) cut (the rest alike)
    assert whole.memory["params"] - best.memory["params"] == experts // 2 - experts // 4
    hlo = hlo_executed_collectives(make_train_step(laid, default_loss(laid), optax.sgd(0.1)).compiled(
        state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers; an all-to-all's ops
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind
    # the experts' partial output forward and their tokens' gradient backward, over tp, per layer: 2 x 2 more
    # all-reduces than with the experts whole (those have none of their own)
    acts, plain_acts = best.communication["activations"], whole.communication["activations"]
    assert acts["all-reduce"]["count"] == plain_acts["all-reduce"]["count"] + 4


def test_the_ranking_says_why_a_picks_experts_stay_whole():
    from spmd.parallel.auto._ranking import AutoLayout, Candidate

    lays, _, _ = _layouts()
    params = {"layers_0": {"mlp": {"experts": {"w_in": np.zeros((4, 8, 24)), "w_out": np.zeros((4, 24, 8))}}}}
    _, note = expert_tp(params, "layers_*.mlp.experts", 2)  # one projection in, one out: d not told from f
    lay = dataclasses.replace(next(lay for lay in lays if lay.ep > 1 and lay.tp > 1), note=note)
    cand = Candidate(lay, 1.0, 1.0, {}, 0.0, {"total": {}}, {"peak": 0}, 0.0)
    assert AutoLayout((cand,)).why() == f"{lay.name}: the only candidate. ({lay.note})"


@pytest.mark.slow  # one cp x ep x tp layout traced and compiled
def test_the_cp2_ep2_tp2_candidate_cuts_the_experts_and_prices_its_compiled_collectives():
    model = MoE(dataclasses.replace(MOE_EVERY.cfg, attn_implementation="sdpa"))  # the ring over cp
    batch = _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    lay = next(lay for lay in context_expert_layouts(8, PLAN, ("layers_*",), params, batch)
               if lay.name == "ep=2,cp=2,tp=2")
    got = dict(lay.tp_plan)
    assert isinstance(got.pop("layers_*.mlp.experts"), ExpertTensorParallel) and got == PLAN and lay.note is None
    res = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[lay], calibration=CAL, params=params)
    assert not res.rejected
    best = res.candidates[0]
    laid, _ = apply_layout(model, 8, best.layout)
    real = model.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), params=real)
    for i in range(2):
        for name, dim in (("gate_proj", 2), ("up_proj", 2), ("down_proj", 1)):
            e = state.plan.entry(f"layers_{i}/mlp/experts/{name}")
            assert dict(zip(state.plan.mesh_dim_names, map(str, e.placements))) == {
                "cp": "R", "ep": "S(0)", "tp": f"S({dim})"}, name
    hlo = hlo_executed_collectives(make_train_step(laid, default_loss(laid), optax.sgd(0.1)).compiled(
        state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers; an all-to-all's ops
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind


SCANNED = MoE(dataclasses.replace(MOE_EVERY.cfg, num_layers=4, scan_layers=True))  # [L=4, E=8, d, f] experts
SCANNED_PLAN = {f"layers.self_attn.{p}": c for p, c in (("q_proj", PLAN["layers_*.self_attn.q_proj"]),
                                                         ("k_proj", PLAN["layers_*.self_attn.k_proj"]),
                                                         ("v_proj", PLAN["layers_*.self_attn.v_proj"]),
                                                         ("o_proj", PLAN["layers_*.self_attn.o_proj"]))}


def _scanned_layouts():
    from spmd.parallel.auto._pipeline import scanned_stack

    batch = _batch(16)
    params = jax.eval_shape(SCANNED.init, jax.random.key(0), batch["inputs"])["params"]
    stack = scanned_stack(SCANNED, params, (batch["inputs"],))
    assert stack == ("layers", 4)
    return context_expert_layouts(8, SCANNED_PLAN, (), params, batch, stack), params, batch


def test_a_scanned_stacks_experts_are_cut_over_tp_past_the_layer_axis():
    lays, _, _ = _scanned_layouts()
    tps = [lay for lay in lays if lay.ep > 1 and lay.tp > 1 and lay.pp == 1]
    assert {"dp=2,ep=2,tp=2", "ep=2,cp=2,tp=2"} <= {lay.name for lay in tps}
    for lay in tps:
        got = dict(lay.tp_plan)
        assert isinstance(got.pop("layers.mlp.experts"), ExpertTensorParallel) and got == SCANNED_PLAN, lay.name
        assert lay.note is None


@pytest.mark.slow  # one layout traced and compiled
def test_the_scanned_dp2_ep2_tp2_candidate_cuts_the_experts_and_prices_its_compiled_collectives():
    lays, params, batch = _scanned_layouts()
    lay = next(lay for lay in lays if lay.name == "dp=2,ep=2,tp=2")
    res = auto_layout(SCANNED, optax.sgd(0.1), batch, 8, layouts=[lay], calibration=CAL, params=params)
    assert not res.rejected
    best = res.candidates[0]
    laid, _ = apply_layout(SCANNED, 8, best.layout)
    real = SCANNED.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), batch["inputs"], params=real)  # the inputs: the scan's layer axis
    for name, dim in (("gate_proj", 3), ("up_proj", 3), ("down_proj", 2)):  # [L, E, d, f] / [L, E, f, d]
        e = state.plan.entry(f"layers/mlp/experts/{name}")
        assert dict(zip(state.plan.mesh_dim_names, map(str, e.placements))) == {
            "dp": "R", "ep": "S(1)", "tp": f"S({dim})"}, name
        assert e.local_shape == (4, 4, 16, 16), name
    hlo = hlo_executed_collectives(make_train_step(laid, default_loss(laid), optax.sgd(0.1)).compiled(
        state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers; an all-to-all's ops
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind
    # per layer: the experts' partial output forward and their tokens' gradient backward over tp beside the
    # attention's 4
    assert best.communication["activations"]["all-reduce"]["count"] == 4 * 6
