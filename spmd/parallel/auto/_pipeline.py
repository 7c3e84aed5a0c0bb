"""``auto_layout``'s pipeline candidates (``Layout(pp > 1)``): their cost from the schedule's tick table.

The step is built through the contract (``apply_layout``: ``pipeline(fully_shard(parallelize_module(...)))``)
and asked for its own table (``step.communication``, equal to the compiled HLO); nothing is compiled.

- **communication**: the activations' and their gradients' ``collective-permute`` s and the tensor-parallel
  terms of the rank that runs the most (``activations``); the stage and rest gradients' all-reduce and,
  under FSDP, the stages' one all-gather and reduce-scatter per buffer (``parameters``).
- **time**: the schedule replayed in lockstep (``Schedule.timed(t_F, t_B)``, each tick as long as its
  slowest rank, as this SPMD program runs; where the devices share a host's cores, ``Calibration
  .alone_speedup`` > 1, a tick's busy ranks run faster by up to that while others idle, and the tick lasts at
  least its work spread over every rank: ``_replayed``): ``t_F`` a chunk's forward on one micro-batch (a third of the
  one-device step's cost on it, times the chunk's share of the model: its units over all units, times the
  units' share of the parameters; the tensor-parallel units' work over ``tp``), ``t_B = 3 t_F`` (the
  backward recomputes the chunk's forward from the stashed input); plus the code before and after the units
  (embeddings, head, loss) once per micro-batch on the end ranks (4/3 of its step share: recomputed once;
  over ``min(alone_speedup, pp)`` on a shared host, the other ranks' cores its own),
  the optimizer's update of the rank's shards (``optimizer_compute_s``); each backward tick's passes over the
  rank's stacked stage gradient (gathered over fsdp; ``stage_passes``, counted from the step's code,
  ``pipelining._step``: the accumulator carried into the tick's ``lax.switch`` and out of it, its operand and
  its result, 2 passes of the stage, and ``add_chunk``'s slice read, the chunk's gradient read and their sum
  written, 3 passes of a chunk, ``1 / stages_per_rank`` of the stage), each pass priced at the optimizer
  update's seconds per pass over the same bytes: its update of the stage timed on every device at once
  (``stage_shapes``) over the passes its compiled program makes over the parameters (its bytes accessed over
  the parameter bytes: 10 for AdamW); each collective kind's count times its calibrated cost curve at their
  mean size, and the dispatch.
- **memory**: a lower bound, the state (arguments and outputs), the batch slice and the stash (the schedule's
  ``activation_slots + gradient_slots`` and the two scratch slots, ``spmd.parallel.pipelining._memory``);
  the peak is the compiled step's (``spmd.parallel.auto._compiled``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd.parallel.cost._comm import KINDS
from spmd.parallel.auto._cpep import cp_work, uncut
from spmd.parallel.auto._layout import Layout, factorizations, tp_plan_for
from spmd.parallel.auto._priced import HardwareRates, mesh_group
from spmd.parallel.auto._units import count_units, units_alike
from spmd.parallel.cost._memory import _nbytes
from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.pipelining._comm import STAGES
from spmd.parallel.pipelining._tp import ep_placements

__all__ = ["pipeline_cost", "pipeline_layouts", "scanned_stack", "stage_shapes", "stage_passes", "PERMUTE"]

PERMUTE = "collective-permute"


def stage_passes(stages_per_rank: int) -> float:
    """A backward tick's passes over the rank's stacked stage gradient (see the module doc): 2 (the accumulator
    into and out of the tick's branch) + 3 of the chunk it adds to (``1 / stages_per_rank`` of the stage)."""
    return 2 + 3 / stages_per_rank


def scanned_stack(model: Any, params: Any, example_inputs: tuple) -> tuple[str, int] | None:
    """``(its module path, dotted; its layer count)`` of the model's one scanned stack (``nn.scan``, or
    ``nnx.vmap`` + ``nnx.scan``), found by one abstract call on ``example_inputs`` as ``pipeline`` finds it;
    None for a model with none, several, or that this call cannot run (a linen model holding batch
    statistics: a pipeline refuses it by name)."""
    from spmd.parallel.pipelining._calls import model_kind
    from spmd.parallel.styles._transforms import stacked_of

    if model_kind(model) not in ("linen", "nnx") or not example_inputs:
        return None
    try:
        stacked = stacked_of(model, params, example_inputs) or {}
    except Exception:  # noqa: BLE001 (flax's errors for other collections: no pipeline of a stack offered)
        return None
    shapes = {path_str(kp): np.shape(x) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    stacks = {m: shapes[p][axis] for p, (m, axis) in stacked.items()}
    if len(stacks) != 1:
        return None
    ((stack, layers),) = stacks.items()
    return stack.replace("/", "."), int(layers)


def pipeline_layouts(n: int, plan: Any, units: tuple[str, ...], params: Any, rows: int,
                     layers: int | None = None) -> list[Layout]:
    """The pipelined layouts ``auto_layout`` weighs on ``n`` devices for a global batch of ``rows``: ``pp``
    over the divisors of ``n`` up to the units' count, the rest of the devices over ``dp`` x ``fsdp`` x
    ``tp`` (``tp`` with a plan, without sequence parallelism); 1F1B at ``M`` = pp, 2 pp and 4 pp micro-batches
    (those the replica's rows divide), and the interleaved schedule (2 chunks per rank) at the largest of them
    where the units allow 2 pp stages. None unless the units are one glob (the pipeline's stages) of modules
    holding the same parameters (``units_alike``: ``pipeline`` refuses others).
    ``layers``: the layer count of the scanned stack ``units`` names (``scanned_stack``): its layers are the
    units, and the stages equal slices of them (``pp`` and ``2 pp`` for the interleaved schedule dividing it)."""
    if len(units) != 1 or (layers is None and not units_alike(params, units[0])):  # refused by pipeline
        return []
    n_units = count_units(params, units[0]) if layers is None else layers
    out = []
    for pp in range(2, min(n, n_units) + 1):
        if n % pp or (layers is not None and layers % pp):
            continue
        for dp, fsdp, tp in factorizations(n // pp):
            tp_plan = tp_plan_for(plan, False, tp) if tp > 1 else None
            if tp > 1 and tp_plan is None:
                continue
            per = rows // (dp * fsdp) if rows % (dp * fsdp) == 0 else 0
            ms = [m for m in (pp, 2 * pp, 4 * pp) if per and per % m == 0]
            base = dict(pp=pp, dp=dp, fsdp=fsdp, tp=tp, tp_plan=tp_plan, units=units, reshard_after_forward=fsdp == 1)
            out += [Layout(**base, microbatches=m) for m in ms]
            if ms and n_units >= 2 * pp and (layers is None or layers % (2 * pp) == 0):
                out.append(Layout(**base, microbatches=ms[-1], schedule="interleaved", stages_per_rank=2))
    return out


def stage_shapes(laid, params: Any, plan) -> list:
    """The rank's stacked stage parameters as its chunks compute on them (shape structs): the stored shards,
    gathered over fsdp."""
    lay = laid.layout(params)
    out = []
    for e in plan.entries:
        if e.path.startswith(STAGES + "/"):
            shape = list(e.local_shape)
            d = lay.fsdp_dim(e.path[len(STAGES) + 1:])
            if d is not None:
                shape[d] *= lay.n_fsdp
            out.append(jax.ShapeDtypeStruct(tuple(shape), e.dtype))
    return out


def _share(lay) -> float:
    """The units' share of the model's parameter bytes (their share of its matmul work, for a model whose
    matmul kernels hold its parameters)."""
    units = sum(int(np.prod(lay.shapes[p].shape)) * lay.shapes[p].dtype.itemsize for p in lay.unit_of)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in lay.shapes.values())
    return units / total if total else 1.0


def _replayed(schedule, t_f: float, t_b: float, alone: float) -> float:
    """Seconds of ``schedule``'s ticks with a forward lasting ``t_f`` and a backward ``t_b`` (all devices busy):
    each tick its busiest rank's work over ``alone`` (``Calibration.alone_speedup``: the cores of the idle
    devices go to the busy ones), and at least the tick's work over every rank; ``alone=1`` (devices that
    share nothing) is the lockstep replay, ``Schedule.timed``'s ``lockstep_s``."""
    dur = {"F": t_f, "B": t_b}
    total = 0.0
    for row in schedule.ticks:
        work = [sum(dur[a.kind] for a in acts) for acts in row]
        total += max(max(work) / alone, sum(work) / schedule.pp)
    return total


def pipeline_cost(laid, params: Any, state, step, batch: Any, layout, profile, cal, anchor: float,
                  optimizer_s: float, stage_s: float, table: dict | None = None) -> dict:
    """The terms of a pipelined candidate (see the module doc): ``compute_s``, ``comm_s``, ``communication``
    (``{"parameters", "activations", "total"}: {kind: {count, bytes}}``), ``memory``, ``flops``. ``table``: the
    step's own (``step.communication``), where already read. Under cp its terms (``c["cp"]``) and under ep the
    experts' all-to-alls are in ``total`` and priced over their own dim; a micro-batch's sequence is cut over cp,
    its attention's ``[T, T]`` work counted at ``T^2 / cp`` (``_cpep.cp_work``: each rank's queries against all keys)."""
    c = table if table is not None else step.communication(state, batch)
    s = laid.schedule
    lay = laid.layout(params)
    n_data = layout.dp * layout.fsdp * layout.ep  # ep's ranks take their own rows
    rows = jax.tree.leaves(batch)[0].shape[0] // n_data
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows // (layout.accum_steps * s.num_microbatches),
                                                      *((x.shape[1] // layout.cp,) if x.ndim >= 2 else ()),
                                                      *x.shape[2:]), x.dtype), batch)
    flops, nbytes = profile.grad_cost(mb)
    calls = (c.get("cp") or {}).get("calls")
    if layout.cp > 1 and calls:  # the stages' attention (K/V gathered): T^2 / cp, not (T / cp)^2
        flops, nbytes = cp_work((flops, nbytes), profile.grad_cost(uncut(mb, layout.cp)), layout.cp, calls)
    ops = profile.ops(mb)
    of, ob = profile.optimizer_cost()
    u = _share(lay)
    chunk = u * lay.per_slot / len(lay.units) / layout.tp  # a chunk's share of the one-device step (a scanned
    # stack: its layers are the units)
    t_f = cal.compute_s(flops, nbytes, ops) * chunk / 3
    ends = cal.compute_s(flops, nbytes, ops) * (1 - u) * 4 / 3
    share = state.plan.bytes_per_device / max(profile.param_bytes, 1)
    per_step = _replayed(s, t_f, 3 * t_f, cal.alone_speedup) + s.num_microbatches * ends / min(cal.alone_speedup,
                                                                                               layout.pp)
    # each backward tick passes over the rank's stacked stage gradient stage_passes times, a pass priced at the
    # optimizer's update of those bytes (stage_s, timed on every device at once) over its own passes over them
    ticks_b = layout.accum_steps * s.num_microbatches * s.stages_per_rank
    # stage_coef: seconds per second of stage_s (the compute is affine in optimizer_s and stage_s: auto_layout
    # times those only for the candidates that can rank, _auto._refined)
    stage_coef = ticks_b * stage_passes(s.stages_per_rank) * profile.param_bytes / max(ob, 1.0)
    compute = layout.accum_steps * per_step * anchor + optimizer_s + stage_coef * stage_s

    tp = c.get("tp")
    none = {k: {"count": 0, "bytes": 0} for k in KINDS}
    program = tp["program"] if tp else none  # what the compiled program holds (= its HLO): the table
    busiest = max(tp["per_rank"], key=lambda t: sum(v["bytes"] for v in t.values())) if tp else none  # the time
    cp = c[PERMUTE]
    ctx = (c.get("cp") or {}).get("program") or {k: {"count": 0, "bytes": 0} for k in KINDS}  # cp's terms
    ar = c["all-reduce"]["bytes"] - program["all-reduce"]["bytes"] - ctx["all-reduce"]["bytes"]  # the rest's
    # gradients and the uncut stages'
    # counts in buffers, as the other candidates' tables count them (XLA combines them into a few ops)
    stage_leaves = [e.path[len(STAGES) + 1:] for e in state.plan.entries if e.path.startswith(STAGES + "/")]
    experts = set(ep_placements(laid, lay)) if layout.ep > 1 else set()  # a rank's own experts: not over ep

    def others(rel: str) -> int:  # the data ranks a stage gradient is averaged over (not its fsdp / ep cut)
        return n_data // ((layout.fsdp if lay.fsdp_dim(rel) is not None else 1) * (layout.ep if rel in experts else 1))

    ar_buffers = (len(state.plan.entries) - len(stage_leaves)) + sum(  # the rest's: summed over pp at least
        others(rel) > 1 for rel in stage_leaves)
    params = {"all-reduce": {"count": ar_buffers if ar else 0, "bytes": ar},
              **{k: {"count": c[k]["buffers"] - ctx[k]["count"], "bytes": c[k]["bytes"] - program[k]["bytes"]
                     - ctx[k]["bytes"]} for k in ("all-gather", "reduce-scatter")}, PERMUTE: {"count": 0, "bytes": 0}}
    acts = {**{k: dict(program[k]) for k in KINDS}, PERMUTE: {"count": cp["count"], "bytes": cp["bytes"]}}
    a2a = c.get("all-to-all") or {"count": 0, "bytes": 0}  # the experts' over ep, as the program holds them
    total = {k: {f: params[k][f] + acts[k][f] + (ctx[k][f] if k in ctx else 0) for f in ("count", "bytes")}
             for k in (*KINDS, PERMUTE)}
    if a2a["count"]:
        total["all-to-all"] = {"count": a2a["count"], "bytes": a2a["bytes"]}
    # (group, stride) of each kind's mesh dims in the row-major pp x dp x fsdp x tp order (a Hardware's
    # links follow the stride; a Calibration has no topology)
    at = lambda *names: mesh_group(layout.mesh_dims, names)  # noqa: E731
    groups = {"all-reduce": at("dp", "fsdp", "ep") if n_data > 1 else at("pp"), "all-gather": at("fsdp"),
              "reduce-scatter": at("fsdp")}
    comm_s: dict = {}
    for kind, v in params.items():
        if kind != PERMUTE:
            comm_s[kind] = cal.collective_s(kind, v["bytes"], v["count"], *groups[kind])
    for kind in KINDS:
        comm_s[kind] += cal.collective_s(kind, busiest[kind]["bytes"], busiest[kind]["count"], *at("tp"))
    # point to point: the calibrated bytes / bandwidth as measured (no ring factor); on a Hardware the link
    # between the stages (pp's group and stride). The sends that run (the loop form's program counts each tick's
    # switch branches, bubble ticks too: ``_comm.loop_sends``) and the rings'
    runs = {f: cp["sent"][f] + cp["ring"][f] for f in ("count", "bytes")}
    comm_s[PERMUTE] = cal.collective_s(PERMUTE, runs["bytes"], runs["count"],
                                       *(at("pp") if isinstance(cal, HardwareRates) else (cal.group_size, 1)))
    for kind, v in ctx.items():  # cp's K/V gathers, dK/dV reduce-scatters, gradients' all-reduces: over cp
        if v["count"]:
            comm_s[kind] += cal.collective_s(kind, v["bytes"], v["count"], *at("cp"))
    if a2a["count"]:  # the experts' all-to-alls the busiest rank runs, over ep
        busy = max(c["ep"]["per_rank"], key=lambda t: t["bytes"]) if c.get("ep") else a2a
        comm_s["all-to-all"] = cal.collective_s("all-to-all", busy["bytes"], busy["count"], *at("ep"))

    local = [jax.ShapeDtypeStruct(e.local_shape, e.dtype) for e in state.plan.entries]
    p_bytes = state.plan.bytes_per_device
    opt = _nbytes(jax.eval_shape(profile.optimizer.init, local))
    act_cut = tp["activation_cut"] if tp else 1
    # the lower bound (spmd.parallel.cost._memory's): the state (donated: held once), the batch,
    # and the stash the schedule holds at once (its activation and gradient slots and two scratch slots); the
    # compiled step's memory_analysis() is the peak (spmd.parallel.auto._compiled)
    stash = (c["activation_slots"] + c["gradient_slots"] + 2) * c["activation_bytes"] // act_cut // layout.cp
    mem = {"state": p_bytes + opt, "batch": _nbytes(batch) // (n_data * layout.cp), "stash": stash}
    mem["peak"] = sum(mem.values())
    mem["params"], mem["optimizer"], mem["activations"], mem["compiled"] = p_bytes, opt, stash, False
    return {"compute_s": compute, "stage_coef": stage_coef, "comm_s": comm_s,
            "flops": layout.accum_steps * s.num_microbatches * flops * (chunk * s.stages_per_rank + (1 - u))
            + of * share, "memory": mem,
            "communication": {"parameters": params, "activations": acts, "total": total}}
