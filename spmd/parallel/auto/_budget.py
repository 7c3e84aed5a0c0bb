"""What a memory budget does to ``auto_layout``'s ranking.

- ``_fitting``: a layout whose lower bound (``spmd.parallel.cost._memory.memory_floor``) is over the budget is
  replaced by its variants whose bound fits (each activation-checkpointing policy with the least gradient
  accumulation that fits);
- ``checked``: the ranking's candidates compiled (not run) in ranked order, each judged by XLA's
  ``memory_analysis()`` peak, until ``k`` fit (and, where compiling changes the time, until no candidate left
  can beat the fastest compiled one: ``bound``). A candidate over the budget once compiled goes behind the
  fitting ones, and its own variants (more checkpointing, more accumulation) whose bound fits join the ranking
  to be compiled in their turn: a layout that needs one more accumulation step is found, not reported as "no
  layout fits";
- ``searched``: with ``auto_layout(hardware=)``, ``checked`` widened to the tracing: the layouts are taken in
  the order of a lower bound on their step time computed before anything of theirs is traced (the model's
  matmuls' flops and bytes per device at the peak rates, the update's bytes, the gradients' reduction at the
  least bytes: ``spmd.parallel.auto._priced.step_floor``, ``comm_floor``),
  and at each turn the cheaper of (trace the next layout, compile the best traced estimate) is done, until
  ``k`` compiled candidates fit and neither the next layout's bound nor the best uncompiled estimate is below
  the fastest compiled fitting one. Sound (``SHARPEN = False``): a layout's compiled time is at least its bound
  (its compute is the roofline of its compiled flops and bytes, which count every matmul of the gradient on
  its share of the batch, and recomputed or replicated ones beyond, each matmul's operands and result, and the
  update's state read and written; its communication and dispatch are >= 0), and a traced candidate's time
  until compiled is a bound too (its own matmuls and shards, its own communication table priced exactly as
  once compiled: ``tests/parallel/auto/test_auto_prune.py`` checks both inequalities), so no layout left out
  can beat the pick. Each layout or candidate left out is named with why (``stats["left"]``, ``auto_layout``'s
  ``rejected``; ``stats["not_compiled"]``, those ranked uncompiled): "bound X ms >= the pick's Y ms" (proven
  no faster), the time budget spent first, or (``SHARPEN``) its scaled estimate no faster, its bound
  below (not proven); ``stats`` counts each (``pruned_by_bound``, ``left_by_time``, ``skipped_by_estimate``)
  and ``AutoLayout.why()`` says them. By default
  (``SHARPEN = True``) the search compiles only the promising: once a candidate is compiled, the ratio of its
  compiled compute (the roofline of its own flops and bytes) to its estimate's (its flops at the matmul peak,
  no bytes; the model's matmuls, or the traced step's where more: what it recomputes and replicates) scales
  the compute of the uncompiled estimates and untraced bounds of its kin
  (``sharpened``: the compiled candidate nearest by ``_kin`` among those of the same compute dtype and tp cut:
  same checkpointing policy first, then accumulation, then data-parallel split; none such: not scaled), and those scaled figures decide what is traced and compiled. They
  are **estimates, not bounds**: the compiled compute of two layouts with the same per-device program (they
  differ in how the data-parallel degree splits, or keep / re-gather) differs only by the optimizer update's
  shards and the collectives' buffers, so a kin's ratio carries over closely, but a layout whose scaled
  estimate is above the pick's compiled time is not compiled, and nothing proves its compiled time would have
  been. The first candidate traced that fits its bound is compiled at once (its ratio scales the bounds of the
  layouts not yet traced), and so is the first of each compute dtype and tp cut (no ratio of its kind yet: its
  unscaled estimate, the matmuls at the peak rate, would otherwise have every layout of its kind traced). The uncompiled candidates are ranked at their scaled estimate, their peak at its
  lower bound (``>=``). Under a budget (``SHARPEN``) a candidate about to be compiled whose kin of the same
  per-device program (all but the data-parallel split) was compiled is judged first by its memory bound plus
  what that kin's compiled peak was over its own bound (``over_by_kin``; at 8B on 64 devices the bound misses
  the activations XLA keeps by 124-125 GiB alike for ``dp=8,fsdp=8`` and ``dp=16,fsdp=4``): over the budget so,
  it is not compiled (ranked behind the fitting ones, its peak marked ``~``) and its variants join the ranking.
  ``tests/parallel/auto/test_auto_search.py`` checks that the pick equals the sound search's. The
  search's time (``SEARCH_SECONDS``, wall clock; default none) stops it once spent and a compiled candidate
  fits: what it left untraced or uncompiled is reported so (``auto_layout``'s ``rejected``, ``search``);
- ``_measured``: the top ``k`` fitting candidates timed (``measure=``), the fastest measured first.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from typing import Any, Callable

import jax

from spmd.parallel.auto._measure import settled
from spmd.parallel.auto._ranking import Candidate
from spmd.parallel.cost._memory import _nbytes
from spmd.parallel.styles._remat import offload_refusal, policy_names
from spmd.parallel._jaxprs import all_eqns

__all__ = ["CHECKPOINTING", "weighed_policies", "checked", "searched", "sharpened", "over_by_kin", "stalled", "policy_of", "check_budget", "check_floor", "parts"]

# the activation-checkpointing policies weighed where memory needs them, from the least recomputation to the
# most (spmd.parallel.styles._remat.POLICIES: all of them); MaxText's named ones only where the model names those
# tensors, "offload" only where the devices have a host memory of their own (weighed_policies)
CHECKPOINTING = ("dots", "minimal", "offload", "save_dot_except_mlpwi", "save_dot_except_mlp", "selective",
                 "save_qkv_proj", "full")


def weighed_policies(loss: Callable, params: Any, batch: Any, devices: list, rejected: list) -> tuple[str, ...]:
    """The ``CHECKPOINTING`` policies ``auto_layout`` weighs for this model on ``devices``: a named one (MaxText's
    ``save_*``) where the model's loss names (``checkpoint_name``) one of its tensors at least, ``"offload"`` where
    ``offload_refusal`` has nothing against the devices; each left out goes to ``rejected`` with the reason."""
    names = {e.params["name"] for e in all_eqns(jax.make_jaxpr(loss)(params, batch).jaxpr) if e.primitive.name == "name"}
    out = []
    for p in CHECKPOINTING:
        if policy_names(p) and not names & set(policy_names(p)):
            kept = ", ".join(policy_names(p))
            rejected.append((f"ac={p}", f"the model names none of the tensors {p!r} keeps ({kept}: jax.ad_checkpoint"
                                        ".checkpoint_name); it would keep the blocks' inputs only, as 'full' does"))
            continue
        why = offload_refusal(devices) if p == "offload" else None
        if why:
            rejected.append((f"ac={p}", why))
            continue
        out.append(p)
    return tuple(out)


def check_budget(budget: Any, where: str) -> None:
    """A memory budget is a positive number of bytes per device, or None."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{where}: memory_budget_bytes={budget!r} must be a number of bytes per device (an int, e.g. "
                        "2 * 2**30 for 2 GiB) or None.")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"{where}: memory_budget_bytes={budget!r} must be a positive int or None (bytes per device, "
                         "e.g. 2 * 2**30 for 2 GiB).")


def check_floor(params: Any, optimizer: Any, n: int, budget: float, where: str) -> None:
    """Refuse, before anything is traced or compiled, a budget below what every layout of ``n`` devices holds:
    the state (parameters and optimizer state, before and after the update: the memory model's ``state``) cut
    over all ``n`` devices."""
    p, o = _nbytes(params), _nbytes(jax.eval_shape(optimizer.init, params))
    floor = -(-2 * (p + o) // n)
    if budget < floor:
        raise ValueError(
            f"{where}: no layout fits memory_budget_bytes={budget:,}: the state alone, the parameters ({p:,} B) and "
            f"the optimizer state ({o:,} B) held before and after the update (2 x {p + o:,} B), needs at least "
            f"{floor:,} B per device even cut over all {n} devices; give a budget above {floor:,} B (the "
            "activations and work buffers come on top), more devices or a smaller model.")


def parts(memory: dict) -> str:
    """The terms a predicted peak is the sum of (``spmd.parallel.cost._memory``: those before ``"peak"``)."""
    return ", ".join(f"{k} {int(v):,}" for k, v in itertools.takewhile(lambda kv: kv[0] != "peak", memory.items()) if v)


def _fitting(c: Candidate, evaluate: Callable, rows: int, units: tuple[str, ...], rejected: list,
             policies: tuple[str, ...] = CHECKPOINTING) -> list[Candidate]:
    """The variants of a layout that does not fit the budget which do: per activation-checkpointing policy
    (none, then ``policies``, ``CHECKPOINTING``'s weighed for the model, on the blocks ``units``; a layout with
    a policy of its own: that one, then the heavier ones after it in ``policies``, each with the layout's own
    accumulation at least (a layout over with ``"dots"`` and all the accumulation its rows allow is not a dead
    end: ``"full"`` is weighed for it); not under a
    pipeline, which recomputes its stages already; FSDP units re-gathered for the backward pass are not
    weighed under ``"dots"``), the least gradient accumulation that fits, where the micro-batches divide the replica's rows; a policy that
    needs no less accumulation than a lighter one (in ``CHECKPOINTING``'s order) is dropped, and once one fits
    with the layout's own accumulation the heavier ones are not weighed. None fitting:
    the smallest variant, for the error. A variant that cannot be built goes to ``rejected`` with its reason."""
    lay = c.layout
    local = rows // lay.n_data
    weighed = [None]
    own = lay.activation_checkpointing
    if lay.pp == 1 and units and (own is None or own in policies):  # a policy over: the heavier ones after it
        regather = lay.fsdp > 1 and lay.reshard_after_forward
        heavier = policies[policies.index(own) + 1:] if own is not None else policies
        weighed += [p for p in heavier if not (regather and p == "dots")]
    out = []
    for policy in weighed:
        base = lay if policy is None else replace(lay, activation_checkpointing=policy, units=lay.units or units)
        try:
            v = c if policy is None else evaluate(base)
        except (ValueError, TypeError) as e:
            rejected.append((base.name, str(e).split("\n")[0][:400]))
            continue
        a = 2 * base.accum_steps  # a layout given with accumulation: that is its least
        while not v.fits and a <= local and local % (a * base.microbatches) == 0 and (  # accumulate until it fits
                not base.weight_stationary or (local // a) % base.tp == 0):
            v2 = evaluate(replace(base, accum_steps=a))
            v = v2 if v2.fits or v2.memory["peak"] < v.memory["peak"] else v  # none fitting: the smallest
            a *= 2
        out.append(v)
        if v.fits and v.layout.accum_steps == base.accum_steps:  # the heavier policies would be dropped below:
            break  # none of them needs less accumulation than none at all
    fit = [v for v in out if v.fits]  # more recomputation at no less accumulation is slower: dropped
    fit = [v for i, v in enumerate(fit) if not any(u.layout.accum_steps <= v.layout.accum_steps for u in fit[:i])]
    return fit or [min(out, key=lambda v: v.memory["peak"])]


def _measured(got: list[Candidate], k: int, budget: int | None, measure: Callable) -> list[Candidate]:
    """``got`` (ranked, the fitting first) with its top ``k`` fitting candidates measured and first
    (``measure(layouts) -> [(seconds or None, peak bytes[, spread])]``), the fastest measured first (none timed:
    in ``got``'s order; those tied with it within the noise, the simplest first: ``_measure.settled``). A
    measured peak over ``budget`` does not fit: it goes behind the fitting ones and as many
    more are measured, until ``k`` fit or none is left."""
    timed, rest = [], list(got)
    while sum(c.fits for c in timed) < k and rest and rest[0].fits:
        need = k - sum(c.fits for c in timed)
        fit = [c for c in rest if c.fits]
        batch, rest = fit[:need], fit[need:] + [c for c in rest if not c.fits]
        for c, (t, peak, *spread) in zip(batch, measure([c.layout for c in batch])):  # spread: settled's
            timed.append(replace(c, measured_s=t, measured_peak=peak, fits=budget is None or peak <= budget,
                                 measured_spread=spread[0] if spread else None))
    timed.sort(key=lambda c: (not c.fits, c.predicted_s if c.measured_s is None else c.measured_s))
    return _merged(settled(timed), rest)  # a tie within the noise: the simpler first


def _ranked(cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: (not c.fits, c.predicted_s))


def _merged(done: list[Candidate], rest: list[Candidate]) -> list[Candidate]:
    """The compiled or measured ``done`` that fit, the ``rest`` that fit, then those of each that do not."""
    return [c for c in done if c.fits] + [c for c in rest if c.fits] + [c for c in done if not c.fits] + [
        c for c in rest if not c.fits]


def checked(got: list[Candidate], k: int, budget: int, compiled: Callable, variants: Callable, *,
            bound: bool = False, progress: Callable | None = None) -> list[Candidate]:
    """``got`` (ranked, the fitting first) with its candidates compiled one by one, in ranked order (see the
    module doc): ``compiled(candidate) -> candidate`` with its compiled peak (``measured_peak``, ``fits``) and,
    where compiling prices it anew, its time. Until ``k`` fit and (``bound``) the next one's estimate is no
    faster than the fastest compiled fitting one. A compiled peak over ``budget``: ``variants(candidate,
    budget)`` not seen before join the ranking. Returned: the compiled ones fitting, fastest first, then the
    rest whose bound fits, then the compiled ones that do not fit, then the rest. ``progress(candidate)``:
    called before each compile."""
    done, rest, seen = [], list(got), {c.layout for c in got}
    while rest and rest[0].fits:
        fit = [c for c in done if c.fits]
        if len(fit) >= k and (not bound or rest[0].predicted_s >= min(c.predicted_s for c in fit)):
            break
        c = rest.pop(0)
        if progress is not None:
            progress(c)
        c = compiled(c)
        done.append(c)
        if not c.fits:
            new = [v for v in variants(c, budget) if v.fits and v.layout not in seen]
            seen |= {v.layout for v in new}
            rest = _ranked(rest + new)
    return _merged(_ranked(done), rest)


def policy_of(layout: Any) -> str | None:
    """The checkpointing policy ``layout``'s blocks run under: its own, else ``"dots"`` where FSDP gathers the
    units again for their backward pass (each under ``jax.checkpoint`` keeping its matmul outputs and every
    other value but the gathered parameters, ``spmd.parallel.styles._fully_shard._saved``: the memory floor
    of ``"dots"``, which counts the matmul outputs), else None."""
    if layout.activation_checkpointing:
        return layout.activation_checkpointing
    return "dots" if layout.fsdp > 1 and layout.reshard_after_forward and layout.pp == 1 else None


# what makes two layouts' per-device compute programs alike, the most telling first (``_kin``): the compute
# dtype, the checkpointing policy (what is recomputed), the tensor-parallel cut and its variant, the
# micro-batch (accumulation), then how the data-parallel degree is split (FSDP's update shards)
_KIN = (lambda lay: lay.mixed_precision, policy_of, lambda lay: lay.tp, lambda lay: lay.sequence_parallel,
        lambda lay: lay.weight_stationary, lambda lay: lay.accum_steps, lambda lay: (lay.pp, lay.cp, lay.ep),
        lambda lay: lay.reshard_after_forward, lambda lay: lay.fsdp)


def _kin(a: Any, b: Any) -> tuple:
    """How alike the per-device programs of layouts ``a`` and ``b`` are: ``_KIN``'s equalities in order."""
    return tuple(f(a) == f(b) for f in _KIN)


def _nearest(lay: Any, ratios: list) -> float | None:
    """The ratio of ``lay``'s nearest compiled kin (``_kin``; the first compiled on a tie), among those of the
    same compute dtype and tensor-parallel cut (a tp layout's compiled compute counts what it replicates, a
    ratio no other cut shares); None where there is none."""
    same = [i for i, (other, _) in enumerate(ratios) if all(_kin(lay, other)[j] for j in (0, 2, 3, 4))]
    if not same:
        return None
    return ratios[max(same, key=lambda i: (_kin(lay, ratios[i][0]), -i))][1]


def sharpened(c: Candidate, ratios: list) -> float:
    """``c``'s time with its compute scaled as its nearest compiled kin's was (``ratios``: ``(layout, compiled
    compute / estimated compute)`` of each compiled candidate; the nearest of the same compute dtype and tp cut,
    ``_nearest``; a ratio under 1 taken as 1): an estimate, not a bound (see the module doc). With no ratio, or ``c``
    compiled (``measured_peak`` set), ``c.predicted_s``."""
    r = _nearest(c.layout, ratios) if math.isfinite(c.predicted_s) and c.measured_peak is None else None
    return c.predicted_s if r is None else c.predicted_s + (max(r, 1.0) - 1.0) * c.compute_s


def _excess_of(lay: Any, excesses: list) -> float | None:
    """What the compiled peak of ``lay``'s kin was over its memory lower bound (``excesses``: ``(layout, compiled
    peak - bound)`` of each compiled candidate): the last compiled of those whose per-device program is ``lay``'s
    but for how the data-parallel degree splits (``_KIN``'s all but the last: the same compute dtype,
    checkpointing policy, tp cut, accumulation, keep / re-gather); None where there is none."""
    same = [e for other, e in excesses if all(_kin(lay, other)[:-1])]
    return same[-1] if same else None


def over_by_kin(c: Candidate, excesses: list, budget: int | None) -> float | None:
    """``c``'s estimated peak where it is over ``budget``: its memory lower bound plus what its kin's compiled
    peak was over theirs (``_excess_of``: the activations and work buffers of the same per-device program, which
    the bound under-counts alike; the state, which differs with the split, the bound counts for each), else None
    (no kin, within the budget, or ``c`` compiled). An estimate, not a bound (see the module doc)."""
    if budget is None or c.measured_peak is not None or not c.fits:
        return None
    e = _excess_of(c.layout, excesses)
    if e is None:
        return None
    est = c.memory["peak"] + max(e, 0.0)
    return est if est > budget else None


def stalled(c: Candidate, compiled: list) -> bool:
    """Whether ``c``, compiled with a checkpointing policy of its own, peaks no lower than the same layout (same
    accumulation) compiled with no policy or a lighter one (``_lighter``), within 1% (the carried peaks of two
    policies keeping the same differ by KiB): its peak is then set by what no policy touches (at 8B on 64 devices
    ``dp=8,fsdp=8 keep`` peaked at 158.6 GiB with no policy and with every policy but ``"dots"``, 274.6), and the
    heavier ones, keeping fewer of the same residuals, are not weighed (an estimate, not a bound: ``SHARPEN``)."""
    own = c.layout.activation_checkpointing
    if own is None or own not in CHECKPOINTING or c.measured_peak is None:
        return False
    lighter = [o.measured_peak for o in compiled if o.measured_peak is not None
               and replace(o.layout, activation_checkpointing=own, units=c.layout.units) == c.layout
               and o.layout != c.layout and _lighter(o.layout.activation_checkpointing, own)]
    return bool(lighter) and c.measured_peak >= 0.99 * min(lighter)


def _lighter(policy: str | None, than: str) -> bool:
    """Whether the checkpointing ``policy`` (None: none) keeps more than ``than`` (one of ``CHECKPOINTING``): no
    policy, or one earlier in ``CHECKPOINTING``."""
    return policy is None or (policy in CHECKPOINTING and CHECKPOINTING.index(policy) < CHECKPOINTING.index(than))


# False: every candidate whose estimate is below the fastest compiled one is compiled (the sound search);
# True: the estimates scaled by the nearest compiled kin's ratio first (see the module doc)
SHARPEN = True
# what the search leaves out: a layout or candidate whose bound or estimate is within this fraction of the
# fastest compiled fitting one (0: none; the pick then is within that fraction of the search's own best)
TOLERANCE = 0.0
# the search's wall-clock budget in seconds (None: none): once spent and ``k`` compiled candidates fit, nothing
# more is traced or compiled; the layouts left untraced and the candidates left uncompiled are reported as such
# (``searched``'s ``stats["stopped"]``, the skipped layouts' reasons), never silently dropped
SEARCH_SECONDS: float | None = None


def searched(layouts: list, bound: Callable, trace: Callable, k: int, budget: int, compiled: Callable,
             variants: Callable, *, progress: Callable | None = None, bound_compute: Callable | None = None,
             stats: dict | None = None, clock: Callable[[], float] = time.perf_counter
             ) -> tuple[list[Candidate], list]:
    """Best-first search over ``layouts`` (see the module doc): ``bound(layout) -> seconds`` (a lower bound on
    its compiled predicted time and its variants'), ``trace(layout) -> [candidates]`` (its estimate and, over
    the budget, its variants that fit: ``_fitting``), ``compiled`` and ``variants`` as ``checked``'s.
    ``bound_compute(layout) -> seconds``: the compute part of ``bound`` (with ``SHARPEN``, scaled by the
    nearest compiled kin's ratio of its compiled compute to that part; None: the bounds are not scaled).
    ``stats``: a dict given the counts traced, compiled and left uncompiled, ``"stopped"`` (``"bound"``: nothing
    left could beat the pick; ``"time"``: ``SEARCH_SECONDS`` of ``clock()`` spent first) and ``"log"``, one
    ``(action, layout name, seconds, outcome)`` per trace and compile. Returned: the candidates as ``checked``
    returns them, and the layouts never traced, with their bound (no faster than the pick unless the time ran
    out)."""
    todo = sorted(layouts, key=bound)
    done: list = []
    rest: list = []
    seen: set = set()
    ratios: list = []  # (layout, compiled compute / estimated compute) of each compiled candidate
    bratios: list = []  # (layout, compiled compute / its bound's compute part)
    excesses: list = []  # (layout, compiled peak - its memory lower bound) of each compiled candidate
    estimated: list = []  # the candidates left uncompiled as over the budget by their kin's excess (over_by_kin)

    def est_of(c: Candidate) -> float:
        return sharpened(c, ratios) if SHARPEN else c.predicted_s

    def bound_of(lay: Any) -> float:
        b = bound(lay)
        if not (SHARPEN and bratios and bound_compute is not None and math.isfinite(b)):
            return b
        r = _nearest(lay, bratios)
        return b if r is None else b + (max(r, 1.0) - 1.0) * bound_compute(lay)

    i = traced_n = 0
    t0 = clock()
    log: list = []  # (action, layout name, seconds, outcome) of each trace and compile
    hurried: list = []  # (candidate, why) whose lighter heavier policies were skipped, the time spent
    stopped = "bound"
    while True:
        fit = [c.predicted_s for c in done if c.fits]
        best = min(fit, default=math.inf) * (1.0 - TOLERANCE)
        nxt = bound_of(todo[i]) if i < len(todo) else math.inf
        est = est_of(rest[0]) if rest and rest[0].fits else math.inf
        if (len(fit) >= k and min(nxt, est) >= best) or (nxt == math.inf and est == math.inf and i >= len(todo)):
            break
        if SEARCH_SECONDS is not None and len(fit) >= k and clock() - t0 >= SEARCH_SECONDS:
            stopped = "time"
            break
        t1 = clock()
        # the first of each kin compiled early (no ratio of its dtype and tp cut yet): its ratio scales the rest
        first = SHARPEN and est < math.inf and (not done or (
            rest[0].layout.pp == 1 and _nearest(rest[0].layout, ratios) is None))
        # the time spent and none fits: a heaviest-policy candidate compiled first, nothing more traced
        hurry = SEARCH_SECONDS is not None and not fit and clock() - t0 >= SEARCH_SECONDS and est < math.inf
        full = next((j for j, r in enumerate(rest) if r.fits and r.layout.activation_checkpointing ==
                     CHECKPOINTING[-1]), None) if hurry else None
        if full is not None:
            rest.insert(0, rest.pop(full))
        if i < len(todo) and nxt < est and not first and not hurry:  # the next layout could beat every estimate
            new = [c for c in trace(todo[i]) if c.layout not in seen]
            log.append(("trace", todo[i].name, clock() - t1, f"{len(new)} candidate(s)"))
            i += 1
            traced_n += 1
        else:  # the best estimate is below every untraced bound: compile it
            c = rest.pop(0)
            over = over_by_kin(c, excesses, budget) if SHARPEN else None
            if over is not None:  # its kin's excess puts it over the budget: its variants instead, not compiled
                c = replace(c, fits=False, memory={**c.memory, "peak": over, "estimated": True})
                estimated.append(c)
                log.append(("over by kin", c.name, clock() - t1, f"~{over / 2**30:.1f} GiB, not compiled"))
                new = [v for v in variants(c, budget) if v.fits and v.layout not in seen]
                seen |= {v.layout for v in new}
                rest = sorted(rest + new, key=lambda c: (not c.fits, est_of(c)))
                continue
            if progress is not None:
                progress(c)
            before, floor = c.compute_s, c.memory["peak"]
            c = compiled(c)
            log.append(("compile", c.name, clock() - t1, f"{1e3 * c.predicted_s:.1f} ms, peak "
                        f"{(c.measured_peak or 0) / 2**30:.1f} GiB, {'fits' if c.fits else 'over'}"))
            done.append(c)
            if c.measured_peak is not None and c.layout.pp == 1:
                excesses.append((c.layout, c.measured_peak - floor))
            if c.layout.pp == 1 and before > 0 and math.isfinite(before) and math.isfinite(c.compute_s):
                ratios.append((c.layout, c.compute_s / before))
                if bound_compute is not None and bound_compute(c.layout) > 0:
                    bratios.append((c.layout, c.compute_s / bound_compute(c.layout)))
                    todo[i:] = sorted(todo[i:], key=bound_of)  # the scaled bounds in their new order
            heaviest = replace(c.layout, activation_checkpointing=CHECKPOINTING[-1]) if c.layout.units and (
                c.layout.pp == 1) else c.layout
            if (not c.fits and SEARCH_SECONDS is not None and clock() - t0 >= SEARCH_SECONDS and not fit
                    and c.layout != heaviest):
                # the time spent and none fits: straight to its heaviest policy, the lighter ones not weighed (said)
                new = [v for v in trace(heaviest) if v.fits and v.layout not in seen]
                hurried.append((c.name, f"over once compiled after the search's time budget ({SEARCH_SECONDS} s) was "
                                f"spent with no candidate fitting: {heaviest.name} traced next, the policies between "
                                "its own and that one not weighed"))
            else:
                new = [] if c.fits else [v for v in variants(c, budget) if v.fits and v.layout not in seen]
                if SHARPEN and not c.fits and stalled(c, done[:-1]):  # its policy lowered nothing: none heavier will
                    new = [v for v in new if v.layout.activation_checkpointing == c.layout.activation_checkpointing]
        seen |= {c.layout for c in new}
        rest = sorted(rest + new, key=lambda c: (not c.fits, est_of(c)))
    pick = min((c for c in done if c.fits), key=lambda c: c.predicted_s, default=None)
    # what was left, and why: each uncompiled candidate's time is its bound (the traced step's: _priced.step_floor)
    left = [_left(lay.name, bound(lay), bound_of(lay), pick, stopped, "not traced") for lay in todo[i:]]
    cut = [_left(c.name, c.predicted_s, est_of(c), pick, stopped, "not compiled") for c in rest if c.fits]
    if stats is not None:
        counts = {k: sum(w[1] == k for w in left + cut) for k in ("bound", "time", "estimate")}
        log.append(("end", f"stopped by {stopped}", clock() - t0, f"{len(done)} compiled, {counts['bound']} pruned by "
                    f"bound, {counts['time']} left by time, {counts['estimate']} skipped by estimate"))
        stats.update(traced=traced_n, compiled=len(done), uncompiled=len(rest), untraced=len(todo) - i,
                     over_by_kin=len(estimated), stopped=stopped, seconds=clock() - t0, log=log, hurried=hurried,
                     pruned_by_bound=counts["bound"], left_by_time=counts["time"],
                     skipped_by_estimate=counts["estimate"], left=[(n, why) for n, _, why in left],
                     not_compiled=[(n, why) for n, _, why in cut])
    rest += estimated
    if SHARPEN and ratios:  # the uncompiled ones at their scaled estimates (none faster than the pick)
        rest = [replace(c, predicted_s=est_of(c), compute_s=c.compute_s + est_of(c) - c.predicted_s) for c in rest]
    return _merged(_ranked(done), _ranked(rest)), [(lay, bound_of(lay)) for lay in todo[i:]]


def _left(name: str, bound_s: float, est_s: float, pick: Candidate | None, stopped: str, what: str
          ) -> tuple[str, str, str]:
    """``(name, kind, reason)`` of a layout left untraced or a candidate left uncompiled by ``searched``: kind
    ``"bound"`` where its lower bound ``bound_s`` is at least ``pick``'s compiled time (proven no faster),
    ``"time"`` where the search's time ran out first, ``"estimate"`` where its estimate ``est_s`` (scaled as its
    nearest compiled kin's compute was: ``SHARPEN``, not a bound) is no faster than the pick but its bound is
    below the pick's time, or (``TOLERANCE``) its bound within that fraction of it."""
    ms = lambda x: f"{1e3 * x:.2f} ms"  # noqa: E731
    if pick is None:
        return name, "time", f"{what}: the search stopped before any compiled candidate fit (bound {ms(bound_s)})"
    if bound_s >= pick.predicted_s:
        return name, "bound", f"{what}: bound {ms(bound_s)} >= the pick's {ms(pick.predicted_s)} ({pick.name})"
    if stopped == "time":
        return name, "time", (f"{what}: the search's time budget ({SEARCH_SECONDS} s) was spent first; bound "
                              f"{ms(bound_s)} < the pick's {ms(pick.predicted_s)} ({pick.name}), so it might be faster")
    if not SHARPEN or est_s < pick.predicted_s:  # left by TOLERANCE alone
        return name, "estimate", (f"{what}: bound {ms(bound_s)} within _budget.TOLERANCE ({TOLERANCE:.0%}) of the "
                                  f"pick's {ms(pick.predicted_s)} ({pick.name}), so not proven slower")
    return name, "estimate", (f"{what}: estimated {ms(est_s)} (its compute scaled as its nearest compiled kin's: "
                              f"_budget.SHARPEN, not a bound) >= the pick's {ms(pick.predicted_s)} ({pick.name}); "
                              f"bound {ms(bound_s)}, so not proven slower")
