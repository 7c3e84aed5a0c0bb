"""What a pipelined step communicates, analytically (the table) and in compiled HLO (the pairs)."""

from __future__ import annotations

import re

import numpy as np

from placements import Partial, Shard
from spmd.parallel.pipelining._tables import ROLES
from spmd.parallel.pipelining._tp import ep_placements, tp_placements

__all__ = ["STAGES", "REST", "pipeline_communication", "format_pipeline_communication", "hlo_permute_pairs",
           "tp_terms", "loop_sends"]

STAGES, REST = "stages", "rest"  # the stored tree: the stacked unit parameters, the others by path


def pipeline_communication(pm, lay, accum_steps: int, tp_records: dict | None = None, ticks=None,
                           cp_records: dict | None = None) -> dict:
    """What one step communicates per device, in ``spmd.parallel.hlo_executed_collectives``' terms (scalars
    aside): one ``collective-permute`` per tick with sends each way (the loop form: one per distinct pair set of
    the direction, every tick, ``loop_sends``; what runs: ``ops`` and ``sent``), moving one micro-batch's activation
    (``B / (M x data) x T x D`` elements) over each of ``pairs`` stage boundaries (``M x (stages - 1)`` each way per
    pipeline); one all-reduce of the stage gradients over the data dims and one of the other gradients over
    pp and the data dims (each device's bytes: its tp block of a tp-cut one). Plus the schedule's bubble and
    activation slots. ``tp_records`` / ``ticks`` (a tensor-parallel model): the styled calls by segment and the
    tick table's ``(forward, backward)`` branch codes per rank, for the tp terms (``tp_terms``)."""
    s = pm.schedule
    act = lay.act
    n_data = int(np.prod([pm.mesh.size(d) for d in pm.data_dims])) if pm.data_dims else 1
    ops = {k: sum(1 for p in s.sends(k) if p) * accum_steps for k in ("F", "B")}  # the sends that run
    held = ops if pm.unroll else loop_sends(s, accum_steps)  # the program's, as the HLO counter counts them
    pairs = {k: v * accum_steps for k, v in s.transfers().items()}

    def nbytes(x):
        return int(np.prod(x.shape)) * x.dtype.itemsize

    n_cp = pm.mesh.size(pm.cp) if pm.cp else 1
    shadow = bool((cp_records or {}).get("shadow"))
    tp = tp_terms(pm, lay, tp_records, ticks, accum_steps, shadow, n_cp) if tp_records is not None and pm.tp else None
    ep = ep_terms(pm, lay, tp_records["ep"], ticks, accum_steps) if tp_records is not None and pm.ep else None
    ab = nbytes(act)
    sent = ab // (tp["activation_cut"] if tp else 1)  # a sequence-parallel activation crosses cut over tp
    sent //= pm.mesh.size(pm.cp) if pm.cp else 1  # and cut over cp on its sequence
    local = {e.path: e.local_nbytes for e in lay.plan.entries}  # a device's block (tp-cut: its tp block)
    cut = [rel for rel in lay.rel if lay.fsdp_dim(rel) is not None]
    experts = set(ep_placements(pm, lay))  # a rank's own experts: reduced over the data dims but ep
    n_ep = pm.mesh.size(pm.ep.ep.mesh_dim) if pm.ep else 1
    gathered = sum(local[f"{STAGES}/{rel}"] for rel in cut) * (lay.n_fsdp or 1)  # a rank's stages, full over fsdp
    rest_bytes = sum(local[f"{REST}/{p}"] for p in lay.rest)
    # a position table's gradient: reduced on each device's rows (1 / n_cp of it)
    rest_bytes -= sum(local[f"{REST}/{p}"] - local[f"{REST}/{p}"] // n_cp
                      for p in (cp_records or {}).get("positional", ()))
    ar, ar_n = rest_bytes, len(lay.rest)
    for rel in lay.rel:  # each stage gradient averaged over the data dims it is whole on (fsdp: its shard)
        others = n_data // ((lay.n_fsdp if rel in cut else 1) * (n_ep if rel in experts else 1))
        ar += local[f"{STAGES}/{rel}"] if others > 1 else 0
        ar_n += others > 1
    add = tp["program"] if tp else {k: {"count": 0, "bytes": 0} for k in ("all-reduce", "all-gather", "reduce-scatter")}
    cp = cp_terms(pm, lay, cp_records, ticks, accum_steps) if cp_records is not None else None
    if cp is not None:
        add = _sum(add, cp["program"])
    a2a = ep["program"] if ep else {"count": 0, "bytes": 0}
    ring = cp["permutes"] if cp else {"count": 0, "bytes": 0}  # the stages' rings (cp_terms)
    return {
        "collective-permute": {"count": held["F"] + held["B"] + ring["count"],
                               "bytes": (held["F"] + held["B"]) * sent + ring["bytes"],
                               "pairs": pairs, "ops": {"forward": ops["F"], "backward": ops["B"]},
                               "sent": {"count": ops["F"] + ops["B"], "bytes": (ops["F"] + ops["B"]) * sent},
                               "ring": dict(ring)},
        # buffers: one per gradient each reduction holds (pp's of the rest, the data dims', cp's)
        "all-reduce": {"bytes": ar + add["all-reduce"]["bytes"], "buffers": ar_n + add["all-reduce"]["count"]},
        "all-gather": {"bytes": gathered + add["all-gather"]["bytes"],
                       "buffers": len(cut) + (cp["program"]["all-gather"]["count"] if cp else 0)},
        "reduce-scatter": {"bytes": gathered + add["reduce-scatter"]["bytes"],
                           "buffers": len(cut) + (cp["program"]["reduce-scatter"]["count"] if cp else 0)},
        "all-to-all": dict(a2a),
        "tp": tp, "ep": ep, "cp": cp,
        "schedule": s.name, "pp": s.pp, "num_microbatches": s.num_microbatches, "stages_per_rank": s.stages_per_rank,
        "activation_shape": tuple(act.shape), "activation_bytes": ab, "bubble": s.bubble, "bubble_formula": s.formula,
        "activation_slots": max(s.x_slots), "gradient_slots": max(s.g_slots),
        "activation_bound_bytes": (max(s.x_slots) + max(s.g_slots)) * ab,
    }


def loop_sends(s, accum_steps: int) -> dict:
    """The pipeline's collective-permutes the loop form (``unroll=False``, ``_step._ticks_looped``) holds per step,
    each way (``"F"``, ``"B"``), as ``spmd.parallel.hlo_executed_collectives`` counts them: a tick's send is a
    ``lax.switch`` over the direction's distinct pair sets (a send's pairs are static) and nothing, and the counter
    counts every branch of a conditional and each trip of the loop, so each distinct set once per tick. What runs is
    one send at each tick that sends (the table's ``ops``, ``sent``); a bubble tick's branch sends nothing."""
    ticks = len(s.sends("F"))
    return {k: len({tuple(p) for p in s.sends(k) if p}) * ticks * accum_steps for k in ("F", "B")}


_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def _sum(*tables, scale: int = 1) -> dict:
    return {k: {f: scale * sum(t[k][f] for t in tables) for f in ("count", "bytes")} for k in _KINDS}


_F_RING, _B_RING = {1, 2}, set(range(1 + len(ROLES), 1 + 2 * len(ROLES)))  # the codes whose branch runs a ring


def shaded_switches(pm, ticks, shadow: bool) -> tuple[list, list]:
    """``(switches, ran)``: the branch codes each switch of the compiled program holds (a tick's forward switch and
    its backward switch; the loop form: one of each over every tick), and per tick each rank's ``(forward,
    backward)`` codes as it runs them. With ``shadow`` (a ring in the units, ``spmd.parallel.pipelining._cp``),
    in a switch holding a branch that runs a ring (a forward of the first or a middle stage, any backward), the
    branches that run none (idle, the last stage's forward) are a middle stage's (code 1 forward, 5 backward): each
    such branch of the switch is one more body (two of them: two bodies)."""
    def shade(codes: set, ring: set, mid: int) -> dict:
        on = shadow and bool(codes & ring)
        return {k: (mid if on and k not in ring else k) for k in codes}

    mid_f, mid_b = 1, 1 + len(ROLES)
    if pm.unroll:
        maps = [(shade({f for f, _ in codes}, _F_RING, mid_f), shade({b for _, b in codes}, _B_RING, mid_b))
                for codes in ticks]
    else:
        one = (shade({f for codes in ticks for f, _ in codes}, _F_RING, mid_f),
               shade({b for codes in ticks for _, b in codes}, _B_RING, mid_b))
        maps = [one] * len(ticks)
    switches = [list(m.values()) for pair in (maps if pm.unroll else maps[:1]) for m in pair]
    ran = [[(fm[f], bm[b]) for f, b in codes] for (fm, bm), codes in zip(maps, ticks)]
    return switches, ran


def tp_terms(pm, lay, recs: dict, ticks, accum_steps: int, shadow: bool = False, n_cp: int = 1) -> dict:
    """The tp collectives of a pipelined step, from the styled calls of one micro-batch by segment
    (``pre``: before the first unit, ``unit``: one unit, ``post``: after the last; the terms of each call as
    ``spmd.parallel.cost._comm`` writes them, forward and backward apart) and the schedule's branches:

    - a forward ``F`` runs the chunk's forward (the first stage: the pre-unit code's too); the last stage's
      ``F`` runs nothing (its forward comes with the backward);
    - a backward ``B`` recomputes the chunk's forward (the first stage: with the pre-unit code's; the last:
      with the post-unit code's) and runs its backward pass; on a stage that is not the last, the
      recomputed output feeds nothing but the unused primal: the forward collective of the chunk's last
      styled call, a reduction (``RowwiseParallel``'s ``Partial`` output) whose output a residual block adds (``x + proj(h)``), is dead
      and compiled away, where the unit's own backward drops it (``recs["dropped"]``, ``_tp.dropped_in_backward``:
      not when a later op's backward reads the sum, an mlp after the attention's ``out``); not when an expert-parallel call comes after it in the unit (an MoE block's experts
      after its tp attention: the router's backward reads the recomputed activation).

    ``program``: what the compiled program holds (each tick's forward switch and backward switch hold each
    branch some rank runs once; the loop form: every branch once, run every tick); ``per_rank``: what each
    rank runs; both per step
    (``accum_steps`` passes). ``activation_cut``: ``tp`` when the activation between units is cut over tp
    (the unit's last styled call's output is ``Shard``: sequence parallelism), else 1.

    Under cp (``n_cp``; the records traced on the whole sequence): each styled call's activations are a device's
    positions, ``1 / n_cp`` of their bytes (its parameters' gradients whole); ``shadow``: a ring in the units
    (``shaded_switches``)."""
    from spmd.parallel.cost._comm import activation_terms

    s = pm.schedule
    if n_cp > 1:
        recs = {k: ([r if r.get("whole_seq") else {**r, "in_bytes": r["in_bytes"] // n_cp,
                                                    "out_bytes": r["out_bytes"] // n_cp} for r in v]
                    if k in ("pre", "unit", "post") else v) for k, v in recs.items()}
    fwd = {k: activation_terms(recs[k], part="forward") for k in ("pre", "unit", "post")}
    bwd = {k: activation_terms(recs[k], part="backward") for k in ("pre", "unit", "post")}
    lc = lay.per_slot
    last = recs["unit"][-1] if recs["unit"] else None
    # an expert-parallel call after it (an MoE block's experts after its attention) reads that reduction: live
    later = any(r.get("after_tp", 0) >= len(recs["unit"]) for r in recs.get("ep", {}).get("unit", ()))
    # what the unit's own backward drops of its forward (``_tp.dropped_in_backward``; None: not read, with ep)
    dropped = recs.get("dropped")
    dead1 = (activation_terms([last], part="forward") if last is not None and isinstance(last["local_out"], Partial)
             and not later and (dropped is None or dropped > 0) else _sum())
    zero = _sum()

    def branch_costs(n_units: int, n_last: int) -> list:
        """Each branch's terms, a chunk holding ``n_units`` unit bodies (its last slot ``n_last``)."""
        cf, cb = _sum(fwd["unit"], scale=n_units), _sum(bwd["unit"], scale=n_units)
        dead = _sum(dead1, scale=n_last)
        live = {k: {f: cf[k][f] - dead[k][f] for f in ("count", "bytes")} for k in _KINDS}
        return [zero,  # idle, then F x roles, B x roles
                cf, _sum(fwd["pre"], cf), zero, zero,
                _sum(live, cb), _sum(fwd["pre"], live, cb, bwd["pre"]), _sum(cf, fwd["post"], bwd["post"], cb),
                _sum(fwd["pre"], cf, fwd["post"], bwd["post"], cb, bwd["pre"])]

    # a rank runs lc units per chunk; the program holds, per slot, one body per unit kind some rank's chunk has
    # there (units that differ: a switch over the kinds, spmd.parallel.pipelining._step)
    kinds = lay.kind_rows
    bodies = [len({int(k) for k in kinds[:, :, l].flat if k >= 0}) for l in range(lc)]
    # a chunk's last unit's output reduction in its backward's recompute is dead (XLA drops it), but not inside
    # the scan a scanned stack's chunk runs (every iteration's output feeds the next)
    last_dead = 0 if lay.scanned else 1
    cost, pcost = branch_costs(lc, last_dead), branch_costs(sum(bodies), bodies[-1] * last_dead)
    # a ring in the units (cp, ``shadow``): a switch holding a branch that runs one runs a middle stage's chunk in the
    # branches that run none (idle, the last stage's F), its tp calls too (spmd.parallel.pipelining._cp)
    switches, ran = shaded_switches(pm, ticks, shadow)
    scale = accum_steps if pm.unroll else accum_steps * len(ticks)
    program = _sum(*[pcost[k] for sw in switches for k in sw], scale=scale)
    per_rank = [_sum(*[cost[k] for t in ran for k in t[r]], scale=accum_steps) for r in range(s.pp)]
    out_layout = last["out_layout"] if last is not None else None
    n_tp = pm.mesh.size(pm.tp.tp.mesh_dim)
    return {"program": program, "per_rank": per_rank, "branches": dict(zip(
        ["idle"] + [f"{d}-{r}" for d in "FB" for r in ROLES], cost)), "dead_recompute": dead1,
        "activation_cut": n_tp if isinstance(out_layout, Shard) else 1}


def cp_terms(pm, lay, recs: dict, ticks, accum_steps: int) -> dict:
    """The cp collectives of a pipelined step (the sequence cut over cp in the stages; under tp, of each device's
    tp block), from
    one unit's attention calls and the pre-unit code's embedding lookups (``_step.context_records``) and the
    schedule's branches:

    - each attention call run as the all-gather of K/V: K and V gathered forward (a ``F``, and a ``B``'s
      recompute), dK and dV reduce-scattered backward;
    - a ``B`` all-reduces over cp its chunk's stage gradients (GSPMD's partial sums over the cut sequence; the
      whole parameters, gathered over fsdp), and, on the last stage, the gradients of the parameters after the
      units (all the others but the lookups' tables); on the first stage each lookup's ids and output gradient
      are gathered over cp (GSPMD's transpose of the lookup, in place of an all-reduce of its table's gradient).

    - a ring (``recs["shadow"]``, ``spmd.parallel.pipelining._cp``): its collective-permutes in a ``F`` (the
      forward's) and a ``B`` (the recompute's and the backward's); in a switch holding a branch that runs one, the
      branches that do not (idle, the last stage's ``F``) run a middle stage's ``F`` or ``B`` on a block of their
      own, and move what it moves.

    ``program``: what the compiled program holds (each tick's switches hold each branch some rank runs, once;
    the loop form: every branch, every tick), per step; ``permutes``: its collective-permutes (the rings')."""
    from spmd.parallel.context._calls import attention_terms
    from spmd.parallel.pipelining._cp import slot_bodies

    kv = [r for r in recs["unit"] if r["method"] != "gather sequence"]
    whole = [r for r in recs["unit"] if r["method"] == "gather sequence"]
    at, at_f = attention_terms(kv), attention_terms(kv, forward_only=True)
    # the program holds, per slot, one unit body per kind some rank's chunk has there (a switch over the kinds, whose
    # rings' backward hops are their own: ``attention_terms(switched=True)``)
    bodies = slot_bodies(lay)
    lc = sum(bodies)
    at_b = [at if n == 1 else attention_terms(kv, switched=True) for n in bodies]
    zero = _sum()

    def one(kind, count, nbytes):
        t = _sum()
        t[kind] = {"count": count, "bytes": nbytes}
        return t

    def permutes(t: dict, scale: int) -> dict:  # an attention_terms' collective-permutes, as a cost's extra kind
        return {f: scale * t["collective-permute"][f] for f in ("count", "bytes")}

    def gathers(key):  # a gathered module's inputs (forward) or its outputs' cotangents (backward)
        shapes = [sd for r in whole for sd in r[key]]
        return one("all-gather", len(shapes), sum(int(np.prod(sh)) * np.dtype(d).itemsize for sh, d in shapes))

    fwd = _sum(one("all-gather", at["all-gather"]["count"], at["all-gather"]["bytes"]), gathers("gathered"), scale=lc)
    bwd = _sum(one("reduce-scatter", at["reduce-scatter"]["count"], at["reduce-scatter"]["bytes"]), gathers("cut"),
               scale=lc)
    own = {p for r in whole for p in r.get("params", ())}  # computed whole on every device of cp: not summed
    own |= set(recs.get("side", ()))  # computed on the unit's side arrays: whole over cp, their joins summed
    summed = [rel for rel in lay.rel if rel not in own]
    # under tp: each device's tp block (a stage parameter's, and one after the units)
    n_tp = pm.mesh.size(pm.tp.tp.mesh_dim) if pm.tp else 1
    tp_st, tp_rest = tp_placements(pm, lay)

    def nbytes(x, p) -> int:
        return int(np.prod(x.shape)) * x.dtype.itemsize // (n_tp if isinstance(p, Shard) else 1)

    sizes = {rel: nbytes(lay.unit_shapes[rel], tp_st.get(rel)) for rel in summed}
    joins = recs.get("joins", ())
    grads = one("all-reduce", (len(summed) + len(joins)) * lc, (sum(sizes.values()) + sum(joins)) * lc)
    tables = {r["param"] for r in recs["lookups"]} - set(recs.get("attends", ()))  # a tied head's: summed
    positional = set(recs.get("positional", ()))
    post_p = [p for p in lay.rest if p not in tables and p not in positional]
    post = one("all-reduce", len(post_p), sum(nbytes(lay.shapes[p], tp_rest.get(p)) for p in post_p))
    pre = one("all-gather", sum(len(r["bytes"]) for r in recs["lookups"]),
              sum(sum(r["bytes"]) for r in recs["lookups"]))
    b = _sum(fwd, bwd, grads)
    cost = [zero, fwd, fwd, zero, zero,  # idle, then F x roles (mid, first, last, only), B x roles
            b, _sum(b, pre), _sum(b, post), _sum(b, pre, post)]
    nop = {"count": 0, "bytes": 0}
    pf = permutes(at_f, lc)
    pb = {f: sum(n * permutes(a, 1)[f] for n, a in zip(bodies, at_b)) for f in ("count", "bytes")}
    perm = [nop, pf, pf, nop, nop, pb, pb, pb, pb]
    switches, _ = shaded_switches(pm, ticks, bool(recs.get("shadow")))
    scale = accum_steps if pm.unroll else accum_steps * len(ticks)
    program = _sum(*[cost[k] for sw in switches for k in sw], scale=scale)
    moved = {f: scale * sum(perm[k][f] for sw in switches for k in sw) for f in ("count", "bytes")}
    # a position table's gradient: cut over cp on its rows, gathered once per step (beside the update)
    program = _sum(program, one("all-gather", len(positional), sum(
        int(np.prod(lay.shapes[p].shape)) * lay.shapes[p].dtype.itemsize for p in positional)))
    return {"program": program, "permutes": moved, "calls": list(recs["unit"]), "lookups": list(recs["lookups"]),
            "positional": sorted(positional)}


def ep_terms(pm, lay, recs: dict, ticks, accum_steps: int) -> dict:
    """The all-to-alls of a pipelined step's expert-parallel calls (``ExpertParallel`` in the units), from the
    calls on the ep dim of one micro-batch by segment (``pre`` / ``unit`` / ``post``: each call's dispatch and
    combine, an all-to-all of its buffer each, forward; their transposes backward) and the schedule's
    branches: a forward ``F`` runs the chunk's forward (the first stage: the pre-unit code's too; the last
    stage's ``F`` nothing), a backward ``B`` the chunk's forward again and its backward (every all-to-all of the
    recomputation is live: the combine's output is the router weights' gradient's operand). ``program``: what
    the compiled program holds (each tick's switches hold each branch some rank runs, once; the loop form:
    every branch, every tick); ``per_rank``: what each rank runs; both per step (``accum_steps`` passes)."""
    def terms(records: list) -> dict:
        n = [b for r in records for b in (r["in"], r["out"]) if b]
        return {"count": len(n), "bytes": sum(n)}

    def add(*ts, scale: int = 1) -> dict:
        return {f: scale * sum(t[f] for t in ts) for f in ("count", "bytes")}

    pre, unit, post = terms(recs["pre"]), terms(recs["unit"]), terms(recs["post"])
    zero = add()

    def branch_costs(n_units: int) -> list:
        c = add(unit, scale=n_units)  # forward; its backward moves as much (each all-to-all's transpose)
        return [zero, c, add(pre, c), zero, zero,  # idle, then F x roles, B x roles (forward + backward each)
                add(c, c), add(pre, c, c, pre), add(c, post, post, c), add(pre, c, post, post, c, pre)]

    kinds = lay.kind_rows
    bodies = sum(len({int(k) for k in kinds[:, :, l].flat if k >= 0}) for l in range(lay.per_slot))
    cost, pcost = branch_costs(lay.per_slot), branch_costs(bodies)
    if pm.unroll:
        program = add(*[pcost[k] for codes in ticks for k in {k for pair in codes for k in pair}], scale=accum_steps)
    else:
        used = sorted({k for codes in ticks for pair in codes for k in pair})
        program = add(*[pcost[k] for k in used], scale=accum_steps * len(ticks))
    per_rank = [add(*[cost[k] for codes in ticks for k in codes[r]], scale=accum_steps) for r in range(pm.schedule.pp)]
    return {"program": program, "per_rank": per_rank, "calls": list(recs["unit"]),
            "branches": dict(zip(["idle"] + [f"{d}-{r}" for d in "FB" for r in ROLES], cost))}


def hlo_permute_pairs(text: str, n_replicas: int = 1) -> int:
    """Source-target pairs of the collective-permutes in HLO ``text``, per pipeline (``n_replicas``: data
    replicas, each its own pairs in one op); loop bodies counted once."""
    pairs = 0
    for line in text.splitlines():
        if re.search(r"collective-permute(-start)?\(", line):
            m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
            pairs += m[1].count("{") if m else 0
    return pairs // n_replicas


def format_pipeline_communication(c: dict) -> str:
    cp = c["collective-permute"]
    held = cp["count"] - cp["ring"]["count"]  # the loop form holds more than run (``loop_sends``)
    ran = "" if held == cp["sent"]["count"] else (f"; {cp['sent']['count']} of the pipeline's {held} run: the loop's "
                                                  "switches, each branch counted each tick")
    return (f"pipeline {c['schedule']} pp={c['pp']} M={c['num_microbatches']} v={c['stages_per_rank']}: "
            f"{cp['pairs']['forward']} activation + {cp['pairs']['backward']} gradient transfers of "
            f"{c['activation_shape']} per pipeline (M x (stages - 1) each way) in {cp['count']} collective-permutes "
            f"({cp['bytes']} bytes{ran}); all-reduce {c['all-reduce']['bytes']} bytes; bubble {c['bubble']:.4f} "
            f"(formula {c['bubble_formula']:.4f}); {c['activation_slots']} activation + {c['gradient_slots']} gradient "
            f"slots per rank ({c['activation_bound_bytes']} bytes)" + (
                f"; all-to-all x{c['all-to-all']['count']} = {c['all-to-all']['bytes']:,} B (experts over ep)"
                if c.get("ep") else "") + ("" if not c.get("tp") else "\n  tp in the program: " + ", ".join(
                f"{k} x{v['count']} = {v['bytes']:,} B" for k, v in c["tp"]["program"].items() if v["count"])
                + "; per rank: " + " | ".join(", ".join(f"{k} x{v['count']}" for k, v in t.items() if v["count"])
                                               for t in c["tp"]["per_rank"]))) + (
        f"\n  not counted: {c['uncounted']}" if c.get("uncounted") else "")
