"""auto_layout's search prunes by proven bounds (``_priced.step_floor``, ``comm_floor``, ``tp_floor``): a layout's
bound before any trace is at most its traced bound, which is at most its compiled predicted time, on DP, FSDP, HSDP with
accumulation, tp, mixed precision and full checkpointing, priced on an H100's figures and on a hardware whose
memory is slow beside its matmuls (the bytes' side of the roofline); the sound search (``_budget.SHARPEN``
off) picks what compiling every candidate picks, compiling fewer, and every candidate it drops by its bound is
no faster than the pick once compiled."""

from __future__ import annotations

import jax
import pytest

from spmd.parallel import Hardware, Layout, Link, auto_layout
from spmd.parallel.auto._auto import _with_compiled, default_loss, evaluate_layout
from spmd.parallel.auto._compiled import compile_figures
from spmd.parallel.auto._priced import (HardwareRates, comm_floor, dot_bytes, dot_cost, state_floor, step_floor,
                                       tp_floor, tp_traffic)
from spmd.parallel.cost._memory import Profile
from tests.parallel.auto.test_auto_search import MODEL, OPT, U, _batch, _plan

SLOW_MEMORY = Hardware("slow memory", {"float32": 2e10, "bfloat16": 2e11}, 80e9, 1e9, 4, Link(450e9, 3e-6),
                       Link(50e9, 1e-5))


def _tp(n: int) -> tuple:
    return tuple(_plan(False, n).items())


def _pre_bound(lay: Layout, hw: Hardware, params, work: float, io: dict, batch: dict) -> float:
    """What ``auto_layout``'s search bounds ``lay`` by before tracing it (its ``bound``)."""
    acts = tp_floor(lay, hw, tp_traffic(default_loss(MODEL), params, batch, lay.tp_plan)) if lay.tp > 1 else 0.0
    return step_floor(hw, lay.mixed_precision or "float32", work / lay.size, dot_bytes(io, lay.mixed_precision) /
                      lay.size, state_floor(lay, params, OPT)) + comm_floor(lay, hw, params) + acts


@pytest.mark.slow  # compiles five layouts of a two-block model on 8 devices
@pytest.mark.timeout(900)
def test_the_bounds_are_below_the_compiled_predicted_time():
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(MODEL), params, OPT)
    work, io = dot_cost(default_loss(MODEL), params, batch)
    lays = (Layout(dp=8), Layout(fsdp=8, units=U, mixed_precision="bfloat16"),
            Layout(dp=2, fsdp=4, units=U, accum_steps=2), Layout(dp=2, tp=4, tp_plan=_tp(4)),
            Layout(fsdp=8, units=U, reshard_after_forward=False, activation_checkpointing="full"))
    for lay in lays:
        figs = compile_figures(MODEL, OPT, default_loss, params, batch, jax.devices()[:8], lay)
        for hw in (Hardware.named("h100"), SLOW_MEMORY):
            rates = HardwareRates(hw, "float32", group_size=8)
            traced = evaluate_layout(MODEL, OPT, batch, 8, lay, params=params, calibration=rates, profile=prof)
            compiled = _with_compiled(traced, figs, rates, None)
            pre = _pre_bound(lay, hw, params, work, io, batch)
            assert 0 < pre <= traced.predicted_s * (1 + 1e-9), (lay.name, hw.name, pre, traced.predicted_s)
            assert traced.predicted_s <= compiled.predicted_s * (1 + 1e-9), (lay.name, hw.name, traced.predicted_s,
                                                                             compiled.predicted_s)
            if hw is SLOW_MEMORY and lay.tp == 1:  # the bytes' side: the traced bound's compute is its bytes'
                assert traced.compute_s > hw.matmul_s(work / 8, lay.mixed_precision or "float32"), lay.name


@pytest.mark.slow  # traces eight layouts of a two-block model on 8 devices and compiles each once
@pytest.mark.timeout(900)
def test_the_sound_search_prunes_by_bound_and_picks_what_compiling_every_candidate_picks(monkeypatch):
    from spmd.parallel.auto import _auto, _budget

    figures, compile_figures_once = {}, _auto.compile_figures
    asked = []  # the layouts the search compiled

    def cached(*args, keep=None, built=None, hardware=None):
        asked.append(args[6])
        if args[6] not in figures:
            figures[args[6]] = compile_figures_once(*args, keep=keep, built=built, hardware=hardware)
        return figures[args[6]]

    monkeypatch.setattr(_auto, "compile_figures", cached)
    monkeypatch.setattr(_budget, "SHARPEN", False)  # the sound search: pruned by bounds alone
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(MODEL), params, OPT)
    hw = Hardware.named("h100")
    lays = [Layout(dp=8), Layout(dp=2, tp=4, tp_plan=_tp(4)), Layout(fsdp=8, units=U),
            Layout(fsdp=8, units=U, reshard_after_forward=False, mixed_precision="bfloat16"),
            Layout(dp=2, fsdp=4, units=U, mixed_precision="bfloat16"), Layout(dp=4, fsdp=2, units=U),
            Layout(dp=2, fsdp=2, tp=2, tp_plan=_tp(2), units=U), Layout(fsdp=2, tp=4, tp_plan=_tp(4), units=U)]
    got = auto_layout(MODEL, OPT, batch, 8, hardware=hw, plan=_plan, units=U, params=params, profile=prof,
                      layouts=lays)
    searched = list(asked)
    pruned = [n for n, why in got.rejected + tuple(got.search["not_compiled"])
              if ": bound " in why and f">= the pick's {1e3 * got.best.predicted_s:.2f} ms" in why]
    # every layout the search did not compile was pruned by its bound (none left by time or by an estimate)
    assert sorted(pruned) == sorted(lay.name for lay in lays if lay not in searched) and pruned, got.rejected
    assert got.search["pruned_by_bound"] == len(pruned) and got.search["left_by_time"] == 0
    assert got.search["skipped_by_estimate"] == 0 and got.search["stopped"] == "bound"
    assert f"{len(searched)} compiled; {len(pruned)} pruned by bound" in got.why()
    # the reference: every layout traced and compiled, the fastest fitting one by its compiled time
    rates = HardwareRates(hw, "float32", group_size=8)
    every = {}
    for lay in lays:
        c = evaluate_layout(MODEL, OPT, batch, 8, lay, params=params, calibration=rates, profile=prof)
        every[lay.name] = _with_compiled(c, cached(MODEL, OPT, _auto.default_loss, params, batch, jax.devices()[:8],
                                                   lay, hardware=hw), rates, int(hw.memory_bytes))
    best = min((c for c in every.values() if c.fits), key=lambda c: c.predicted_s)
    assert got.best.name == best.name
    assert got.best.predicted_s == pytest.approx(best.predicted_s, rel=1e-9)
    assert len(searched) == got.search["compiled"] < len(lays), (searched, got.search)
    for name in pruned:  # each dropped by its bound is no faster once compiled
        assert every[name].predicted_s >= got.best.predicted_s, (name, every[name].predicted_s)
    print(f"compiled {len(searched)} of {len(lays)}; pruned by bound: {pruned}")


def test_what_the_search_leaves_out_is_named_with_its_bound_and_counted(monkeypatch):
    """A layout untraced and a candidate uncompiled whose bounds are no faster than the pick's compiled time are
    pruned, each named "bound X ms >= the pick's Y ms", counted in ``stats`` and said by ``AutoLayout.why()``."""
    from dataclasses import replace

    from spmd.parallel.auto import _budget
    from spmd.parallel.auto._ranking import AutoLayout, Candidate

    def cand(lay, t, peak=None):
        return Candidate(layout=lay, predicted_s=t, compute_s=t, comm_s={}, dispatch_s=0.0,
                         communication={"total": {}}, memory={"peak": 1}, flops=0.0, measured_peak=peak)

    a, b, c = Layout(dp=8), Layout(fsdp=8, units=U), Layout(dp=2, fsdp=4, units=U)
    a2 = replace(a, accum_steps=2)
    bounds = {a: 1.0, b: 2.0, c: 3.0}
    monkeypatch.setattr(_budget, "SHARPEN", False)
    stats = {}
    got, _ = _budget.searched([c, b, a], bounds.get, lambda lay: [cand(lay, 1.0), cand(a2, 1.8)], 1, 100,
                              lambda x: cand(x.layout, 1.5, peak=5), lambda x, budget: [], stats=stats)
    assert [x.layout for x in got] == [a, a2] and got[0].measured_peak == 5  # a2 ranked uncompiled
    assert stats["left"] == [(b.name, f"not traced: bound 2000.00 ms >= the pick's 1500.00 ms ({a.name})"),
                             (c.name, f"not traced: bound 3000.00 ms >= the pick's 1500.00 ms ({a.name})")]
    assert stats["not_compiled"] == [(a2.name, f"not compiled: bound 1800.00 ms >= the pick's 1500.00 ms ({a.name})")]
    assert (stats["compiled"], stats["pruned_by_bound"], stats["left_by_time"], stats["skipped_by_estimate"]) == (
        1, 3, 0, 0)
    assert stats["log"][-1] == ("end", "stopped by bound", stats["log"][-1][2],
                                "1 compiled, 3 pruned by bound, 0 left by time, 0 skipped by estimate")
    why = AutoLayout(tuple(got), search=stats).why()
    assert why.endswith(" Search: 1 compiled; 3 pruned by bound (a lower bound on their step time no faster than "
                        "the pick's), 0 left by the time budget, 0 skipped by estimate (not proven slower)."), why


def test_the_pre_trace_matmul_work_carried_from_the_slices_equals_the_deep_models():
    """``depth=``: the matmuls' flops and elements read off the sliced models and carried to the depth equal the
    deep model's own (each block adds the same matmuls), so the untraced bound of a deep model is its own."""
    from models import Transformer
    from spmd.parallel.auto._auto import _read_at, _slices

    def model(n):
        return Transformer(16, 16, num_layers=n, d_model=32, num_heads=4)

    batch = _batch()
    deep = model(6)
    params = jax.eval_shape(lambda: deep.init(jax.random.key(0), batch["inputs"])["params"])
    slices = _slices(model, None, U, params, batch, OPT, "auto_layout")
    flops, io = _read_at(slices, default_loss(deep), params, batch, dot_cost)
    want_flops, want_io = dot_cost(default_loss(deep), params, batch)
    assert flops == want_flops and io == want_io and want_io
    traffic = _read_at(slices, default_loss(deep), params, batch, lambda *a: tp_traffic(*a, _tp(4)))
    want = tp_traffic(default_loss(deep), params, batch, _tp(4))
    assert traffic == want and want["all-reduce"]


def test_the_matmul_elements_are_counted_by_hand():
    """``loss = sum((x @ w1) @ w2)``: forward reads x, w1 and writes h, reads h, w2 and writes the output;
    backward (the loss's cotangent a broadcast of 1, which XLA folds: not counted) dh = g w2^T reads w2 and
    writes dh, dw2 = h^T g reads h and writes dw2, dw1 = x^T dh reads x, dh and writes dw1."""
    import jax.numpy as jnp

    b, d, h, o = 5, 3, 7, 2
    params = {"w1": jax.ShapeDtypeStruct((d, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, o), jnp.bfloat16)}
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)
    flops, io = dot_cost(lambda p, x: jnp.sum(((x @ p["w1"]).astype(jnp.bfloat16) @ p["w2"]).astype(jnp.float32)),
                         params, x)
    assert flops == 4 * b * d * h + 6 * b * h * o
    f32 = 2 * b * d + 2 * d * h + 2 * b * h  # x twice, w1 and dw1, h (forward's result) and dh (its cotangent)
    bf16 = 3 * b * h + 3 * h * o + b * o  # h read twice and dh written, w2 twice and dw2, the output
    assert io == {"float32": f32, "bfloat16": bf16}, io
    assert dot_bytes(io) == 4 * f32 + 2 * bf16 and dot_bytes(io, "bfloat16") == 2 * (f32 + bf16)


def test_a_layout_left_by_the_tolerance_alone_is_not_said_pruned(monkeypatch):
    """``TOLERANCE``: a layout whose bound is below the pick's time but within that fraction of it is left
    untraced, named so and counted as skipped, not as pruned by its bound."""
    from spmd.parallel.auto import _budget
    from spmd.parallel.auto._ranking import Candidate

    def cand(lay, t, peak=None):
        return Candidate(layout=lay, predicted_s=t, compute_s=t, comm_s={}, dispatch_s=0.0,
                         communication={"total": {}}, memory={"peak": 1}, flops=0.0, measured_peak=peak)

    a, b = Layout(dp=8), Layout(fsdp=8, units=U)
    monkeypatch.setattr(_budget, "SHARPEN", False)
    monkeypatch.setattr(_budget, "TOLERANCE", 0.5)
    stats = {}
    _budget.searched([a, b], {a: 1.0, b: 1.2}.get, lambda lay: [cand(lay, 1.0)], 1, 100,
                     lambda x: cand(x.layout, 1.5, peak=5), lambda x, budget: [], stats=stats)
    assert stats["left"] == [(b.name, f"not traced: bound 1200.00 ms within _budget.TOLERANCE (50%) of the pick's "
                                      f"1500.00 ms ({a.name}), so not proven slower")]
    assert (stats["pruned_by_bound"], stats["skipped_by_estimate"]) == (0, 1)
