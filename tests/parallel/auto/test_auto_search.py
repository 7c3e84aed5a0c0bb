"""auto_layout's search under ``hardware=``: the compute bound a layout is pruned on (the model's matmul flops
per device at the peak rate) is below every compiled step's own flops, it is counted exactly (a two-matmul
loss against the flops written out by hand), and the best-first search (``_budget.searched``) picks what
compiling every candidate picks while leaving some untraced."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import Transformer
from models._plans import transformer_tp_plan
from spmd.parallel import Hardware, Layout, Link, auto_layout
from spmd.parallel.auto._auto import _with_compiled, candidate_layouts, default_loss, evaluate_layout
from spmd.parallel.auto._compiled import compile_figures
from spmd.parallel.auto._priced import HardwareRates, dot_flops
from spmd.parallel.cost._memory import Profile

VOCAB, T, B = 16, 16, 16
OPT = optax.adamw(1e-3)
U = ("block_*",)
MODEL = Transformer(VOCAB, T, num_layers=2, d_model=32, num_heads=4)


def _batch() -> dict:
    tok = np.random.default_rng(0).integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _plan(sequence_parallel: bool, tp_size: int):
    return None if sequence_parallel else transformer_tp_plan(False, vocab_size=VOCAB, tp_size=tp_size)


def test_dot_flops_counts_the_gradients_matmuls():
    """``loss = sum((x @ w1) @ w2)``: forward 2BDH + 2BHO, backward (parameters only) dh = g w2^T (2BHO),
    dw2 = h^T g (2BHO), dw1 = x^T dh (2BDH)."""
    b, d, h, o = 5, 3, 7, 2
    params = {"w1": jax.ShapeDtypeStruct((d, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, o), jnp.float32)}
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)
    got = dot_flops(lambda p, x: jnp.sum((x @ p["w1"]) @ p["w2"]), params, x)
    assert got == 4 * b * d * h + 6 * b * h * o


@pytest.mark.slow  # compiles five layouts of a two-block model
def test_the_compute_bound_is_below_every_compiled_steps_flops():
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    work = dot_flops(default_loss(MODEL), params, batch)
    tp = lambda n: tuple(_plan(False, n).items())  # noqa: E731
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U), Layout(fsdp=8, units=U, mixed_precision="bfloat16"),
                Layout(dp=2, tp=4, tp_plan=tp(4)),
                Layout(fsdp=8, units=U, reshard_after_forward=False, activation_checkpointing="full")):
        got = compile_figures(MODEL, OPT, default_loss, params, batch, jax.devices()[:8], lay)
        assert work / 8 <= got["flops"], (lay.name, work / 8, got["flops"])


def _hw() -> Hardware:
    """Compute slow enough that the bound prunes the float32 layouts (bf16 10x faster), links as an H100's."""
    return Hardware("slow", {"float32": 2e9, "bfloat16": 2e10}, 80e9, 3e12, 4, Link(450e9, 3e-6), Link(50e9, 1e-5))


@pytest.mark.slow  # traces and compiles every candidate of a two-block model on 2 devices
def test_the_search_picks_what_compiling_every_candidate_picks():
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(MODEL), params, OPT)
    got = auto_layout(MODEL, OPT, batch, 2, hardware=_hw(), plan=_plan, units=U, params=params, profile=prof,
                      mixed_precision="bfloat16")
    untraced = [n for n, why in got.rejected if why.startswith("not traced: bound ")]
    assert untraced, got.rejected  # the bound prunes: some layouts were never traced
    # the reference: every candidate traced and compiled, the fastest fitting one by its compiled time
    rates = HardwareRates(_hw(), "float32", group_size=2)
    lays = [lay for base in candidate_layouts(2, _plan, U)
            for lay in (base, *((Layout(**{**base.__dict__, "mixed_precision": "bfloat16"}),) if base.fsdp > 1 else ()))]
    best = None
    for lay in lays:
        c = evaluate_layout(MODEL, OPT, batch, 2, lay, params=params, calibration=rates, profile=prof,
                            budget=int(80e9))
        c = _with_compiled(c, compile_figures(MODEL, OPT, default_loss, params, batch, jax.devices()[:2], lay),
                           rates, int(80e9))
        if c.fits and (best is None or c.predicted_s < best.predicted_s):
            best = c
    assert got.best.name == best.name
    assert got.best.predicted_s == pytest.approx(best.predicted_s, rel=1e-9)
    assert all(math.isfinite(c.predicted_s) for c in got if c.fits)


@pytest.mark.slow  # traces six layouts of a two-block model
def test_the_communication_bound_is_below_every_traced_steps_parameter_collectives():
    """``comm_floor`` (the gradients' reduction and FSDP's gathers at the least bytes, before any trace) is at
    most what the step's own table costs on the same hardware, for DP, FSDP, HSDP, mixed precision and tp; and
    it is no bound at all (0) for a layout without data dims."""
    from spmd.parallel.auto._priced import comm_floor

    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    hw = Hardware("h100 links", {"float32": 67e12}, 80e9, 3.35e12, 4, Link(450e9, 3e-6), Link(50e9, 1e-5))
    free = Hardware("no latency", {"float32": 67e12}, 80e9, 3.35e12, 4, Link(450e9, 0.0), Link(50e9, 0.0))
    tp = lambda n: tuple(_plan(False, n).items())  # noqa: E731
    seen = []
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U), Layout(fsdp=8, units=U, mixed_precision="bfloat16"),
                Layout(dp=2, fsdp=4, units=U), Layout(dp=2, tp=4, tp_plan=tp(4)),
                Layout(fsdp=2, tp=4, tp_plan=tp(4), units=U, reshard_after_forward=False)):
        for h in (hw, free):
            c = evaluate_layout(MODEL, OPT, batch, jax.devices()[:8], lay, params=params,
                                calibration=HardwareRates(h, "float32", group_size=8))
            floor = comm_floor(lay, h, params)
            assert 0 < floor <= sum(c.comm_s.values()) * (1 + 1e-9), (lay.name, h.name, floor, c.comm_s)
        seen.append(floor / sum(c.comm_s.values()))
    assert seen[0] == pytest.approx(1.0)  # dp=8 without latency: all of it (one all-reduce of every gradient)
    assert comm_floor(Layout(tp=8, tp_plan=tp(8)), hw, params) == 0.0


def test_an_uncompiled_estimate_is_scaled_by_its_nearest_compiled_kins_ratio():
    """``sharpened``: the kin of the same compute dtype (and, among those, checkpointing policy) gives the ratio,
    whatever the order compiled; the communication is not scaled; a compiled one and a candidate with no time
    keep theirs."""
    from spmd.parallel.auto._budget import sharpened
    from spmd.parallel.auto._ranking import Candidate

    def cand(lay, predicted, compute, peak=None):
        return Candidate(layout=lay, predicted_s=predicted, compute_s=compute, comm_s={"all-gather": predicted - compute},
                         dispatch_s=0.0, communication={}, memory={"peak": 1}, flops=0.0, measured_peak=peak)

    f32 = Layout(fsdp=8, units=U)
    bf16_keep = Layout(fsdp=8, units=U, mixed_precision="bfloat16", reshard_after_forward=False)
    bf16 = Layout(fsdp=8, units=U, mixed_precision="bfloat16")  # re-gathering: the "dots" policy, as the target
    ratios = [(f32, 5.0), (bf16_keep, 3.0), (bf16, 2.0)]
    u = cand(Layout(dp=2, fsdp=4, units=U, mixed_precision="bfloat16"), 1.0, 0.4)
    assert sharpened(u, ratios) == pytest.approx(1.0 + (2.0 - 1.0) * 0.4)  # bf16 and "dots", not the first bf16
    assert sharpened(u, ratios[::-1]) == pytest.approx(1.4)
    assert sharpened(u, ratios[:2]) == pytest.approx(1.0 + (3.0 - 1.0) * 0.4)  # bf16 before the policy
    assert sharpened(u, [(f32, 0.5)]) == 1.0  # no kin of its dtype: not scaled
    assert sharpened(u, [(bf16, 0.5)]) == 1.0  # a ratio under 1 (the estimate is a bound): not lowered
    tp = tuple(_plan(False, 2).items())
    assert sharpened(u, [(Layout(fsdp=4, tp=2, tp_plan=tp, units=U, mixed_precision="bfloat16"), 9.0)]) == 1.0
    assert sharpened(u, []) == 1.0
    assert sharpened(cand(bf16, 1.0, 0.4, peak=10), ratios) == 1.0  # compiled: its own time
    assert sharpened(cand(bf16, math.inf, math.inf), ratios) == math.inf


def test_a_candidate_is_over_the_budget_by_its_compiled_kins_excess_over_its_bound():
    """``over_by_kin``: the bound plus what the compiled kin of the same per-device program (same dtype, policy,
    tp cut, accumulation, keep / re-gather; another data-parallel split) was over its own bound; no such kin
    (another accumulation, policy or tp cut), within the budget, compiled or no budget: None."""
    from spmd.parallel.auto._budget import over_by_kin
    from spmd.parallel.auto._ranking import Candidate

    def cand(lay, bound, peak=None):
        return Candidate(layout=lay, predicted_s=1.0, compute_s=0.5, comm_s={}, dispatch_s=0.0, communication={},
                         memory={"peak": bound}, flops=0.0, measured_peak=peak)

    keep = dict(units=U, mixed_precision="bfloat16", reshard_after_forward=False)
    kin = Layout(dp=2, fsdp=4, **keep)
    excesses = [(Layout(dp=8), 500), (kin, 100)]  # kin: compiled 130, bound 30
    u = cand(Layout(fsdp=8, **keep), 20)
    assert over_by_kin(u, excesses, 110) == 120  # 20 + 100 > 110
    assert over_by_kin(u, excesses, 120) is None  # fits so
    assert over_by_kin(u, excesses, None) is None
    assert over_by_kin(cand(u.layout, 20, peak=200), excesses, 110) is None  # compiled: its own peak
    for other in (Layout(fsdp=8, accum_steps=2, **keep), Layout(fsdp=8, activation_checkpointing="full", **keep),
                  Layout(fsdp=8, units=U, mixed_precision="bfloat16"), Layout(fsdp=8, units=U, reshard_after_forward=False)):
        assert over_by_kin(cand(other, 20), excesses, 110) is None, other.name
    assert over_by_kin(u, [(kin, 100), (Layout(dp=4, fsdp=2, **keep), 50)], 60) == 70  # the last compiled kin


def test_a_policy_that_lowered_nothing_stops_the_heavier_ones():
    """``stalled``: a compiled policy whose peak is no lower than the same layout's (same accumulation) with no
    policy or a lighter one (the 8B/64 ``dp=8,fsdp=8 keep``: 158.6 GiB with none, 274.6 with ``"dots"``);
    lower, another accumulation, no lighter one compiled, or no policy of its own: not stalled."""
    from spmd.parallel.auto._budget import stalled
    from spmd.parallel.auto._ranking import Candidate

    def cand(lay, peak):
        return Candidate(layout=lay, predicted_s=1.0, compute_s=0.5, comm_s={}, dispatch_s=0.0, communication={},
                         memory={"peak": 1}, flops=0.0, measured_peak=peak, fits=False)

    keep = dict(dp=8, fsdp=8, units=U, mixed_precision="bfloat16", reshard_after_forward=False)
    none = cand(Layout(**keep), 158)
    dots = cand(Layout(**keep, activation_checkpointing="dots"), 274)
    assert stalled(dots, [none]) and stalled(cand(dots.layout, 158), [none])
    assert not stalled(cand(dots.layout, 150), [none])  # lowered: the heavier ones weighed
    assert stalled(cand(dots.layout, 157), [none])  # within 1%: lowered nothing
    full = cand(Layout(**keep, activation_checkpointing="full"), 158)
    assert stalled(full, [none, dots]) and not stalled(full, [dots, cand(Layout(**keep, accum_steps=2), 100)])
    assert not stalled(full, []) and not stalled(none, [dots])  # nothing lighter compiled; no policy of its own
    assert stalled(cand(Layout(dp=8, units=U, activation_checkpointing="minimal"), 5), [cand(Layout(dp=8), 5)])


@pytest.mark.slow  # traces ten layouts of a two-block model on 8 devices three times, compiles each once
@pytest.mark.timeout(900)  # ~1 min of CPU; minutes on a loaded 2-core host
def test_the_scaled_search_picks_what_the_sound_search_picks_on_8_devices(monkeypatch):
    """``_budget.SHARPEN`` (compile only the candidates whose estimate, scaled as their nearest compiled kin's,
    is below the pick) against the sound search (every candidate whose estimate is below the pick compiled):
    the same pick at the same compiled time, with fewer candidates compiled, over DP / FSDP / HSDP / tp, keep
    and re-gather, float32 and bfloat16."""
    from spmd.parallel.auto import _auto, _budget

    # the three searches compile the same layouts of the same model, batch and devices: each layout's compiled
    # figures compiled once and reused (the counts compared below are the searches' own: each search asks for
    # its compiles as without the cache)
    figures, compile_figures_once = {}, _auto.compile_figures

    def cached(*args, keep=None, built=None, hardware=None):
        lay = args[6]
        if keep is not None or built is not None:  # a kept executable or a given trace: not what is cached
            return compile_figures_once(*args, keep=keep, built=built, hardware=hardware)
        if lay not in figures:
            figures[lay] = compile_figures_once(*args, hardware=hardware)
        return figures[lay]

    monkeypatch.setattr(_auto, "compile_figures", cached)
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(MODEL), params, OPT)
    # memory slow beside the matmuls: the compiled compute is the bytes' side of the roofline, several times
    # the estimate (the flops at the matmul peak), so the sound search compiles every estimate below the pick
    hw = Hardware("slow memory", {"float32": 2e10, "bfloat16": 2e11}, 80e9, 1e9, 4, Link(450e9, 3e-6),
                  Link(50e9, 1e-5))
    tp = lambda n: tuple(_plan(False, n).items())  # noqa: E731
    lays = [Layout(dp=8), Layout(dp=2, tp=4, tp_plan=tp(4))] + [
        Layout(dp=8 // f // t, fsdp=f, tp=t, tp_plan=tp(t) if t > 1 else None, units=U, reshard_after_forward=raf,
               mixed_precision=mp)
        for f, t, raf, mp in ((8, 1, True, None), (8, 1, True, "bfloat16"), (8, 1, False, "bfloat16"),
                              (4, 1, True, "bfloat16"), (2, 1, False, "bfloat16"), (4, 2, True, "bfloat16"),
                              (2, 2, False, "bfloat16"), (2, 4, True, "bfloat16"))]
    got = {}
    for sharpen, tol in ((False, 0.0), (True, 0.0), (True, 0.25)):
        monkeypatch.setattr(_budget, "SHARPEN", sharpen)
        monkeypatch.setattr(_budget, "TOLERANCE", tol)
        got[sharpen, tol] = auto_layout(MODEL, OPT, batch, 8, hardware=hw, plan=_plan, units=U, params=params,
                                   profile=prof, layouts=lays)
    sound, scaled, loose = got[False, 0.0], got[True, 0.0], got[True, 0.25]
    assert scaled.best.name == sound.best.name
    assert scaled.best.predicted_s == pytest.approx(sound.best.predicted_s, rel=1e-9)
    assert scaled.best.measured_peak == sound.best.measured_peak
    assert scaled.search["compiled"] < sound.search["compiled"], (scaled.search, sound.search)
    # TOLERANCE: the candidates within 25% of the fastest compiled one left out; the pick no more than that slower
    assert loose.best.predicted_s <= sound.best.predicted_s / (1 - 0.25)
    assert loose.search["compiled"] <= scaled.search["compiled"], (loose.search, scaled.search)
    print(sound.search, scaled.search, loose.search, f"{len(figures)} layouts compiled")


def test_the_search_stops_at_its_time_budget_once_one_fits_and_says_what_it_left(monkeypatch):
    """``SEARCH_SECONDS``: with a fake clock that advances 10 s a trace and 30 s a compile, a 50 s budget stops the
    search after the first fitting compile (the layouts left untraced are returned with their bounds, below the
    pick's time, and ``stats`` says ``"time"`` and logs each trace and compile); with no budget the same search
    runs on to the bound and compiles the faster layout the budget left out; a budget never stops a search that
    has no fitting compiled candidate yet."""
    from spmd.parallel.auto import _budget
    from spmd.parallel.auto._ranking import Candidate

    now = [0.0]

    def cand(lay, t, peak=None, fits=True):
        return Candidate(layout=lay, predicted_s=t, compute_s=t, comm_s={}, dispatch_s=0.0, communication={},
                         memory={"peak": 1}, flops=0.0, measured_peak=peak, fits=fits)

    lays = [Layout(dp=8), Layout(fsdp=8, units=U), Layout(dp=2, fsdp=4, units=U)]
    bounds = {lays[0]: 1.0, lays[1]: 1.1, lays[2]: 1.2}
    compiled_t = {lays[0]: 3.0, lays[1]: 1.5, lays[2]: 2.5}  # the second layout is the fastest once compiled
    over = set()

    def trace(lay):
        now[0] += 10
        return [cand(lay, bounds[lay])]

    def compiled(c):
        now[0] += 30
        return cand(c.layout, compiled_t[c.layout], peak=5, fits=c.layout not in over)

    def run(seconds):
        monkeypatch.setattr(_budget, "SHARPEN", False)
        monkeypatch.setattr(_budget, "SEARCH_SECONDS", seconds)
        now[0], stats = 0.0, {}
        got, skipped = _budget.searched(lays, bounds.get, trace, 1, 100, compiled, lambda c, b: [], stats=stats,
                                        clock=lambda: now[0])
        return got, skipped, stats

    got, skipped, stats = run(50.0)  # trace (10) + compile (30): 40 s, under; the next trace: 50 s, spent
    assert stats["stopped"] == "time" and stats["compiled"] == 1
    assert got[0].layout == lays[0] and got[0].measured_peak == 5  # its compiled peak
    assert [lay for lay, _ in skipped] == [lays[2]] and skipped[0][1] < got[0].predicted_s
    assert [a for a, *_ in stats["log"]] == ["trace", "compile", "trace", "end"]
    assert [s for _, _, s, _ in stats["log"][:-1]] == [10.0, 30.0, 10.0]
    # both left out below the pick's 3 s by their bounds: left by the time, not pruned
    assert (stats["left_by_time"], stats["pruned_by_bound"], stats["skipped_by_estimate"]) == (2, 0, 0)
    assert stats["left"] == [
        (lays[2].name, "not traced: the search's time budget (50.0 s) was spent first; bound 1200.00 ms < the "
                       f"pick's 3000.00 ms ({lays[0].name}), so it might be faster")]
    assert stats["not_compiled"] == [
        (lays[1].name, "not compiled: the search's time budget (50.0 s) was spent first; bound 1100.00 ms < the "
                       f"pick's 3000.00 ms ({lays[0].name}), so it might be faster")]
    assert any(c.layout == lays[1] and c.measured_peak is None for c in got)  # traced, left uncompiled, ranked
    got, skipped, stats = run(None)
    assert stats["stopped"] == "bound" and got[0].layout == lays[1] and got[0].predicted_s == 1.5
    over.add(lays[0])  # the first compiled does not fit: the budget waits for one that does
    got, skipped, stats = run(1.0)
    assert stats["stopped"] == "time" and got[0].layout == lays[1] and got[0].fits



def test_once_the_time_is_spent_with_none_fitting_an_over_candidate_goes_straight_to_full_checkpointing(
        monkeypatch):
    """``SEARCH_SECONDS`` spent and no compiled candidate fitting: a candidate over once compiled has its
    ``"full"`` variant traced next (the lighter policies its ``variants`` would give not weighed, said in
    ``stats["hurried"]``), and that one is compiled before any lighter candidate left."""
    from spmd.parallel.auto import _budget
    from spmd.parallel.auto._ranking import Candidate

    now = [0.0]
    lay = Layout(fsdp=8, units=U)
    other = Layout(dp=2, fsdp=4, units=U)

    def cand(lay, t, peak=None, fits=True):
        return Candidate(layout=lay, predicted_s=t, compute_s=t, comm_s={}, dispatch_s=0.0, communication={},
                         memory={"peak": 1}, flops=0.0, measured_peak=peak, fits=fits)

    def trace(x):
        now[0] += 10
        return [cand(x, 1.4 if x.activation_checkpointing == "full" else 1.0 if x == lay else 1.1)]

    def compiled(c):
        now[0] += 30
        return cand(c.layout, c.predicted_s, peak=5, fits=c.layout.activation_checkpointing == "full")

    def variants(c, budget):  # the next lighter policy: never asked once hurried
        return [cand(__import__("dataclasses").replace(c.layout, activation_checkpointing="minimal"), 1.05)]

    monkeypatch.setattr(_budget, "SHARPEN", False)
    monkeypatch.setattr(_budget, "SEARCH_SECONDS", 15.0)
    stats = {}
    got, _ = _budget.searched([lay, other], {lay: 1.0, other: 1.1}.get, trace, 1, 100, compiled, variants,
                              stats=stats, clock=lambda: now[0])
    assert [(a, n) for a, n, *_ in stats["log"]] == [
        ("trace", lay.name), ("compile", lay.name), ("compile", lay.name + " ac=full"), ("end", "stopped by time")
    ], stats["log"]
    assert got[0].layout.activation_checkpointing == "full" and got[0].fits and stats["stopped"] == "time"
    assert [n for n, _ in stats["hurried"]] == [lay.name] and "not weighed" in stats["hurried"][0][1]
