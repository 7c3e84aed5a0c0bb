"""auto_layout: the candidates, their bytes (= the step's table = the compiled HLO), their memory (against XLA's
memory_analysis), the time model's arithmetic and ranking under given calibrations, the memory budget,
apply_layout, calibrate's cache, and the errors. Timings never decide a test: benchmarks/auto_layout.py
measures the ranking."""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import replace

import jax
import numpy as np
import optax
import pytest

from models import Transformer
from models._plans import transformer_tp_plan
from spmd.parallel import (Calibration, ColwiseParallel, Layout, apply_layout, auto_layout, calibrate, hlo_executed_collectives,
                           init_train_state, make_train_step, weight_stationary_plan)
from spmd.parallel.auto._auto import _abstract, abstract_state, candidate_layouts, default_loss, evaluate_layout
from spmd.parallel.auto._layout import infer_units
from spmd.parallel.auto._pipeline import PERMUTE, pipeline_layouts
from spmd.parallel.cost._calibrate import COLLECTIVE_KINDS, VERSION, _in_step, program_ops
from spmd.parallel.cost._compute_cost import optimizer_compute_s, reference_cost
from spmd.parallel.cost._memory import Profile
from spmd.parallel.step._protocol import StepMemory

VOCAB, T, B = 16, 8, 16
pytestmark = pytest.mark.xdist_group("auto_layout")  # the tests share module fixtures that compile three steps

MODEL = Transformer(VOCAB, T, num_layers=2, d_model=32, num_heads=4)
OPT = optax.adamw(1e-3)
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def PLAN(sequence_parallel, tp_size):
    return transformer_tp_plan(sequence_parallel, vocab_size=VOCAB, tp_size=tp_size)


def _cal(lat=1e-4, bw=1e9, flops=1e10, ew=1e10, op_s=0.0, measured=False, alone=1.0) -> Calibration:
    return Calibration(collectives={k: (lat, bw) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                          "collective-permute")},
                       matmul_flops_per_s=flops, elementwise_bytes_per_s=ew, dispatch_s=1e-4, group_size=8,
                       op_s=op_s, measured=measured, alone_speedup=alone)


# The module's compiles are cached in the module, not only in module fixtures: xdist may run another
# module's test between two of this group's, and pytest then builds module fixtures again (~1 min each).
@pytest.fixture(scope="module")
def data():
    return _data()


@functools.lru_cache(maxsize=None)
def _data():
    rng = np.random.default_rng(0)
    tok = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    params = MODEL.init(jax.random.key(0), batch["inputs"])["params"]
    return batch, params, Profile(default_loss(MODEL), params, OPT)


LAYOUTS = {  # the candidates compiled once for this module
    "dp=8": Layout(dp=8),
    "fsdp=8 regather": Layout(fsdp=8, units=("block_*",)),
    "dp=4,tp=2": Layout(dp=4, tp=2, tp_plan=tuple(PLAN(False, 2).items())),
    "dp=2,tp=4 ws": Layout(dp=2, tp=4, tp_plan=tuple(weight_stationary_plan(PLAN(True, 4)).items()),
                           weight_stationary=True),
    # checkpointing repeats no collective; its memory is measured on the one-device step (under this
    # scheduler it saves little: test_auto_checkpointing runs one under which it saves)
    "dp=8 ac=full": Layout(dp=8, units=("block_*",), activation_checkpointing="full"),
    "fsdp=8 keep ac=dots": Layout(fsdp=8, units=("block_*",), reshard_after_forward=False,
                                  activation_checkpointing="dots"),
    # kept units: the activations the one-device step parks in its outputs go to temp (23% under without them)
    "fsdp=4,tp=2 keep": Layout(fsdp=4, tp=2, units=("block_*",), reshard_after_forward=False,
                               tp_plan=tuple(PLAN(False, 2).items())),
    # re-gathering under tp: the saved matmul outputs cut over tp (25% under when scaled from the part's work)
    "fsdp=4,tp=2 regather": Layout(fsdp=4, tp=2, units=("block_*",), tp_plan=tuple(PLAN(False, 2).items())),
    # the loop over micro-batches holds every unit gathered and the full local gradients as its carry
    "fsdp=4,tp=2 keep accum=2": Layout(fsdp=4, tp=2, units=("block_*",), reshard_after_forward=False, accum_steps=2,
                                       tp_plan=tuple(PLAN(False, 2).items())),
    "dp=8 accum=2": Layout(dp=8, accum_steps=2),
}
PIPELINED = {  # the pipelined candidates compiled once for this module (each stage one of the two blocks)
    "pp=2,fsdp=4 1f1b M=2": Layout(pp=2, fsdp=4, units=("block_*",), reshard_after_forward=False, microbatches=2),
    "pp=2,dp=2,tp=2 1f1b M=4": Layout(pp=2, dp=2, tp=2, units=("block_*",), microbatches=4,
                                      tp_plan=tuple(PLAN(False, 2).items())),
}


@pytest.fixture(scope="module")
def built():
    return _built()


@functools.lru_cache(maxsize=None)
def _built():
    """name -> (Candidate, compiled step, step, state)."""
    batch, params, prof = _data()
    out = {}
    for name, lay in LAYOUTS.items():
        cand = evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=_cal(), profile=prof)
        laid, mesh = apply_layout(MODEL, 8, lay)
        state = init_train_state(laid, OPT, params=params, mesh=mesh)
        step = make_train_step(laid, default_loss(laid), OPT, accum_steps=lay.accum_steps, mesh=mesh)
        out[name] = (cand, step.lower(state, batch).compile(), step, state)
    return out


@pytest.fixture(scope="module")
def pipelined():
    return _pipelined()


@functools.lru_cache(maxsize=None)
def _pipelined():
    """name -> (Candidate, compiled step, the PipelineModule)."""
    batch, params, prof = _data()
    out = {}
    for name, lay in PIPELINED.items():
        cand = evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=_cal(op_s=1e-6), profile=prof)
        laid, _ = apply_layout(MODEL, 8, lay)
        state = init_train_state(laid, OPT, params=params)
        out[name] = (cand, make_train_step(laid, default_loss(laid), OPT).compiled(state, batch), laid)
    return out


def test_candidates_are_every_factorization_with_tp_only_under_a_plan():
    got = candidate_layouts(8, None, ("block_*",))
    meshes = {(c.dp, c.fsdp, c.tp) for c in got}
    assert meshes == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1)}
    assert sum(c.fsdp > 1 for c in got) == 6  # reshard_after_forward on and off
    with_tp = candidate_layouts(8, PLAN, ("block_*",))
    assert {(c.dp, c.fsdp, c.tp) for c in with_tp} == {(a, b, 8 // (a * b)) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8)
                                                        if 8 % (a * b) == 0}
    assert {(c.sequence_parallel, c.weight_stationary) for c in with_tp if c.tp > 1} == {
        (False, False), (True, False), (False, True)}
    assert not any(c.weight_stationary for c in with_tp if c.tp == 1)
    # tp=1: dp=8 and 3 fsdp meshes x raf (7); tp=2: dp=4, dp=2,fsdp=2 x raf, fsdp=4 x raf, x (plain, sp, ws)
    # (15); tp=4: dp=2, fsdp=2 x raf, x 3 (9); tp=8: x 3 (3)
    assert len(with_tp) == 7 + 15 + 9 + 3
    names = [c.name for c in with_tp]
    assert len(set(names)) == len(names) and "dp=2,fsdp=2,tp=2 sp regather" in names and "dp=1,tp=8" in names
    assert {"dp=1,tp=8 ws", "dp=2,tp=4 ws", "fsdp=4,tp=2 ws keep"} <= set(names)
    ws = next(c for c in with_tp if c.name == "dp=1,tp=8 ws")  # the sequence-parallel plan, cut on the batch
    assert ws.tp_plan == tuple(weight_stationary_plan(PLAN(True, 8)).items())
    # a dict plan (no sequence parallelism) has neither sp nor ws
    assert not any(c.sequence_parallel or c.weight_stationary for c in candidate_layouts(8, PLAN(False, 8), ()))


def test_abstract_bytes_equal_the_built_steps_table_and_the_hlo(built, data):
    batch = data[0]
    for name, (cand, compiled, step, state) in built.items():
        table = step.communication(state, batch)["total"]
        assert cand.communication["total"] == table, name
        hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
        for k in KINDS:  # the parameter terms, and the weight-stationary activations, in the compiled step
            if name != "dp=4,tp=2":
                assert hlo[k]["bytes"] == table[k]["bytes"], (name, k, hlo[k], table[k])
                assert hlo[k]["buffers"] == table[k]["count"], (name, k)
        assert cand.comm_bytes == sum(v["bytes"] for v in table.values())


def test_the_memory_bound_is_below_xla_peak_and_its_arguments_exact(built):
    """Uncompiled, a candidate's peak is the lower bound from shapes (spmd.parallel.cost._memory.memory_floor):
    never above the compiled step's memory_analysis(), and its state and batch are the step's arguments."""
    for name, (cand, compiled, _, _) in built.items():
        m = compiled.memory_analysis()
        measured = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        assert not cand.memory["compiled"] and cand.memory["peak"] <= measured, (name, cand.memory, measured)
        assert cand.memory["state"] + cand.memory["batch"] == pytest.approx(m.argument_size_in_bytes, rel=0.01)


def test_the_accumulating_loop_holds_one_set_of_gradients(built):
    """The carry starts from zeros inside the loop (not from a first micro-batch's gradients outside it): an
    accumulating step holds about what the plain one does, not a second set of gradients."""
    temp = {n: built[n][1].memory_analysis().temp_size_in_bytes for n in ("dp=8", "dp=8 accum=2")}
    grads = built["dp=8"][0].memory["params"]
    assert temp["dp=8 accum=2"] - temp["dp=8"] < 0.05 * grads, (temp, grads)


def test_the_predicted_time_is_compute_plus_each_kinds_latency_and_bandwidth(built):
    cand = built["fsdp=8 regather"][0]
    cal = _cal()
    ag = cand.communication["parameters"]["all-gather"]
    assert cand.comm_s["all-gather"] == pytest.approx(ag["count"] * 1e-4 + ag["bytes"] / 1e9)
    assert cand.predicted_s == pytest.approx(cand.compute_s + sum(cand.comm_s.values()) + cal.dispatch_s)
    dp = built["dp=8"][0]
    ar = dp.communication["parameters"]["all-reduce"]
    assert dp.comm_s["all-reduce"] == pytest.approx(ar["count"] * 1e-4 + ar["bytes"] / 1e9)
    tp = built["dp=4,tp=2"][0]  # the tp activations travel over groups of 2: half the ring traffic of 8
    act = tp.communication["activations"]["all-reduce"]
    par = tp.communication["parameters"]["all-reduce"]
    want = cal.collective_s("all-reduce", act["bytes"], act["count"], 2) + cal.collective_s(
        "all-reduce", par["bytes"], par["count"], 4)
    assert tp.comm_s["all-reduce"] == pytest.approx(want)
    assert cal.collective_s("all-reduce", 8e6, 1, 2) == pytest.approx(1e-4 + 8e6 * (1 / 2) / (7 / 8) / 1e9)
    assert cal.collective_s("all-gather", 8e6, 3, 1) == 0.0
    # compute: dp=8 runs AdamW on every parameter, fsdp=8 on an eighth
    assert dp.flops > cand.flops


def test_the_ranking_follows_the_calibration(data):
    batch, params, prof = data
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"]]
    slow_links = auto_layout(MODEL, OPT, batch, 8, layouts=lays, calibration=_cal(lat=1e-2, bw=1e7), profile=prof)
    assert slow_links.best.name == "dp=8"  # the fewest collectives and bytes
    free_links = auto_layout(MODEL, OPT, batch, 8, layouts=lays, calibration=_cal(lat=0.0, bw=1e18, ew=1e6), profile=prof)
    assert free_links.best.name.startswith("fsdp=8")  # the optimizer on an eighth of the state
    ranked = [c.predicted_s for c in slow_links]
    assert ranked == sorted(ranked)
    text = str(slow_links)
    assert "pick: dp=8. dp=8 wins over fsdp=8 regather" in text
    js = slow_links.to_json()
    assert js["pick"] == "dp=8" and [r["layout"] for r in js["candidates"]] == ["dp=8", "fsdp=8 regather"]
    assert js["candidates"][0]["predicted_ms"] == pytest.approx(1e3 * slow_links.best.predicted_s)
    assert js["candidates"][1]["bytes"] == {k: v["bytes"] for k, v in slow_links.candidates[1].communication["total"].items()} and "peak MiB" in text


def test_the_layouts_plans_read_the_model_once_and_equal_each_layouts_own(data, monkeypatch):
    """``abstract_state(plans=)``: what a plan reads off the model (its scanned stacks; under FSDP the kernels cut
    on their output dim) is traced once for every layout of the model; each plan equals the layout's own
    (``ParallelModule.plan``)."""
    import spmd.parallel.auto._auto as auto

    batch, params, _ = data
    inputs = _abstract(batch)["inputs"]
    abstract = _abstract(params)
    traced = []
    monkeypatch.setattr(auto, "stacked_of", lambda *a, f=auto.stacked_of: traced.append("stacked") or f(*a))
    monkeypatch.setattr(auto, "out_cut_of", lambda *a, f=auto.out_cut_of: traced.append("out_cut") or f(*a))
    plans = {}
    for name in ("dp=8", "fsdp=8 regather", "fsdp=4,tp=2 keep", "dp=4,tp=2"):
        laid, mesh = apply_layout(MODEL, 8, LAYOUTS[name])
        got = abstract_state(laid, abstract, OPT, mesh, inputs, plans=plans).plan
        assert got == abstract_state(laid, abstract, OPT, mesh, inputs).plan, name
    assert traced == ["stacked", "out_cut", "out_cut"]  # once per model, and without and with fsdp


def test_off_a_terminal_the_progress_is_one_line_per_layout_on_stderr(data, capsys):
    """A CI log or a pipe (stderr not a terminal: capsys) gets one line per layout traced: the count and the
    layout; nothing on stdout."""
    batch, params, prof = data
    auto_layout(MODEL, OPT, batch, 8, layouts=[LAYOUTS["dp=8"]], calibration=_cal(lat=1e-2, bw=1e7), profile=prof)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["auto_layout on 8 devices: layouts [1/1] tracing dp=8"]


def test_the_weight_stationary_layout_is_ranked_and_printed_by_name(built, data):
    """It moves activations, not weights: fewer bytes than fsdp=8 at 2 sequences per device, so links that
    cost bandwidth alone pick it; the table and the json name it."""
    batch, params, prof = data
    ws, fs = built["dp=2,tp=4 ws"][0], built["fsdp=8 regather"][0]
    assert ws.comm_bytes < fs.comm_bytes
    assert sum(v["bytes"] for v in ws.communication["activations"].values()) > 0
    lays = [LAYOUTS["fsdp=8 regather"], LAYOUTS["dp=2,tp=4 ws"]]
    got = auto_layout(MODEL, OPT, batch, 8, layouts=lays, calibration=_cal(lat=0.0, bw=1e6, flops=1e15, ew=1e15),
                      profile=prof)
    assert got.best.name == "dp=2,tp=4 ws" and [c.name for c in got] == ["dp=2,tp=4 ws", "fsdp=8 regather"]
    text = str(got)
    assert "pick: dp=2,tp=4 ws. dp=2,tp=4 ws wins over fsdp=8 regather" in text
    assert got.to_json()["candidates"][0]["layout"] == "dp=2,tp=4 ws"


def test_a_memory_budget_excludes_what_does_not_fit_and_none_fitting_is_a_clear_error(built, data):
    """Under a budget the candidates are compiled in ranked order and XLA's peak judges the fit; a budget below
    every candidate's lower bound is refused naming the smallest bound."""
    batch, params = data[0], data[1]

    def compiled_peak(name):  # the step as auto_layout builds it: given example inputs (fsdp's output-dim cut)
        laid, mesh = apply_layout(MODEL, 8, LAYOUTS[name])
        state = init_train_state(laid, OPT, batch["inputs"], params=params, mesh=mesh)
        step = make_train_step(laid, default_loss(laid), OPT, mesh=mesh, donate=True)  # as the planner compiles it
        return StepMemory.from_compiled(step.lower(state, batch).compile()).peak

    peak = {n: compiled_peak(n) for n in ("dp=8", "fsdp=8 regather")}
    assert peak["fsdp=8 regather"] < peak["dp=8"]
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"]]
    budget = (peak["fsdp=8 regather"] + peak["dp=8"]) // 2
    got = auto_layout(MODEL, OPT, batch, 8, layouts=lays, calibration=_cal(lat=1e-2, bw=1e7),
                      memory_budget_bytes=budget, profile=data[2])
    assert got.best.name == "fsdp=8 regather" and got.best.measured_peak == peak["fsdp=8 regather"] <= budget
    assert got.best.memory["compiled"] and got.best.memory["peak"] == got.best.measured_peak
    # dp=8's state alone (the whole parameters and moments, before and after the update) is over: never traced
    assert [c.name for c in got] == ["fsdp=8 regather"] and [n for n, _ in got.rejected] == ["dp=8"]
    assert "over the budget of" in got.rejected[0][1] and "whatever the checkpointing" in got.rejected[0][1]
    dp, fs = built["dp=8"][0], built["fsdp=8 regather"][0]
    # below both bounds: fsdp=8's checkpointing variants (re-gathering units saving less than their matmul
    # outputs) fit by their bound, are compiled, and are over: the error names the smallest and its compiled peak
    smallest = min(fs.memory["peak"], dp.memory["peak"]) - 1
    with pytest.raises(ValueError, match=re.escape(f"auto_layout: no layout fits memory_budget_bytes={smallest:,} once "
                                                   "compiled: ") + r".*the smallest, fsdp=8 regather ac=\w+, needs "):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, calibration=_cal(), memory_budget_bytes=smallest,
                    profile=data[2])


def test_an_impossible_budget_is_refused_before_anything_is_traced(data, built, monkeypatch):
    """A budget below the state's bytes cut over every device is refused at once (no calibration, no layout
    traced), with a figure no candidate's own state is below (issue 47: 1000 B took 111 s)."""
    import spmd.parallel.auto._auto as auto

    batch, params, _ = data
    monkeypatch.setattr(auto, "calibrate", lambda *a: pytest.fail("calibrated before refusing"))
    monkeypatch.setattr(auto, "evaluate_layout", lambda *a, **k: pytest.fail("a layout weighed before refusing"))
    p = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    o = sum(np.asarray(x).nbytes for x in jax.tree.leaves(OPT.init(params)))  # adamw: two moments and a count
    floor = -(-2 * (p + o) // 8)
    with pytest.raises(ValueError, match=re.escape(
            f"auto_layout: no layout fits memory_budget_bytes=1,000: the state alone, the parameters ({p:,} B) and "
            f"the optimizer state ({o:,} B) held before and after the update (2 x {p + o:,} B), needs at least "
            f"{floor:,} B per device even cut over all 8 devices; give a budget above {floor:,} B")):
        auto_layout(MODEL, OPT, batch, 8, memory_budget_bytes=1000)
    # consistent: the refusal's floor counts the state twice (held before and after the update), the bound once
    # (the planner's step donates it)
    assert all(floor <= 2 * c.memory["state"] and c.memory["state"] <= c.memory["peak"] for c, *_ in built.values())
    with pytest.raises(TypeError, match=re.escape("auto_layout: memory_budget_bytes='1GiB' must be a number of "
                                                  "bytes per device (an int, e.g. 2 * 2**30 for 2 GiB) or None.")):
        auto_layout(MODEL, OPT, batch, 8, memory_budget_bytes="1GiB")


def test_accumulation_is_added_where_memory_needs_it(data):
    _, params, prof = data
    lay = LAYOUTS["dp=8"]
    # at 32 sequences per device the activations outweigh a step's work buffers: accumulating 2 micro-batches
    # of 16 shrinks them (the bound's residuals halve; XLA's peak drops)
    tok = np.random.default_rng(1).integers(0, VOCAB, (8 * 32, T + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    one = evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=_cal(), profile=prof)
    two = evaluate_layout(MODEL, OPT, batch, 8, Layout(dp=8, accum_steps=2), calibration=_cal(), profile=prof)
    assert two.memory["activations"] < one.memory["activations"] and two.memory["state"] == one.memory["state"]
    peaks = [_compiled_peak(x, batch, params) for x in (lay, Layout(dp=8, accum_steps=2))]
    assert peaks[1] < peaks[0]
    budget = sum(peaks) // 2
    got = auto_layout(MODEL, OPT, batch, 8, layouts=[lay], calibration=_cal(), memory_budget_bytes=budget,
                      profile=prof)
    assert got.best.layout == Layout(dp=8, accum_steps=2) and got.best.name == "dp=8 accum=2"
    assert got.best.measured_peak == peaks[1]


def test_apply_layout_builds_the_mesh_and_the_transforms(data):
    lay = Layout(dp=2, fsdp=2, tp=2, sequence_parallel=True, units=("block_*",), tp_plan=tuple(PLAN(True, 2).items()))
    laid, mesh = apply_layout(MODEL, jax.devices()[:8], lay)
    assert mesh.mesh_dim_names == ("dp", "fsdp", "tp") and mesh.shape == (2, 2, 2)
    assert laid.tp.mesh_dim == "tp" and laid.fsdp.shard_dim == "fsdp" and laid.fsdp.replicate_dims == ("dp",)
    assert laid.fsdp.units == ("block_*",) and laid.fsdp.reshard_after_forward
    plain, mesh1 = apply_layout(MODEL, 8, Layout(dp=8))
    assert plain is MODEL and mesh1.mesh_dim_names == ("dp",)
    _, m = apply_layout(MODEL, 8, Layout(tp=8, tp_plan=(("block_*.fc", ColwiseParallel()),)))
    assert m.mesh_dim_names == ("dp", "tp") and m.shape == (1, 8)


def test_units_are_inferred_from_the_repeated_blocks():
    from tests.third_party.llama import Llama, LlamaConfig

    x = np.zeros((2, 4), np.int32)
    assert infer_units(jax.eval_shape(lambda: MODEL.init(jax.random.key(0), x)["params"])) == ("block_*",)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2)
    llama = Llama(cfg)
    assert infer_units(jax.eval_shape(lambda: llama.init(jax.random.key(0), x)["params"])) == ("layers_*",)
    nested = {"transformer": {"h": {str(i): {"mlp": {"kernel": np.zeros(2)}} for i in range(3)},
                              "wte": {"embedding": np.zeros(2)}}}
    assert infer_units(nested) == ("transformer.h.*",)
    assert infer_units({"dense": {"kernel": np.zeros(2)}}) == ()


def test_a_collectives_cost_curve_interpolates_its_measured_points():
    """A measured kind is its ``(bytes, seconds)`` points: linear between them, the end segments' slopes
    beyond them, never falling with the size (a noisy point is raised to the one before it); a
    ``(latency, bandwidth)`` pair is its line. ``collective_s`` takes ``count`` collectives at their mean
    size, the size scaled by the ring's traffic per byte from the calibrated group of 8."""
    pts = ((1 << 15, 4e-4), (1 << 20, 2e-3), (1 << 22, 8e-3), (1 << 24, 3.2e-2))
    cal = Calibration(collectives={k: pts for k in COLLECTIVE_KINDS}, group_size=8)
    assert cal.collective_s("all-gather", 1 << 20, 1, 8) == pytest.approx(2e-3)
    assert cal.collective_s("all-gather", 5 << 19, 1, 8) == pytest.approx(5e-3)  # half way from 1 to 4 MiB
    assert cal.collective_s("all-gather", 5 << 22, 5, 8) == pytest.approx(5 * 8e-3)  # five of 4 MiB
    assert cal.collective_s("all-gather", 1 << 25, 1, 8) == pytest.approx(6.4e-2)  # beyond: the last slope
    assert cal.collective_s("all-gather", 0, 1, 8) == pytest.approx(4e-4 - (1 << 15) * 1.6e-3 / ((1 << 20) - (1 << 15)))
    g4 = (3 / 4) / (7 / 8)  # a group of 4 moves 3/4 of the result per device where 8 move 7/8
    assert cal.collective_s("reduce-scatter", 1 << 22, 1, 4) == pytest.approx(
        2e-3 + 6e-3 * ((1 << 22) * g4 - (1 << 20)) / ((1 << 22) - (1 << 20)))
    noisy = Calibration(collectives={k: ((0, 1e-3), (1 << 20, 5e-4), (1 << 21, 2e-3)) for k in COLLECTIVE_KINDS})
    assert noisy.collectives["all-reduce"] == ((0.0, 1e-3), (float(1 << 20), 1e-3), (float(1 << 21), 2e-3))
    line = Calibration(collectives={k: (2e-5, 4e9) for k in COLLECTIVE_KINDS})
    assert line.collective_s("all-reduce", 1 << 24, 2, 8) == pytest.approx(2 * 2e-5 + (1 << 24) / 4e9)
    assert Calibration.from_json(cal.to_json()) == cal
    with pytest.raises(ValueError, match=re.escape("Calibration: collectives['all-gather']=((1.0, 0.1),) must be two "
                                                   "or more (bytes, seconds) points")):
        Calibration(collectives={k: ((1.0, 0.1),) for k in COLLECTIVE_KINDS})
    with pytest.raises(ValueError, match=re.escape("Calibration: collectives['all-gather']=(1e-05, 0.0) must be a "
                                                   "latency >= 0 and a bandwidth > 0")):
        Calibration(collectives={k: (1e-5, 0.0) for k in COLLECTIVE_KINDS})


def test_calibrate_measures_caches_and_refreshes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    import spmd.parallel.cost._calibrate as calib

    # the compute timings fixed (the collectives measured): the rates are the work over the time less dispatch
    by_size = {8 * 8: 0.125, 8 * (1 << 18): 0.625}  # the empty program (dispatch), the elementwise chain
    monkeypatch.setattr(calib, "_timed", lambda fn, x, repeats: by_size.get(x.size, 1e-3))
    monkeypatch.setattr(calib, "_matmuls", lambda devices, m, reps, repeats: 0.5 if len(devices) == 8 else 0.25)
    cal = calibrate(quick=True)
    reps = 2  # quick
    assert cal.dispatch_s == 0.125 and cal.group_size == 8
    assert cal.matmul_flops_per_s == pytest.approx(reps * 2 * 256 ** 3 / (0.5 - 0.125))
    assert cal.elementwise_bytes_per_s == pytest.approx(reps * 3 * (1 << 18) * 4 / (0.625 - 0.125))
    assert cal.alone_speedup == pytest.approx((0.5 - 0.125) / (0.25 - 0.125))  # 3: one device alone 3x faster
    assert set(cal.collectives) == set(COLLECTIVE_KINDS) and cal.measured
    assert all(len(v) == 2 for v in cal.collectives.values())  # quick: two sizes measured per kind
    files = list(tmp_path.iterdir())
    assert [str(f) for f in files] == [Calibration.cache_path()]
    cached = json.loads(files[0].read_text())["calibration"]
    assert len(files) == 1 and cached["group_size"] == 8 and cached["op_s"] == cal.op_s  # every measured term kept
    assert cached["alone_speedup"] == cal.alone_speedup
    assert calibrate(quick=True) == cal  # from the cache
    files[0].write_text(json.dumps({"version": VERSION, "quick": True,
                                    "calibration": {**cal.to_json(), "dispatch_s": 123.0}}))
    assert calibrate(quick=True).dispatch_s == 123.0 and calibrate(quick=True, refresh=True).dispatch_s != 123.0
    assert os.path.dirname(str(files[0])) == str(tmp_path)
    line = {**cal.to_json(), "collectives": {k: [1e-4, 1e9] for k in COLLECTIVE_KINDS}}  # a cache of fitted lines
    files[0].write_text(json.dumps({"quick": True, "calibration": {**line, "dispatch_s": 123.0}}))
    assert calibrate(quick=True).dispatch_s != 123.0  # measured again


def test_bad_inputs_are_clear_errors(data):
    batch = data[0]
    with pytest.raises(ValueError, match=re.escape("Layout: tp=2 needs tp_plan=")):
        Layout(tp=2)
    with pytest.raises(ValueError, match=re.escape("Layout: dp=0 must be an int >= 1.")):
        Layout(dp=0)
    with pytest.raises(ValueError, match=re.escape("apply_layout: layout 'dp=4' needs pp x dp x fsdp x ep x cp x tp = 4 "
                                                   "devices, "
                                                   "but 8 were given")):
        apply_layout(MODEL, 8, Layout(dp=4))
    with pytest.raises(TypeError, match=re.escape("auto_layout: mesh_shape_or_devices='eight' must be")):
        auto_layout(MODEL, OPT, batch, "eight", calibration=_cal())
    with pytest.raises(ValueError, match=re.escape("auto_layout: mesh_shape_or_devices=16 asks for 16 devices")):
        auto_layout(MODEL, OPT, batch, 16, calibration=_cal())
    with pytest.raises(ValueError, match=re.escape("auto_layout: memory_budget_bytes=0 must be a positive int")):
        auto_layout(MODEL, OPT, batch, 8, memory_budget_bytes=0, calibration=_cal())
    with pytest.raises(ValueError, match=re.escape("Calibration: collectives={} lacks 'all-gather'")):
        Calibration(collectives={})
    rejected = auto_layout(MODEL, OPT, batch, 8, plan=PLAN, calibration=_cal(),
                           layouts=[Layout(dp=8), Layout(tp=8, tp_plan=tuple(PLAN(False, 8).items()))],
                           profile=data[2]).rejected
    assert [n for n, _ in rejected] == ["dp=1,tp=8"] and "does not divide" in rejected[0][1]
    with pytest.raises(ValueError, match=re.escape("Layout: pp=2 with units=('a_*', 'b_*'): the pipeline's stages are "
                                                   "one glob")):
        Layout(pp=2, dp=4, units=("a_*", "b_*"), microbatches=2)
    with pytest.raises(ValueError, match=re.escape("Layout: schedule='zb' is not offered")):
        Layout(pp=2, dp=4, units=("block_*",), schedule="zb")
    with pytest.raises(ValueError, match=re.escape("Layout: stages_per_rank=2 needs schedule 'interleaved'")):
        Layout(pp=2, dp=4, units=("block_*",), stages_per_rank=2)
    with pytest.raises(ValueError, match=re.escape("reshard_after_forward=True: a pipeline keeps its stages gathered")):
        Layout(pp=2, fsdp=4, units=("block_*",))


def test_program_ops_counts_the_launched_instructions_of_the_entry():
    text = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p)
}

ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused
  %b = f32[2,2]{1,0} bitcast(%f)
  %d = f32[2,2]{1,0} dot(%b, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[4]{0} all-reduce(%f), replica_groups={}, to_apply=%fused
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%f, %r)
}
"""
    assert program_ops(text) == 3  # the fusion, the dot, the all-reduce; not parameters, constants, bitcasts, tuples


def test_the_in_step_collective_programs_run_one_collective_of_each_kind_per_segment():
    """calibrate's collective programs (a collective between small kernels, ``segments`` times) move the
    buffer in the cost model's convention: the all-reduce's buffer, the all-gather's result, the
    reduce-scatter's input, the permute's buffer."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    elems, segments = 8 * 1024, 3
    x = jax.ShapeDtypeStruct((8 * elems,), np.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((8 * 64, 64), np.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))
    for kind in COLLECTIVE_KINDS:
        hlo = hlo_executed_collectives(_in_step(kind, mesh, elems, segments).lower(x, w).compile().as_text(),
                                       scalars=False)
        assert hlo[kind]["count"] == segments, (kind, hlo)
        assert hlo[kind]["bytes"] == segments * elems * 4, (kind, hlo[kind])
        assert all(v["count"] == 0 for k, v in hlo.items() if k != kind), (kind, hlo)
    none = hlo_executed_collectives(_in_step(None, mesh, elems, segments).lower(x, w).compile().as_text())
    assert all(v["count"] == 0 for v in none.values())


def test_compute_is_flops_bytes_and_ops_at_the_calibrated_rates(built, data):
    """``compute_s`` = flops / matmul rate + bytes / elementwise rate + operations x op_s: the gradients'
    (the one-device step's compiled cost less its optimizer update's, times the micro-batches), then the
    optimizer's update of the layout's shards (the whole update's flops and bytes by their share, its
    operations once)."""
    batch, params, prof = data
    cal = _cal(op_s=3e-6)
    assert cal.compute_s(2e10, 1e10, 1000) == pytest.approx(2.0 + 1.0 + 3e-3)
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // 8, *x.shape[1:]), x.dtype), _abstract(batch))
    with jax.default_device(jax.devices()[0]):
        one = jax.jit(prof._fn()).lower(params, OPT.init(params), micro).compile()
        upd = jax.jit(lambda p, g, s: OPT.update(g, s, p)).lower(params, params, OPT.init(params)).compile()
    opt_f, opt_b, opt_ops = prof._optimizer()
    assert prof.ops(micro) == program_ops(one.as_text()) - opt_ops > 10 and opt_ops >= program_ops(upd.as_text()) > 5
    assert reference_cost(prof, micro) == (*prof.grad_cost(micro), prof.ops(micro))
    for lay in (LAYOUTS["dp=8"], Layout(dp=8, accum_steps=2), LAYOUTS["fsdp=8 regather"]):
        c = evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=cal, profile=prof)
        laid, mesh = apply_layout(MODEL, 8, lay)
        share = abstract_state(laid, params, OPT, mesh).plan.bytes_per_device / prof.param_bytes
        assert share == (1 if lay.fsdp == 1 else pytest.approx(1 / 8, rel=0.1))  # fsdp pads the small leaves
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // 8 // lay.accum_steps, *x.shape[1:]), x.dtype), micro)
        f, b = prof.grad_cost(mb)
        a = lay.accum_steps
        want = cal.compute_s(a * f, a * b, a * prof.ops(mb)) + cal.compute_s(opt_f * share, opt_b * share, opt_ops)
        assert c.compute_s == pytest.approx(want, rel=1e-9), lay.name
        assert c.flops == pytest.approx(a * f + opt_f * share, rel=1e-9)


def test_a_measured_calibration_anchors_the_gradients_and_times_the_optimizer_on_the_shards(data, monkeypatch):
    """Under a measured calibration each candidate's gradient estimate is scaled by the one-device
    gradient's measured seconds (less dispatch) over its estimate, taken on the batch split over every
    device (one factor for every candidate), and the optimizer's update is the measured update of the
    layout's own shards (less dispatch), not the whole update's share. The timing is stubbed here (tests
    never time)."""
    batch, params, prof = data
    est, got = _cal(op_s=2e-6), _cal(op_s=2e-6, measured=True)
    anchor_micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // 8, *x.shape[1:]), x.dtype), _abstract(batch))
    seen, shards = [], []
    monkeypatch.setattr(prof, "grad_seconds", lambda b, devices: seen.append(Profile._key(b)) or 0.05)
    monkeypatch.setattr(prof, "optimizer_seconds", lambda s, devices: shards.append(  # the parameters' tree
        jax.tree.structure(s) == jax.tree.structure(params) and sum(math.prod(x.shape) for x in jax.tree.leaves(s)))
        or 0.01 * len(shards))
    factor = (0.05 - got.dispatch_s) / got.compute_s(*reference_cost(prof, anchor_micro))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    for i, name in enumerate(("dp=8", "fsdp=8 regather", "dp=4,tp=2")):
        a = evaluate_layout(MODEL, OPT, batch, 8, LAYOUTS[name], calibration=est, profile=prof)
        m = evaluate_layout(MODEL, OPT, batch, 8, LAYOUTS[name], calibration=got, profile=prof)
        laid, mesh = apply_layout(MODEL, 8, LAYOUTS[name])
        plan = abstract_state(laid, params, OPT, mesh).plan
        grads = a.compute_s - optimizer_compute_s(prof, plan, est, jax.devices())
        assert m.compute_s == pytest.approx(grads * factor + 0.01 * (i + 1) - got.dispatch_s), name
        assert m.comm_s == a.comm_s and m.memory == a.memory
    assert set(seen) == {Profile._key(anchor_micro)}
    assert shards[0] == n and n / 8 <= shards[1] < n / 7 and n / 2 < shards[2] < n  # each layout's own shards


@pytest.mark.slow  # traces each layout twice (10-27 s here)
def test_a_measured_calibration_times_the_optimizer_only_where_it_can_rank(data, monkeypatch):
    """Without a budget, auto_layout times a layout's optimizer update only while the layout can still rank first
    (by its time without the update, a lower bound): the pick and its time are those of timing every update
    (evaluate_layout on each), with fewer updates timed. The timings are stubbed (tests never time): the
    update of dp=8's whole state costs 1 ms, any other's shards 30 ms; dp=8 is the fastest without its update
    and, with it, still faster than the others without theirs: theirs are not timed."""
    batch, params, prof = data
    cal = _cal(op_s=2e-6, measured=True)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    timed = []
    monkeypatch.setattr(prof, "grad_seconds", lambda b, devices: 0.05)
    monkeypatch.setattr(prof, "optimizer_seconds", lambda s, devices: timed.append(
        sum(math.prod(x.shape) for x in jax.tree.leaves(s))) or (0.001 if timed[-1] == n else 0.03))
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"], LAYOUTS["dp=4,tp=2"]]
    full = {lay.name: evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=cal, profile=prof).predicted_s
            for lay in lays}
    timed.clear()
    got = auto_layout(MODEL, OPT, batch, 8, calibration=cal, profile=prof, layouts=lays, plan=PLAN)
    assert got.best.name == min(full, key=full.get)
    assert got.best.predicted_s == pytest.approx(full[got.best.name], rel=1e-9)
    assert got.best.name == "dp=8" and timed == [n], (timed, full)


def test_the_profile_times_the_gradient_and_the_optimizer_on_every_device_at_once(data, monkeypatch):
    """What is timed: one device's gradient on its micro-batch (the batch cut over all 8 devices, the
    parameters whole on each), and the optimizer's update of the given shards whole on each device; each
    measured once per shapes (the clock replaced: the seconds are whatever the timer returns)."""
    import spmd.parallel.cost._memory as memory

    batch, params, _ = data
    prof = Profile(default_loss(MODEL), params, OPT)  # nothing timed yet
    timed = []
    monkeypatch.setattr(memory, "_median_seconds",
                        lambda f, vals, rounds: timed.append((f, vals)) or 0.125 * len(timed))
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // 8, *x.shape[1:]), x.dtype), _abstract(batch))
    assert prof.grad_seconds(micro, jax.devices(), rounds=1) == 0.125
    assert prof.grad_seconds(micro, jax.devices(), rounds=1) == 0.125 and len(timed) == 1  # measured once
    f, (p_vals, b_vals) = timed[0]
    for got, want in zip(jax.tree.leaves(b_vals), jax.tree.leaves(micro)):  # each device its own micro-batch
        assert len(got.addressable_shards) == 8 and {sh.data.shape for sh in got.addressable_shards} == {want.shape}
    for got, want in zip(jax.tree.leaves(p_vals), jax.tree.leaves(params)):  # the parameters whole on each
        assert {sh.data.shape for sh in got.addressable_shards} == {want.shape}
    zeros = lambda t: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), t)  # noqa: E731
    ref = jax.grad(prof.loss)(zeros(params), zeros(micro))  # what one device computes (every input is zeros)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
                 f(p_vals, b_vals), ref)

    shards = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // 2, *x.shape[1:]) if x.shape and x.shape[0] % 2
                                                         == 0 else x.shape, x.dtype), params)  # the params' tree
    assert prof.optimizer_seconds(shards, jax.devices(), rounds=1) == 0.25
    assert prof.optimizer_seconds(shards, jax.devices(), rounds=1) == 0.25 and len(timed) == 2
    f, vals = timed[1]
    for got, want in zip(jax.tree.leaves(vals[0]), jax.tree.leaves(shards)):  # the shards whole on each device
        assert {sh.data.shape for sh in got.addressable_shards} == {want.shape}
    new_params, _ = f(*vals)
    u, _ = OPT.update(zeros(shards), OPT.init(zeros(shards)), zeros(shards))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b)), new_params, u)


def test_accum_steps_is_every_candidates_least(data):
    batch, params, prof = data
    got = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, accum_steps=2,
                      layouts=[LAYOUTS["dp=8"], replace(LAYOUTS["dp=4,tp=2"], accum_steps=4)])
    assert sorted((c.layout.accum_steps, c.name) for c in got) == [(2, "dp=8 accum=2"), (4, "dp=4,tp=2 accum=4")]
    with pytest.raises(ValueError, match=re.escape("auto_layout: accum_steps=0 must be an int >= 1")):
        auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, accum_steps=0)
    with pytest.raises(ValueError, match=re.escape("Calibration: op_s=-1.0 must be >= 0")):
        _cal(op_s=-1.0)


def test_pipelined_candidates_are_pp_over_the_divisors_with_1f1b_and_interleaved():
    deep = jax.eval_shape(lambda: Transformer(VOCAB, T, num_layers=4, d_model=32, num_heads=4).init(
        jax.random.key(0), np.zeros((2, T), np.int32))["params"])
    got = [lay.name for lay in pipeline_layouts(4, None, ("block_*",), deep, 16)]
    assert got == ["pp=2,dp=2 1f1b M=2", "pp=2,dp=2 1f1b M=4", "pp=2,dp=2 1f1b M=8", "pp=2,dp=2 interleaved v=2 M=8",
                   "pp=2,fsdp=2 1f1b M=2", "pp=2,fsdp=2 1f1b M=4", "pp=2,fsdp=2 1f1b M=8",
                   "pp=2,fsdp=2 interleaved v=2 M=8", "pp=4 1f1b M=4", "pp=4 1f1b M=8", "pp=4 1f1b M=16"]
    with_tp = [lay.name for lay in pipeline_layouts(4, PLAN, ("block_*",), deep, 4)]  # 2 rows per replica of dp=2
    assert with_tp == ["pp=2,dp=2 1f1b M=2", "pp=2,dp=2 interleaved v=2 M=2", "pp=2,fsdp=2 1f1b M=2",
                       "pp=2,fsdp=2 interleaved v=2 M=2", "pp=2,tp=2 1f1b M=2", "pp=2,tp=2 1f1b M=4",
                       "pp=2,tp=2 interleaved v=2 M=4", "pp=4 1f1b M=4"]
    assert pipeline_layouts(8, None, ("block_*", "head_*"), deep, 16) == []  # the stages are one glob
    # 2 blocks: pp=2 only; 4 rows per replica of each of dp=4, dp=2,fsdp=2, fsdp=4: M = 2, 4
    assert [lay.pp for lay in pipeline_layouts(8, None, ("block_*",), _data()[1], 16)] == [2] * 6


def test_pipelined_bytes_equal_the_compiled_hlo_and_the_memory_bound_is_below_xlas(pipelined):
    for name, (cand, compiled, laid) in pipelined.items():
        assert cand.name == name and type(laid).__name__ == "PipelineModule" and laid.schedule.pp == 2
        hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
        for k in (*KINDS, PERMUTE):  # the tp terms, the stages' gathers and every transfer, each as compiled
            assert hlo[k]["bytes"] == cand.communication["total"][k]["bytes"], (name, k)
            assert hlo[k]["buffers"] == cand.communication["total"][k]["count"], (name, k)
        assert cand.communication["total"][PERMUTE]["count"] == 2 * laid.schedule.num_microbatches  # once each way
        m = compiled.memory_analysis()
        measured = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        assert cand.memory["peak"] <= measured, (name, cand.memory, measured)
        assert cand.memory["state"] + cand.memory["batch"] == pytest.approx(m.argument_size_in_bytes, rel=0.01)
        s = laid.schedule
        assert cand.memory["stash"] == (max(s.x_slots) + max(s.g_slots) + 2) * B // (4 if "fsdp" in name else 2) \
            // s.num_microbatches * T * 32 * 4 // (2 if "fsdp" in name else 1) * (2 if "fsdp" in name else 1)


def _pipelined_peak(layers: int, d_model: int, lay: Layout) -> tuple:
    """(Candidate, compiled peak bytes, laid model) of ``lay`` on a ``layers`` x ``d_model`` Transformer at 32
    sequences of 16 tokens."""
    model, b, t = Transformer(VOCAB, 16, num_layers=layers, d_model=d_model, num_heads=4), 32, 16
    tok = np.random.default_rng(1).integers(0, VOCAB, (b, t + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    cand = evaluate_layout(model, OPT, batch, 8, lay, calibration=_cal(op_s=1e-6),
                           profile=Profile(default_loss(model), params, OPT))
    laid, _ = apply_layout(model, 8, lay)
    m = make_train_step(laid, default_loss(laid), OPT).compiled(init_train_state(laid, OPT, params=params),
                                                                batch).memory_analysis()
    measured = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return cand, measured, laid.layout(params)


def test_interleaved_chunks_add_their_gradient_in_place():
    """Two chunks a rank, two blocks a chunk: a backward tick adds its chunk's gradient into the rank's stacked
    accumulators in place. A zero-padded stacked gradient per block (each block's parameters indexed by the
    tick's chunk) compiled this step to 22% more (4.42 MB, 3.63 now); the bound stays below it."""
    cand, measured, stages = _pipelined_peak(8, 64, Layout(
        pp=2, dp=2, tp=2, units=("block_*",), microbatches=4, schedule="interleaved", stages_per_rank=2,
        tp_plan=tuple(PLAN(False, 2).items())))
    assert stages.per_slot == 2
    assert cand.memory["peak"] <= measured, (cand.memory, measured)
    assert measured < 4_000_000  # 4.42 MB with a zero-padded stacked gradient per block


def _chunk_terms(laid, data, cal):
    """``t_F`` (a one-block chunk's forward on one micro-batch) and the code outside the units per micro-batch
    of ``pp=2,fsdp=4 1f1b M=2`` (see ``spmd.parallel.auto._pipeline``), and the one-device step's terms."""
    prof = data[2]
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // 4 // 2, *x.shape[1:]), x.dtype), _abstract(data[0]))
    (f, nb), ops = prof.grad_cost(mb), prof.ops(mb)
    lay = laid.layout(data[1])
    u = sum(int(np.prod(lay.shapes[p].shape)) * 4 for p in lay.unit_of) / prof.param_bytes
    # one block of two per stage; a forward is a third of the step; the ends recomputed once
    return cal.compute_s(f, nb, ops) * u / 2 / 3, cal.compute_s(f, nb, ops) * (1 - u) * 4 / 3


def test_pipelined_time_is_the_schedules_lockstep_replay(pipelined, data):
    cand, _, laid = pipelined["pp=2,fsdp=4 1f1b M=2"]
    prof, cal, s = data[2], _cal(op_s=1e-6), laid.schedule
    t_f, ends = _chunk_terms(laid, data, cal)
    of, ob = prof.optimizer_cost()
    share = sum(e.local_nbytes for e in jax.eval_shape(lambda: init_train_state(laid, OPT, params=data[1])).plan.entries
                ) / prof.param_bytes
    # each backward tick (M of them) passes over the rank's stage gradient (one block, gathered over fsdp)
    lay = laid.layout(data[1])
    block = sum(int(np.prod(lay.shapes[p].shape)) * 4 for p in lay.unit_of) / 2 / prof.param_bytes
    want = (s.timed(t_f, 3 * t_f)["lockstep_s"] + 2 * ends
            + cal.compute_s(of * share, ob * share, prof._optimizer()[2])  # the update's operations once
            # 5 passes of the stage gradient (its carry in and out of the tick's branch, and one chunk of one
            # stage: slice read, gradient read, sum written), each the update's time over its ob / param passes
            + 5 * s.num_microbatches * cal.compute_s(of * block, ob * block, prof._optimizer()[2])
            * prof.param_bytes / ob)
    assert cand.compute_s == pytest.approx(want, rel=1e-9)
    t = cand.communication["total"]
    assert cand.comm_s[PERMUTE] == pytest.approx(1e-4 * t[PERMUTE]["count"] + t[PERMUTE]["bytes"] / 1e9, rel=1e-9)
    assert cand.predicted_s == pytest.approx(cand.compute_s + sum(cand.comm_s.values()) + 1e-4, rel=1e-12)
    # 1f1b at 2 micro-batches on 2 ranks: each rank busy 2 x (t_F + t_B) = 8 t_F of the lockstep's 12 t_F (the
    # bubble (pp - 1) / (M + pp - 1) = 1/3 is in the time)
    assert s.bubble == pytest.approx(1 / 3) and s.timed(t_f, 3 * t_f)["lockstep_s"] == pytest.approx(12 * t_f)


@pytest.mark.parametrize("alone", [1.5, 2.0, 8.0])
def test_on_devices_sharing_a_host_a_tick_runs_its_busy_ranks_faster(pipelined, data, alone):
    """Where a device's program runs ``alone`` times faster with the others idle (fake devices sharing a host's
    cores), a tick lasts its busiest rank's work over ``alone``, at least its work over every rank: 1F1B at
    pp=2, M=2 has two ticks with both ranks busy (F F, B B: 4 t_F) and three with one (F, F+B, B: 8 t_F in
    lockstep), so 4 t_F + max(8 / alone, 4) t_F, the bubble free from alone = pp on; the code outside the
    units runs over min(alone, pp)."""
    cand, _, laid = pipelined["pp=2,fsdp=4 1f1b M=2"]
    shared = evaluate_layout(MODEL, OPT, data[0], 8, PIPELINED["pp=2,fsdp=4 1f1b M=2"],
                             calibration=_cal(op_s=1e-6, alone=alone), profile=data[2])
    t_f, ends = _chunk_terms(laid, data, _cal(op_s=1e-6))
    saved = (12 - 4 - max(8 / alone, 4)) * t_f + 2 * ends * (1 - 1 / min(alone, 2))
    assert cand.compute_s - shared.compute_s == pytest.approx(saved, rel=1e-9)
    assert shared.comm_s == cand.comm_s and shared.memory == cand.memory
    with pytest.raises(ValueError, match=re.escape("Calibration: alone_speedup=0.5 must be between 1")):
        _cal(alone=0.5)


def test_auto_layout_ranks_the_pipelines_beside_the_others(data):
    batch, params, prof = data
    ranked = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, plan=PLAN)
    names = [c.name for c in ranked.candidates]
    assert {"pp=2,dp=4 1f1b M=2", "pp=2,fsdp=4 1f1b M=4", "dp=8", "fsdp=8 regather"} <= set(names)
    assert "permute MiB" in ranked.table(top=len(names))
    pp = next(c for c in ranked.candidates if c.name == "pp=2,dp=4 1f1b M=2")
    assert pp.communication["total"][PERMUTE]["bytes"] == 2 * 2 * (B // 4 // 2) * T * 32 * 4  # M x 1 boundary x 2 ways


def test_a_pipeline_accumulates_only_what_its_micro_batches_divide(data):
    """Under a budget, a pipelined candidate accumulates while each step's rows still cut into its micro-batches;
    past that the budget is the clear error, not the step's own batch error."""
    batch, params, prof = data
    lay = Layout(pp=2, dp=4, units=("block_*",), microbatches=2)  # 4 rows per replica: accumulation 2 at most
    one = evaluate_layout(MODEL, OPT, batch, 8, lay, calibration=_cal(), profile=prof)
    two = evaluate_layout(MODEL, OPT, batch, 8, replace(lay, accum_steps=2), calibration=_cal(), profile=prof)
    assert two.memory["peak"] < one.memory["peak"]  # the bound: half the stash
    with pytest.raises(ValueError, match=re.escape(f"auto_layout: no layout fits memory_budget_bytes="
                                                   f"{two.memory['peak'] - 1:,}; the smallest, pp=2,dp=4 1f1b M=2 accum=2, needs "
                                                   f"at least {two.memory['peak']:,} B per device")) as e:
        auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=[lay],
                    memory_budget_bytes=two.memory["peak"] - 1)
    # the parts named add up to the figure (issue 47: 'state, activations' were not its terms)
    named = re.search(r"B per device \(([^)]*)\)", str(e.value)).group(1)
    assert sum(int(v.replace(",", "")) for v in re.findall(r"[a-z_]+ ([\d,]+)", named)) == two.memory["peak"], named


def _fake_clock(monkeypatch, seconds: tuple[float, ...]) -> None:
    """``measure_layouts``' clock stubbed: the i-th timed round (its two readings) lasts ``seconds[i % len]``,
    so each candidate's measured time per step is known (the steps still run)."""
    import types

    import spmd.parallel.auto._measure as measure

    calls = iter(range(10**6))

    def perf_counter():
        c = next(calls)
        return 10.0 * (c // 2) + (seconds[(c // 2) % len(seconds)] if c % 2 else 0.0)

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=perf_counter))


def test_measure_times_the_top_candidates_and_ranks_them_by_their_measured_step(data, monkeypatch):
    """``measure=k``: the top ``k`` fitting candidates are compiled and timed (real steps on zeros of the
    parameters and the batch), ranked first by the measured time; the rest keep their predicted order; the
    table gains the measured column and ``why`` says what was measured."""
    batch, params, prof = data
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"], LAYOUTS["dp=4,tp=2"]]
    plain = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN)
    # the clock stubbed: each round of 2 steps of the first predicted lasts 0.6 s, of the second 0.2 s (rounds
    # alternate between them; 3x apart, no race): measured, the second predicted is first
    _fake_clock(monkeypatch, (0.6, 0.2))
    got = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN, measure=2)
    first, third = plain.candidates[:2], plain.candidates[2]
    a, b = got.candidates[:2]
    assert [a.name, b.name] == [first[1].name, first[0].name] and got.candidates[2].name == third.name
    assert (a.measured_s, b.measured_s) == (pytest.approx(0.1), pytest.approx(0.3))
    assert got.candidates[2].measured_s is None and all(c.measured_s is None for c in plain.candidates)
    assert "meas ms" in got.table() and "meas ms" not in plain.table()
    assert got.why().startswith(f"{a.name} wins over {b.name} by ") and " ms/step measured (" in got.why()
    assert got.to_json()["candidates"][0]["measured_ms"] == pytest.approx(1e3 * a.measured_s)

    # the order follows the measurement, not the prediction (timing stubbed: the first predicted is slower)
    import spmd.parallel.auto._auto as auto

    monkeypatch.setattr(auto, "measure_layouts", lambda *a, **k: [(0.2, 10), (0.1, 10)])
    flipped = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN, measure=2)
    assert [c.name for c in flipped.candidates] == [first[1].name, first[0].name, third.name]
    assert [c.measured_s for c in flipped.candidates] == [0.1, 0.2, None]
    assert a.measured_peak >= a.memory["peak"]  # the compiled step's memory_analysis, above the bound


def test_the_race_times_the_close_contenders_again_and_drops_clear_losers():
    """After the first rounds, the candidates within RACE of the fastest median get more rounds (each round's
    contenders chosen again), a clear loser none, until one is left or ``max_rounds``."""
    from spmd.parallel.auto import _measure as am

    class Fake:  # a candidate whose k-th round takes times[k] (the last repeated)
        def __init__(self, times):
            self.times, self.seconds = times, []

        def round(self, steps):
            self.seconds.append(self.times[min(len(self.seconds), len(self.times) - 1)])

    lead, close, loser = Fake([1.0] * 3), Fake([1.05] * 3), Fake([2.0] * 3)
    for t in (lead, close, loser):
        for _ in range(3):
            t.round(2)
    am._race([lead, close, loser], 4, 2)
    assert [len(t.seconds) for t in (lead, close, loser)] == [7, 7, 3]  # the tie runs to max_rounds, 3 + 4
    # the runner-up falls out of reach once its later rounds are slow: the race stops
    lead, close = Fake([1.0]), Fake([1.05, 1.05, 1.05, 1.5, 1.5, 1.5])
    for t in (lead, close):
        for _ in range(3):
            t.round(2)
    am._race([lead, close], 10, 2)
    assert len(lead.seconds) == len(close.seconds) == 6  # after 6 rounds its median, 1.275, is over 1.1 x 1.0
    assert am.RACE == 0.10


def test_a_measured_peak_over_the_budget_does_not_fit_and_the_next_is_measured(data, monkeypatch):
    """Under ``measure=`` the compiled step's own peak decides the fit: one over the budget goes behind the
    fitting candidates, and the next predicted is compiled in its place; none fitting once compiled is a
    clear error giving the smallest measured."""
    import spmd.parallel.auto._auto as auto

    batch, params, prof = data
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"], LAYOUTS["dp=4,tp=2"]]
    order = [c.name for c in auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays,
                                         plan=PLAN).candidates]
    seen = []

    def fake(model, optimizer, loss_of, params, batch, devices, layouts):
        seen.append([lay.name for lay in layouts])
        return [(0.1, 2000) if lay.name == order[0] else (0.3 if lay.name == order[1] else 0.4, 500)  # no tie
                for lay in layouts]

    ranked = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN)
    got = auto._measured(list(ranked.candidates), 2, 1000, lambda lays: fake(*[None] * 6, lays))
    assert seen == [order[:2], order[2:3]]  # the first over the budget of 1000 B: the third measured next
    assert [c.name for c in got] == [order[1], order[2], order[0]] and [c.fits for c in got] == [True, True, False]
    assert got[2].measured_peak == 2000 and got[0].measured_s == 0.3
    monkeypatch.setattr(auto, "measure_layouts", lambda *a, **k: [(0.1, 2 * 10**9)] * len(a[-1]))
    with pytest.raises(ValueError, match=re.escape("auto_layout: no layout fits memory_budget_bytes=1,000,000,000 once "
                                                   "compiled: ")):
        auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN, measure=2,
                    memory_budget_bytes=10**9)
    with pytest.raises(ValueError, match=re.escape("auto_layout: measure=-1 must be an int >= 0")):
        auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, measure=-1)


def _compiled_peak(lay, batch, params) -> int:
    """The peak per device of ``lay``'s step compiled on real arrays (``memory_analysis``), built by hand."""
    laid, mesh = apply_layout(MODEL, 8, lay)
    state = init_train_state(laid, OPT, params=params, mesh=mesh)
    m = make_train_step(laid, default_loss(laid), OPT, accum_steps=lay.accum_steps, mesh=mesh,
                        donate=True).lower(state, batch).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def test_under_a_budget_the_pick_is_compiled_and_its_compiled_peak_judges_the_fit(data, monkeypatch):
    """With a memory budget and ``measure=0`` the pick's step is compiled on shape structs (nothing run) and
    its ``memory_analysis`` peak is its ``measured_peak``, equal to the step compiled on real arrays; the
    others stay uncompiled. A pick over the budget once compiled goes behind the fitting ones and the next
    is compiled; none fitting once compiled is the clear error."""
    import spmd.parallel.auto._auto as auto

    batch, params, prof = data
    lays = [LAYOUTS["dp=8"], LAYOUTS["fsdp=8 regather"], LAYOUTS["dp=4,tp=2"]]
    plain = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN)
    assert all(c.measured_peak is None for c in plain.candidates) and "compiled MiB" not in plain.table()
    budget = 10 * max(c.memory["peak"] for c in plain.candidates)
    got = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN,
                      memory_budget_bytes=budget)
    assert [c.name for c in got.candidates] == [c.name for c in plain.candidates]
    best = got.best
    assert best.measured_peak == _compiled_peak(best.layout, batch, params) and best.measured_s is None
    assert [c.measured_peak is None for c in got.candidates] == [False, True, True]
    assert "compiled MiB" in got.table() and f"{best.measured_peak / 2**20:.2f}" in got.table()
    assert got.to_json()["candidates"][0]["measured_peak_bytes"] == best.measured_peak
    # measure=2 under the budget: the steps compiled_peak compiled are the ones timed (real runs)
    with monkeypatch.context() as m:
        _fake_clock(m, (0.2, 0.6))  # rounds of 2 steps: the first predicted 0.1 s a step, the second 0.3 s
        real = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN,
                           memory_budget_bytes=budget, measure=2)
    assert [(c.name, c.measured_s) for c in real.candidates[:2]] == [
        (plain.candidates[0].name, pytest.approx(0.1)), (plain.candidates[1].name, pytest.approx(0.3))]
    for c in real.candidates[:2]:
        assert c.measured_peak == _compiled_peak(c.layout, batch, params), c.name

    # the first predicted compiles over the budget: the second is compiled and picked (peaks stubbed)
    order = [c.name for c in plain.candidates]
    seen = []

    def fake(model, optimizer, loss_of, params, batch, devices, lay, keep=None, hardware=None):
        seen.append(lay.name)
        if keep is not None:
            keep[lay] = f"compiled {lay.name}"
        # the first (and its variants: the same mesh) 1000x over
        over = lay.dp == plain.candidates[0].layout.dp and lay.tp == plain.candidates[0].layout.tp
        return {"memory": StepMemory(1000 * budget if over else budget // 2, 0, 0, 0), "flops": 0.0, "bytes": 0.0}

    monkeypatch.setattr(auto, "compile_figures", fake)
    monkeypatch.setattr(auto, "measure_layouts", lambda *a, **k: pytest.fail("measure=0 times nothing"))
    moved = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN,
                        memory_budget_bytes=budget)
    assert seen[0] == order[0] and seen[-1] == order[1]  # the first, its variants (all over), then the second
    assert [c.name for c in moved.candidates][:2] == [order[1], order[2]]
    assert [c.fits for c in moved.candidates][:2] == [True, True] and not any(c.fits for c in moved.candidates[2:])
    assert moved.candidates[-1].measured_peak == 1000 * budget

    # measure=2 under the budget: compiled until 2 fit, then those 2 timed together on their compiled steps
    timed = []

    def fake_measure(*a, compiled, progress=None, spreads=None):
        timed.append(([lay.name for lay in a[-1]], [compiled[lay] for lay in a[-1]]))
        return [(0.1 * (1 + i), budget // 2) for i in range(len(a[-1]))]  # no tie: their order kept

    seen.clear()
    monkeypatch.setattr(auto, "measure_layouts", fake_measure)
    both = auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN,
                       memory_budget_bytes=budget, measure=2)
    assert seen[0] == order[0] and seen[-2:] == order[1:]
    assert timed == [(order[1:3], [f"compiled {n}" for n in order[1:3]])]  # one interleaved set, not recompiled
    assert [c.name for c in both.candidates][:2] == [order[1], order[2]]
    monkeypatch.setattr(auto, "compile_figures", lambda *a, **k: {"memory": StepMemory(1000 * budget, 0, 0, 0),
                                                                  "flops": 0.0, "bytes": 0.0})
    with pytest.raises(ValueError, match=re.escape(f"auto_layout: no layout fits memory_budget_bytes={budget:,} once "
                                                   "compiled: ") + r"\d+ whose lower bound fits were compiled \(with "
                       "the accumulation and checkpointing variants of those over\\), and the smallest, "):
        auto_layout(MODEL, OPT, batch, 8, calibration=_cal(), profile=prof, layouts=lays, plan=PLAN,
                    memory_budget_bytes=budget)


def test_measure_layouts_takes_no_fewer_max_rounds_than_rounds(data):
    from spmd.parallel.auto._measure import measure_layouts

    batch, params, _ = data
    with pytest.raises(ValueError, match=re.escape("measure_layouts: max_rounds=3 must be >= rounds=5")):
        measure_layouts(MODEL, OPT, default_loss, params, batch, jax.devices()[:8], [LAYOUTS["dp=8"]], max_rounds=3)


def test_checked_compiles_in_ranked_order_until_one_fits_and_under_bound_until_none_can_beat_it(data):
    """``checked``: the candidates compiled in ranked order; one over the budget goes behind and its variants
    join; ``bound=True`` (a compile prices the time anew) goes on while the next estimate is below the fastest
    compiled fitting one."""
    from spmd.parallel.auto._budget import checked

    batch, _, prof = data
    base = evaluate_layout(MODEL, OPT, batch, 8, LAYOUTS["dp=8"], calibration=_cal(), profile=prof)
    cand = lambda accum, s: replace(base, layout=replace(base.layout, accum_steps=accum), predicted_s=s,  # noqa
                                    fits=True)
    a, b, c, v = cand(1, 1.0), cand(2, 2.0), cand(4, 5.0), cand(8, 1.5)
    peaks, secs, order = {1: 2000, 2: 900, 4: 800, 8: 700}, {1: 1.0, 2: 3.0, 4: 6.0, 8: 1.6}, []

    def compiled(x):
        order.append(x.layout.accum_steps)
        p = peaks[x.layout.accum_steps]
        return replace(x, measured_peak=p, fits=p <= 1000, predicted_s=secs[x.layout.accum_steps])

    got = checked([a, b, c], 1, 1000, compiled, lambda x, budget: [v] if x is not v else [])
    assert order == [1, 8]  # a over: its variant v (1.5) ranks before b and fits: k=1 reached
    assert [(x.layout.accum_steps, x.fits, x.measured_peak) for x in got] == [
        (8, True, 700), (2, True, None), (4, True, None), (1, False, 2000)]
    close = cand(4, 2.5)
    for bound, want in ((False, [2]), (True, [2, 4])):  # b compiles to 3.0 s: close's estimate 2.5 might beat it
        order.clear()
        got = checked([b, close], 1, 1000, compiled, lambda x, budget: [], bound=bound)
        assert order == want and got[0].layout.accum_steps == 2
    order.clear()
    checked([b, c], 1, 1000, compiled, lambda x, budget: [], bound=True)
    assert order == [2]  # c's estimate 5.0 cannot beat b's compiled 3.0: never compiled
