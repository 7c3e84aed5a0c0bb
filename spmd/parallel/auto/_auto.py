"""Choose the layout by cost: ``auto_layout`` ranks every layout of a model on a set of devices.

Candidates: every factorization of the device count over ``dp`` x ``fsdp`` x ``tp`` (``tp`` only with a
tensor-parallel plan: ``plan=``; a cut the sizes do not allow, a head split, a batch the data dims do not
divide: rejected, with the reason), ``reshard_after_forward`` on and off under FSDP, sequence parallelism
on and off where the plan has it, the weight-stationary layout (``ws``: the sequence-parallel plan with its
cuts moved to the batch; weights never move, activations are gathered over the batch) for every ``tp``,
the pipelines (``pp`` over the divisors of the device count up to the repeated blocks, the rest over
``dp`` x ``fsdp`` x ``tp``, 1F1B at pp, 2 pp and 4 pp micro-batches and interleaved with two chunks per
rank; costed by ``spmd.parallel.auto._pipeline`` from the schedule's tick table), context parallelism (the
sequence cut over ``cp`` for a model with attention: a call the cp step recognizes, or its own einsum attention
run on the gathered sequence) and expert parallelism (the experts cut over ``ep`` for a model that has them),
cp x ep, each with the rest of the devices over ``dp`` x ``fsdp`` x ``tp``, and pipelines with cp or ep
(``spmd.parallel.auto._cpep``: their table's cp and ep terms priced over their own dim), and, where the memory
budget needs them, gradient accumulation and activation checkpointing of the blocks (every policy of
``spmd.parallel.styles._remat.POLICIES`` the model and devices allow: ``_budget.weighed_policies``; MaxText's
named ones where the model names those tensors, ``"offload"`` where the devices have a host memory of their own,
each one left out listed in ``rejected`` with the reason),
and with ``mixed_precision=`` every FSDP layout computing in that dtype too. Each is built through the
contract (``apply_layout``) and traced on abstract inputs:

- **communication**: the step's own analytic table (``step.communication``, equal to the compiled HLO);
- **memory**: a lower bound from shapes (``spmd.parallel.cost._memory.memory_floor``), used to prune; under a
  budget (and ``hardware=``) the candidates that survive it are compiled, not run, in ranked order, and the
  compiled step's ``memory_analysis()`` is their peak (``spmd.parallel.auto._compiled``; ``_budget.checked``);
- **time**: the gradients' compute (flops / the calibrated matmul rate + bytes accessed / the elementwise
  rate + operations x the per-operation cost: ``Calibration.compute_s``, ``spmd.parallel.cost._compute_cost``),
  under a measured calibration scaled by the user's own one-device gradient timed on every device at once
  over that same estimate of it (``Profile.grad_seconds``: the rates say how the layouts differ, the model's
  measured gradient how fast its kernels really run on the machine), plus the optimizer's update of the
  layout's own shards (measured: ``Profile.optimizer_seconds``; its cost is far from linear in the shard's
  size on a host), plus per collective kind ``count`` times its calibrated cost curve at their mean size
  over its group (``fsdp`` for the gathers and reduce-scatters, the replicate dims for the gradients'
  all-reduce, ``tp`` for the activations), plus the program's dispatch. Without a memory budget the update
  is timed only for the candidates that can rank in the top ``max(measure, 1)`` (those by the time without it
  first, until no other can: ``_refined``); the rest have it from its cost analysis at the calibrated rates. No overlap of communication with
  compute is assumed.

With ``hardware=`` (a ``spmd.parallel.Hardware`` or a built-in's name) no calibration is made and nothing
is timed: communication and compute are priced on that hardware's figures by the layout's topology
(``spmd.parallel.auto._priced``). The layouts are then searched best-first (``_budget.searched``): taken in the
order of a lower bound on their step time known before anything of theirs is traced (their share of the
model's matmul flops at the peak rate of their compute dtype, ``_priced.dot_flops``), traced or compiled,
whichever is cheaper-bounded, until no untraced bound and no uncompiled estimate can beat the fastest
compiled candidate that fits; a layout whose memory lower bound is over the budget is not traced (its
variants are). The layouts never traced are in ``rejected`` with their bound.

With ``measure=k`` the top ``k`` fitting candidates are then compiled and timed side by side
(``spmd.parallel.auto._measure``) and ranked first by their measured time: what the model misses on a host
(on CPU fake devices, fresh pages for buffers past the allocator's mmap threshold, threads sharing the
cores) a compiled step shows. Under a memory budget the candidates are compiled first, nothing run, until the
top ``max(measure, 1)`` fit by their ``memory_analysis()``; a candidate over the budget once compiled goes
behind the fitting ones and its checkpointing and accumulation variants join the ranking
(``spmd.parallel.auto._budget``). ``depth=``: the figures read at 3 and 4 blocks and carried to the model's
depth (``spmd.parallel.auto._compiled``). The answer (``AutoLayout``, ``Candidate``) is ``spmd.parallel.auto._ranking``.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from dataclasses import replace
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmd.parallel.auto._layout import Layout, apply_layout, devices_of, factorizations, infer_units, tp_plan_for
from spmd.parallel.auto._budget import (_fitting, weighed_policies, _measured, check_budget, check_floor, checked,
                                        parts, policy_of, searched)
from spmd.parallel.auto._compiled import carried, compile_figures, extrapolated, slice_depths
from spmd.parallel.auto._cpep import (GATHER_ONLY, check_attention, check_pipelined_attention, context_expert_layouts,
                                      cp_work, gather_only, uncut)
from spmd.parallel.auto._measure import example_inputs as _example_inputs, measure_layouts
from spmd.parallel.auto._pipeline import pipeline_cost, pipeline_layouts, scanned_stack, stage_shapes
from spmd.parallel.auto._units import count_units
from spmd.parallel.cost._calibrate import Calibration, calibrate
from spmd.parallel.cost._hardware import Hardware
from spmd.parallel.cost._comm import KINDS
from spmd.parallel.cost._compute_cost import (compute_cost, optimizer_compute_s, optimizer_flops, reference_cost,
                                         update_seconds)
from spmd.parallel.cost._memory import Profile, _nbytes, memory_floor
from spmd.parallel.auto._fused import planned_fused
from spmd.parallel.auto._arguments import check_batch_cut, check_batch_rows, check_precisions
from spmd.parallel.auto._priced import (HardwareRates, _dots, comm_floor, dot_bytes, dot_cost, matmul_dtype, mesh_group,
                                       shard_bytes, state_floor, step_floor, tp_floor, tp_traffic)
from spmd.parallel.auto._progress import _bar, measuring, now
from spmd.parallel.auto._ranking import AutoLayout, Candidate
from spmd.parallel.auto._remat_profile import remat_profile
from spmd.parallel.plan._shard import entry_sharding
from spmd.parallel.step._state import TrainState, _check_optimizer, init_train_state, state_shardings
from spmd.parallel.step._step import make_train_step
from spmd.parallel.styles._nnx import is_nnx, nnx_params
from spmd.parallel.styles._transforms import as_parallel, build_plan, out_cut_of, stacked_of

__all__ = ["Candidate", "AutoLayout", "auto_layout", "evaluate_layout", "default_loss", "abstract_state"]  # the
# first two: spmd.parallel.auto._ranking


def default_loss(model: Any) -> Callable:
    """Next-token cross-entropy of ``model.apply({"params": p}, batch["inputs"])`` against ``batch["targets"]``;
    of an nnx model (laid out or not), ``loss_fn(m, batch)`` on ``m(batch["inputs"])``, the form its step takes."""
    if is_nnx(getattr(model, "module", model)):
        def nnx_loss_fn(m, batch):
            logits = m(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        return nnx_loss_fn

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


def params_loss(model: Any, loss_fn: Callable | None) -> Callable:
    """The loss as ``f(params, batch)`` on the unwrapped model's parameters (the one-device profile's form):
    a linen model's own; an nnx model's ``loss_fn(m, batch)`` on ``m`` merged from ``params`` (an
    ``nnx.State`` of its ``nnx.Param`` values) and the model's other state."""
    loss = loss_fn if loss_fn is not None else default_loss(model)
    if not is_nnx(model):
        return loss
    from flax import nnx

    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return lambda params, batch: loss(nnx.merge(graphdef, params, rest), batch)


def abstract_state(laid: Any, params: Any, optimizer: Any, mesh, *example_inputs: Any,
                   plans: dict | None = None) -> TrainState:
    """A ``TrainState`` of shape structs laid out by ``laid``'s plan (what ``init_train_state`` would build);
    ``example_inputs``: what the model is applied to (a linen model's blocks under ``nn.scan``: their stacked
    axis, which the plan must know). ``plans``: a dict shared by the layouts of one model, where what the plan
    reads off the model is kept (``_plan``)."""
    pm = as_parallel(laid, mesh, "auto_layout")
    plan = pm.plan(params, *example_inputs) if plans is None else _plan(pm, params, example_inputs, plans)
    stored = jax.tree_util.tree_unflatten(plan.treedef, [
        jax.ShapeDtypeStruct(plan.padded_shape(e), e.dtype, sharding=entry_sharding(e, mesh)) for e in plan.entries])
    opt = jax.eval_shape(optimizer.init, stored)  # laid out as init_train_state lays them (state_shardings)
    _, opt_sh = state_shardings(plan, mesh, stored, opt, optimizer)
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh.jax_mesh, P())),
                      params=stored, opt_state=jax.tree.map(
                          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), opt, opt_sh), plan=plan)


def _plan(pm: Any, params: Any, example_inputs: tuple, plans: dict) -> Any:
    """``pm.plan(params, *example_inputs)``, with what it reads off the model traced once for every layout of
    it (kept in ``plans`` by the unwrapped model): its scanned stacks (``stacked_of``) and, under FSDP, the kernels
    cut on their output dim (``out_cut_of``): both are the unwrapped model's on ``params`` and the inputs, the
    layout aside."""
    key = (id(pm.module), jax.tree_util.tree_structure(params), tuple(
        (tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves((params, example_inputs))))
    if key not in plans:  # the model held with them: its id is not reused while they are kept
        plans[key] = (pm.module, stacked_of(pm.module, params, example_inputs), {})
    _, stacked, cuts = plans[key]
    if (fsdp := pm.fsdp is not None) not in cuts:
        cuts[fsdp] = out_cut_of(pm, params, example_inputs)
    return build_plan(pm, params, stacked, cuts[fsdp])


def abstract_inputs(laid: Any, mesh, optimizer: Any, model: Any, params: Any, batch: Any,
                    plans: dict | None = None) -> tuple:
    """``(state, batch)`` of the laid-out model as shape structs with their shardings, nothing allocated: the
    state ``init_train_state`` builds (``abstract_state``), the batch cut over the data dims
    (``spmd.parallel.auto._measure._built``)."""
    data = NamedSharding(mesh.jax_mesh, P(tuple(n for n in mesh.mesh_dim_names if n not in ("tp", "pp"))))
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    state = abstract_state(laid, structs[0], optimizer, mesh, *_example_inputs(model, structs[1]), plans=plans)
    return state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=data), structs[1])


def _refined(got: list[Candidate], k: int, pending: dict, progress: Callable) -> list[Candidate]:
    """``got`` (no budget: all fit) with each candidate's optimizer update (``pending[layout](timed)``, left out of
    its time: ``evaluate_layout(pending=)``) added, timed in the order of the times without it until ``k`` are
    complete and no incomplete one is faster than the ``k``-th: the top ``k`` are those timing every update
    would rank first (an update's seconds are >= 0), for a few of the updates' timings (each a compile and a
    run on every device). The rest have theirs from its cost analysis at the calibrated rates (not timed)."""
    def done(c: Candidate, timed: bool) -> Candidate:
        s = pending.pop(c.layout)(timed)
        return replace(c, compute_s=c.compute_s + s, predicted_s=c.predicted_s + s)

    got = sorted(got, key=lambda c: c.predicted_s)
    while True:
        i = next((j for j, c in enumerate(got) if c.layout in pending), None)
        if i is None or i >= k:  # k complete ahead of every incomplete one
            break
        progress(got[i])
        got = sorted(got[:i] + [done(got[i], True)] + got[i + 1:], key=lambda c: c.predicted_s)
    return [done(c, False) if c.layout in pending else c for c in got]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                                                       else x.dtype), tree)


def _groups(layout: Layout) -> dict:
    """Per section of the step's table and kind, ``(group, stride)``: the mesh dim(s) the collectives run
    over (``mesh_group``): the gathers and reduce-scatters over ``fsdp``, the gradients' all-reduce over the
    replicate dims (``dp`` and ``ep``, whose ranks hold the same non-expert parameters; ``fsdp`` where it is the
    only data dim), the activations' over ``tp``; the rest of the table (``_beyond``) over its own dim: the
    experts' all-to-alls over ``ep``, cp's terms over ``cp``."""
    ar = ("dp", "ep") if layout.fsdp == 1 or layout.dp > 1 or layout.ep > 1 else ("fsdp",)
    at = lambda *names: mesh_group(layout.mesh_dims, names)  # noqa: E731
    return {"parameters": {"all-gather": at("fsdp"), "reduce-scatter": at("fsdp"), "all-reduce": at(*ar)},
            "activations": {k: at("tp") for k in KINDS},
            "beyond": {k: at("ep") if layout.ep > 1 and (k == "all-to-all" or layout.cp == 1) else
                       at("cp") if layout.cp > 1 else at(*ar) for k in (*KINDS, "collective-permute", "all-to-all")}}


def _beyond(comm: dict) -> dict:
    """Per kind, what the step's table counts in its ``total`` beyond its ``parameters``, ``activations`` and
    ``recomputed`` sections (priced apart): cp's terms (the ring's permutes, the K/V gathers, their gradients'
    reductions: its ``context`` rows) and ep's (the experts' all-to-alls), which run over their own mesh dim."""
    out, own = {}, ("parameters", "activations", "recomputed")
    for kind, v in comm["total"].items():
        c = v["count"] - sum(comm.get(s, {}).get(kind, {}).get("count", 0) for s in own)
        b = v["bytes"] - sum(comm.get(s, {}).get(kind, {}).get("bytes", 0) for s in own)
        if c > 0 or b > 0:
            out[kind] = {"count": max(c, 0), "bytes": max(b, 0)}
    return out


def _rated(cal: HardwareRates, dtype: str) -> str:
    """The dtype whose matmul rate prices a mixed-precision candidate: its compute dtype where the hardware
    gives a rate for it, else the model's."""
    return dtype if dtype in cal.hardware.matmul_flops else cal.dtype


def evaluate_layout(model: Any, optimizer: Any, example_batch: Any, devices: Any, layout: Layout, *,
                    loss_fn: Callable | None = None, params: Any = None, calibration: Calibration | None = None,
                    profile: Profile | None = None, budget: int | None = None, floor_only: bool = False,
                    built: list | None = None, notes: dict | None = None, pending: dict | None = None,
                    plans: dict | None = None) -> Candidate:
    """``layout``'s predicted cost (see the module doc); raises ``ValueError`` when it cannot be built.
    ``floor_only``: its memory lower bound alone, its step not traced (``untraced``). ``built``: a list its
    traced ``(step, state, batch)`` is appended to (laid out as ``compile_figures`` compiles them: its
    ``built=`` then lowers the step traced here, not traced again). ``notes``: a dict a cp layout's step sets
    ``"gather"`` in (whether its attention all runs on the gathered sequence: ``_cpep.check_attention``).
    ``pending``: under a measured calibration, the optimizer's update is left out of the time (a lower bound)
    and ``pending[layout](timed) -> seconds`` gives it, timed or (``timed=False``) from its cost analysis
    (``_refined``). ``plans``: shared by the layouts of one model (``abstract_state``)."""
    where = "auto_layout"
    devices = devices_of(devices, where)
    batch = _abstract(example_batch)
    check_batch_cut(batch, layout, where)
    cal = calibration if calibration is not None else calibrate(devices)
    params = _params_of(model, batch, params, where)
    laid, mesh = apply_layout(model, devices, layout)
    loss = loss_fn if loss_fn is not None else default_loss(laid)
    profile = profile or Profile(params_loss(model, loss_fn), params, optimizer, step_loss=loss)
    if layout.pp > 1:
        # a scanned stack (one module here, fewer than the stages) shows its layers on the example inputs
        stack = count_units(params, layout.units[0]) < layout.pp * layout.stages_per_rank
        return _pipelined(laid, loss, optimizer, batch, params, layout, profile, cal, devices, budget,
                          _example_inputs(model, batch, layout.pp) if stack else (), pending)
    if built is None:
        state = abstract_state(laid, params, optimizer, mesh, *_example_inputs(model, batch), plans=plans)
    else:  # the state and batch as the compile takes them (their shardings), so that it finds this trace
        state, laid_batch = abstract_inputs(laid, mesh, optimizer, model, params, batch, plans)
    n_data = layout.n_data
    b = jax.tree.leaves(batch)[0].shape[0]
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(  # a device's rows, and under cp its part of the sequence
        (b // (n_data * layout.accum_steps), *((x.shape[1] // layout.cp,) if x.ndim >= 2 else ()), *x.shape[2:]),
        x.dtype), batch)
    local_bytes = _nbytes(batch) // (n_data * layout.cp)
    mem = memory_floor(profile, state.plan, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // (layout.tp if layout.weight_stationary else 1), *x.shape[1:]),
                                       x.dtype), micro), local_bytes, tp=layout.tp, policy=policy_of(layout),
        compute_dtype=layout.mixed_precision)
    if floor_only:
        return untraced(layout, mem, budget)
    step = make_train_step(laid, loss, optimizer, accum_steps=layout.accum_steps, mesh=mesh, donate=True)  # as _built
    traced_batch = batch if built is None else laid_batch
    traced = jax.make_jaxpr(step)(state, traced_batch)  # validates (batch split, head cuts), traces the styled calls
    comm = step.communication(state, traced_batch)
    rows = check_attention(comm, layout, where)
    if notes is not None and rows:
        notes.setdefault("gather", all(r["method"] == "gather sequence" for r in rows))
    if built is not None:
        built.append((step, state, laid_batch))
    pm = as_parallel(laid, mesh, where)
    # the time's estimate in hardware mode: the model's own flops, or the matmuls of the traced step (per device:
    # what it recomputes and replicates too) where more, at the peak rate (a bound below the compiled step's,
    # which replaces it once compiled: spmd.parallel.auto._compiled); calibrated: the step under the policy on
    # one device
    prof = profile if isinstance(cal, HardwareRates) else remat_profile(profile, model, layout.units,
                                                                        layout.activation_checkpointing)
    flops, nbytes, ops = compute_cost(prof, state.plan, pm, micro, accum_steps=layout.accum_steps)
    if rows:  # attention's [T, T] work: T^2 / cp (ring, K/V gathered), whole on each rank (gathered module)
        flops, nbytes = cp_work((flops, nbytes), compute_cost(prof, state.plan, pm, uncut(micro, layout.cp),
                                                              accum_steps=layout.accum_steps), layout.cp, rows)
    if isinstance(cal, HardwareRates):  # a bound until compiled: its matmuls' flops and bytes, its update's bytes
        cal = replace(cal, dtype=_rated(cal, layout.mixed_precision)) if layout.mixed_precision else cal
        work, io = _dots(traced.jaxpr)
        compute = step_floor(cal.hardware, cal.dtype, max(flops, sum(work.values())), dot_bytes(io),
                             shard_bytes(state.plan, optimizer))
    else:
        compute = cal.compute_s(flops, nbytes, ops) * _anchor(profile, batch, micro, devices, cal)
        update = lambda timed, plan=state.plan: optimizer_compute_s(profile, plan, cal, devices, timed=timed)  # noqa
        if pending is None or not cal.measured:
            compute += update(True)
        else:
            pending[layout] = update
    flops += optimizer_flops(profile, state.plan)
    groups = _groups(layout)
    comm_s: dict = {}
    rec = [(t, dict.fromkeys(t, mesh_group(layout.mesh_dims, d.split(",")))) for d, t in  # a checkpoint's
           comm.get("recomputed_dims", {}).items()]  # recomputed collectives ("full"'s tp ones): over their dims
    for table, at in [(comm[s], groups[s]) for s in ("parameters", "activations")] + rec:
        for kind, v in table.items():
            comm_s[kind] = comm_s.get(kind, 0.0) + cal.collective_s(kind, v["bytes"], v["count"], *at[kind])
    for kind, v in _beyond(comm).items():  # cp's ring / K/V gathers, ep's all-to-alls: over their own dim
        comm_s[kind] = comm_s.get(kind, 0.0) + cal.collective_s(kind, v["bytes"], v["count"],
                                                                *groups["beyond"][kind])
    total = compute + sum(comm_s.values()) + cal.dispatch_s
    return Candidate(layout=layout, predicted_s=total, compute_s=compute, comm_s=comm_s, dispatch_s=cal.dispatch_s,
                     communication={k: comm[k] for k in ("parameters", "activations", "total")}, memory=mem,
                     flops=flops, fits=budget is None or mem["peak"] <= budget)


def untraced(layout: Layout, memory: dict, budget: int | None) -> Candidate:
    """A candidate whose memory lower bound alone was computed (its step never traced: over the budget by
    that bound, it can fit under no time): no time (``predicted_s`` infinite), no communication counted."""
    zero = {k: {"count": 0, "bytes": 0} for k in KINDS}
    return Candidate(layout=layout, predicted_s=math.inf, compute_s=math.inf, comm_s={}, dispatch_s=0.0,
                     communication={"parameters": dict(zero), "activations": dict(zero), "total": dict(zero)},
                     memory=memory, flops=0.0, fits=budget is None or memory["peak"] <= budget)


def _pipelined(laid, loss, optimizer, batch, params, layout, profile, cal, devices, budget, inputs=(),
               pending=None) -> Candidate:
    """A pipelined candidate (``spmd.parallel.auto._pipeline``): the state's shapes and the step's own table;
    ``inputs``: the model's example inputs (a scanned stack's layers are found from them); ``pending``: as
    ``evaluate_layout``'s."""
    state = jax.eval_shape(lambda: init_train_state(laid, optimizer, *inputs, params=params))
    step = make_train_step(laid, loss, optimizer, accum_steps=layout.accum_steps, donate=True)
    n_data = layout.n_data
    b = jax.tree.leaves(batch)[0].shape[0]
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((b // (n_data * layout.accum_steps), *x.shape[1:]), x.dtype),
                         batch)
    anchor = _anchor(profile, batch, micro, devices, cal)
    table = step.communication(state, batch)
    check_pipelined_attention(table, layout, "auto_layout")
    lazy = pending is not None and getattr(cal, "measured", False)
    opt = lambda timed: optimizer_compute_s(profile, state.plan, cal, devices, timed=timed)  # noqa: E731
    stage = lambda timed: update_seconds(profile, stage_shapes(laid, params, state.plan), cal, devices,  # noqa
                                         timed=timed)
    t = pipeline_cost(laid, params, state, step, batch, layout, profile, cal, anchor,
                      0.0 if lazy else opt(True), 0.0 if lazy else stage(True), table=table)
    if lazy:  # the compute is affine in the two updates' seconds (pipeline_cost)
        pending[layout] = lambda timed: opt(timed) + t["stage_coef"] * stage(timed)
    total = t["compute_s"] + sum(t["comm_s"].values()) + cal.dispatch_s
    return Candidate(layout=layout, predicted_s=total, compute_s=t["compute_s"], comm_s=t["comm_s"],
                     dispatch_s=cal.dispatch_s, communication=t["communication"], memory=t["memory"],
                     flops=t["flops"], fits=budget is None or t["memory"]["peak"] <= budget)


def _anchor(profile: Profile, batch: Any, micro: Any, devices: list, cal: Calibration) -> float:
    """Measured over estimated seconds of the one-device gradient (see the module doc) on the batch split
    over every device (one measurement serves every candidate; ``micro`` where that does not divide); 1
    under a hand-built calibration."""
    if not cal.measured or len(devices) < 2:
        return 1.0
    b, n = jax.tree.leaves(batch)[0].shape[0], len(devices)
    if b % n == 0:
        micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((b // n, *x.shape[1:]), x.dtype), batch)
    est = cal.compute_s(*reference_cost(profile, micro))
    got = profile.grad_seconds(micro, devices) - cal.dispatch_s
    return got / est if est > 0 and got > 0 else 1.0


def _params_of(model: Any, batch: Any, params: Any, where: str) -> Any:
    if params is not None:
        return _abstract(params)
    if is_nnx(model):  # an nnx model holds its parameters
        return _abstract(nnx_params(model))
    if not (isinstance(batch, Mapping) and "inputs" in batch):
        raise TypeError(f"{where}: without params= the model is initialized on example_batch['inputs']; the batch "
                        f"has {list(batch) if isinstance(batch, Mapping) else type(batch).__name__}: give params= "
                        "(arrays or jax.ShapeDtypeStruct) or a batch dict with 'inputs'.")
    # the inputs an argument (not a closed-over shape struct, which jnp.asarray refuses: jax.nn.one_hot)
    return jax.eval_shape(lambda r, x: model.init(r, x)["params"], jax.random.key(0), batch["inputs"])


def _read_at(slices: dict | None, loss: Callable, params: Any, batch: Any, read: Callable) -> Any:
    """``read(loss, params, batch)`` (numbers, dicts and tuples of them) of the loss and its gradient on the whole
    batch on one device; with ``depth=``, read on the sliced models and carried to the depth (exact: each block
    adds the same matmuls; a key one slice lacks is 0 there)."""
    if slices is None:
        return read(loss, params, batch)

    def carry(a: Any, b: Any) -> Any:
        if isinstance(a, tuple):
            return tuple(map(carry, a, b))
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            return {k: carry(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}
        return carried(a, b, slices["blocks"], slices["depths"][0])

    return carry(*(read(default_loss(m), p, batch) for m, p, _ in slices["at"]))


def _slices(depth: Any, loss_fn: Any, units: tuple, params: Any, batch: Any, optimizer: Any, where: str
            ) -> dict | None:
    """``depth=``: the model at the two block counts of ``slice_depths``, their parameters' shapes and
    profiles, the counts, and the model's own block count (``spmd.parallel.auto._compiled``)."""
    if depth is None:
        return None
    if not callable(depth):
        raise TypeError(f"{where}: depth={depth!r} must be a callable n -> the model with n repeated blocks (e.g. "
                        "lambda n: Llama(replace(cfg, num_layers=n))), or None.")
    if loss_fn is not None:
        raise ValueError(f"{where}: depth= with loss_fn=: the slices are costed on the default next-token loss of "
                         "each slice model; leave loss_fn out (or give depth=None).")
    if len(units) != 1:
        raise ValueError(f"{where}: depth= needs the model's repeated blocks as one glob (units={units!r}); give "
                         "units=('layers_*',).")
    blocks = count_units(params, units[0])
    at, depths = [], slice_depths(max(blocks, 1))
    for n in depths:
        m = depth(n)
        p = jax.eval_shape(lambda r, x: m.init(r, x)["params"], jax.random.key(0), batch["inputs"])
        if count_units(p, units[0]) != n:
            raise ValueError(f"{where}: depth({n}) has {count_units(p, units[0])} blocks matching {units[0]!r}, not "
                             f"{n}; depth must build the model with n repeated blocks.")
        at.append((m, p, Profile(default_loss(m), p, optimizer)))
    return {"blocks": blocks, "at": at, "depths": depths}


def _state_bytes(model: Any, devices: list, lay: Layout, params: Any, optimizer: Any, batch: Any) -> int:
    """``lay``'s parameter and optimizer-state shards' bytes per device, from its plan's shapes."""
    laid, mesh = apply_layout(model, devices, lay)
    plan = as_parallel(laid, mesh, "auto_layout").plan(params, *_example_inputs(model, batch))
    local = [jax.ShapeDtypeStruct(e.local_shape, e.dtype) for e in plan.entries]
    return plan.bytes_per_device + _nbytes(jax.eval_shape(optimizer.init, local))


def _state_over(model: Any, devices: list, lay: Layout, params: Any, optimizer: Any, batch: Any,
                budget: int | None, slices: dict | None = None) -> str | None:
    """Why ``lay``'s state alone (its parameter and optimizer-state shards, in the arguments and the outputs)
    and batch slice exceed ``budget``, from the plan's shapes, nothing traced; None where they do not (or under
    a pipeline, whose state the pipeline builds). ``slices`` (``depth=``): read on the 3- and 4-block models
    and carried to the depth (exact: each block adds its own shards, cut alike)."""
    if budget is None or lay.pp > 1:
        return None
    if slices is None:
        state = _state_bytes(model, devices, lay, params, optimizer, batch)
    else:
        s1, s2 = (_state_bytes(m, devices, lay, p, optimizer, batch) for m, p, _ in slices["at"])
        state = carried(s1, s2, slices["blocks"], slices["depths"][0])
    need = 2 * state + _nbytes(batch) // (lay.n_data * lay.cp)
    if need <= budget:
        return None
    return (f"its state (parameters and optimizer state, {state:,} B per device, before and after the update) and "
            f"batch slice need {need:,} B per device, over the budget of {budget:,} B whatever the checkpointing")


def _with_compiled(c: Candidate, figs: dict, cal: Any, budget: int | None) -> Candidate:
    """``c`` with its compiled step's figures (``compile_figures``): its peak XLA's, and, priced on a
    ``Hardware``, its compute the roofline of the compiled step's flops and bytes."""
    m = figs["memory"]
    mem = {**c.memory, "floor": c.memory["peak"], **m.as_dict(), "compiled": True}
    out = replace(c, memory=mem, measured_peak=m.peak, fits=budget is None or m.peak <= budget)
    if isinstance(cal, HardwareRates) and c.layout.pp == 1:
        rates = replace(cal, dtype=_rated(cal, c.layout.mixed_precision)) if c.layout.mixed_precision else cal
        compute = rates.compute_s(figs["flops"], figs["bytes"])
        out = replace(out, compute_s=compute, flops=figs["flops"], bytes_accessed=figs["bytes"],
                      predicted_s=compute + sum(c.comm_s.values()) + c.dispatch_s)
    return out


def candidate_layouts(n: int, plan: Any, units: tuple[str, ...]) -> list[Layout]:
    """Every layout ``auto_layout`` weighs on ``n`` devices (accumulation aside): per factorization, the
    tensor-parallel variants ``(sequence_parallel, weight_stationary)`` the plan has, each under FSDP with
    and without ``reshard_after_forward``."""
    out = []
    for dp, fsdp, tp in factorizations(n):
        variants = [(False, False, None)]
        if tp > 1:
            variants = [(sp, ws, got) for sp, ws in ((False, False), (True, False), (False, True))
                        if (got := tp_plan_for(plan, sp, tp, weight_stationary=ws)) is not None]
        for (sp, ws, tp_plan), raf in itertools.product(variants, (True, False) if fsdp > 1 else (True,)):
            out.append(Layout(dp=dp, fsdp=fsdp, tp=tp, reshard_after_forward=raf, sequence_parallel=sp,
                              units=units if fsdp > 1 else (), tp_plan=tp_plan, weight_stationary=ws))
    return out


@planned_fused
def auto_layout(model: Any, optimizer: Any, example_batch: Any, mesh_shape_or_devices: Any = None, *,
                memory_budget_bytes: int | None = None, plan: Any = None, loss_fn: Callable | None = None,
                params: Any = None, units: Any = None, calibration: Calibration | None = None,
                layouts: Any = None, top: int = 5, profile: Profile | None = None,
                accum_steps: int = 1, measure: int = 0, hardware: Any = None, mixed_precision: Any = (),
                depth: Callable[[int], Any] | None = None) -> AutoLayout:
    """Rank the layouts of ``model`` on the devices by predicted step time (see the module doc).

    ``example_batch``: a global batch (arrays or ``jax.ShapeDtypeStruct``); ``plan``: the tensor-parallel
    plan, a dict (no sequence parallelism) or ``plan(sequence_parallel=, tp_size=) -> dict | None``;
    ``loss_fn(params, batch)``: default next-token cross-entropy on ``batch["inputs"]`` /
    ``["targets"]``; ``params``: the parameters (or shape structs; default: ``model.init`` on
    ``example_batch["inputs"]``); ``units``: the ``fully_shard`` units (default: the repeated blocks);
    ``calibration``: default ``calibrate(devices)`` (cached); ``layouts``: weigh these instead;
    ``profile``: a ``spmd.parallel.cost._memory.Profile`` of this loss, parameters and optimizer to reuse (its
    single-device programs are compiled once per micro-batch size); ``accum_steps``: the least gradient
    accumulation of every candidate (the user's own; more where the memory budget needs it); ``measure``:
    compile and time the top ``measure`` fitting candidates side by side and rank those first by their
    measured time (``spmd.parallel.auto._measure``; one process only). Under ``memory_budget_bytes`` (bytes
    per device, a number) the top ``max(measure, 1)`` are first compiled (not run) in ranked order until that
    many fit by their compiled peak, and only those are timed, on the steps so compiled; a budget below the
    state's bytes (parameters and optimizer state, before and after the update) cut over every device is
    refused at once, before any calibration or trace.

    ``hardware``: plan for that hardware instead of this machine: a built-in's name (``"h100"``, ``"h200"``,
    ``"a100-80g"``, ``"tpu-v5p"``: ``spmd.parallel.HARDWARE``) or a ``spmd.parallel.Hardware``. Nothing is
    then timed here and no calibration is made (``calibration=`` or ``measure=`` with it is an error): each
    candidate's communication is its step's own table priced by ``Hardware.collective_s`` at the group and
    stride of the mesh dim each collective runs over in the layout's row-major order (``tp`` innermost: a
    group inside a node runs at the node's links, one spanning nodes at the inter-node ones), and its compute
    the roofline ``max(flops / the matmul peak of the dtype its matmuls run in, bytes accessed / the memory
    bandwidth)`` of the same flops and bytes (the max: the memory traffic of a matmul-bound step runs under
    its matmuls, a sum would count the overlap twice); no dispatch or launch cost
    (``spmd.parallel.auto._priced``); once a candidate is compiled its compute is the roofline of its own
    step's ``cost_analysis()`` flops and bytes, and before, the model's matmul work at the peak rate: a bound,
    but the search (``_budget.SHARPEN``, on by default) scales it by its nearest compiled kin's ratio (same
    compute dtype and tp cut), an estimate, not a bound, to decide what to compile next; with ``SHARPEN``
    off the bound alone stops the compiling (``_budget.checked``). ``memory_budget_bytes`` defaults to the hardware's
    ``memory_bytes``.

    ``mixed_precision``: a floating dtype's name (``"bfloat16"``) or several: every FSDP layout is weighed
    computing in it too (``Layout.mixed_precision``: ``fully_shard``'s ``MixedPrecisionPolicy``, gradients
    reduced in float32). ``depth``: ``n -> the model with n repeated blocks`` (the units' glob must match
    ``n`` modules); every candidate is then traced and compiled at 3 and 4 blocks (fewer for a model of fewer
    than 4: the peak is steady once the block added is a middle one) and its figures carried to the model's
    own count (``spmd.parallel.auto._compiled``; default loss only, no pipelines). Progress on stderr: a bar on a
    terminal, else one line per layout, counting them and naming the one traced, timed or compiled.
    """
    where = "auto_layout"
    _check_optimizer(optimizer, where)
    hw = None if hardware is None else Hardware.named(hardware, where=where, arg="hardware")
    named = f"hardware={hardware!r}" if isinstance(hardware, str) else f"hardware=Hardware({getattr(hw, 'name', '')!r})"
    if hw is not None and calibration is not None:
        raise ValueError(f"{where}: {named} and calibration= were both given; hardware= prices the "
                         "layouts on that hardware's figures and calibration= on this machine's measured ones: "
                         "give one.")
    if hw is not None and measure:
        raise ValueError(f"{where}: {named} with measure={measure!r}: measure= times the candidates "
                         f"on this machine, not on {hw.name}; leave measure=0 to plan for {hw.name}.")
    if hw is not None and memory_budget_bytes is None:
        memory_budget_bytes = int(hw.memory_bytes)
    check_budget(memory_budget_bytes, where)
    devices = devices_of(mesh_shape_or_devices, where)
    batch = _abstract(example_batch)
    check_batch_rows(batch, loss_fn, where)
    params = _params_of(model, batch, params, where)
    if memory_budget_bytes is not None:  # refused at once below what any layout's state needs, nothing compiled
        check_floor(params, optimizer, len(devices), memory_budget_bytes, where)
    loss = params_loss(model, loss_fn)  # the one-device profile's form: loss(params, batch)
    if hw is not None:  # priced on the hardware's figures: nothing timed or calibrated here
        dtype = matmul_dtype(loss, params, batch)
        if dtype not in hw.matmul_flops:
            raise ValueError(f"{where}: the model's matmuls run in {dtype}, for which {named} gives no rate (its "
                             f"matmul_flops are for {sorted(hw.matmul_flops)}); add {dtype!r} to its matmul_flops "
                             "or cast the model's matmuls to one of those.")
        cal = HardwareRates(hw, dtype, group_size=len(devices))
    else:
        cal = calibration if calibration is not None else calibrate(devices)
    units = infer_units(params) if units is None else tuple(units)
    profile = profile or Profile(loss, params, optimizer,
                                 step_loss=loss_fn if loss_fn is not None else default_loss(model))
    if isinstance(measure, bool) or not isinstance(measure, int) or measure < 0:
        raise ValueError(f"{where}: measure={measure!r} must be an int >= 0 (the top candidates compiled and timed; "
                         "0 ranks by the prediction alone).")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"{where}: accum_steps={accum_steps!r} must be an int >= 1 (the least gradient "
                         "accumulation of every candidate).")
    rows = jax.tree.leaves(batch)[0].shape[0]
    precisions = check_precisions(mixed_precision, where)
    # a scanned stack's layers are the pipeline's units (its stages slices of the layer axis)
    stack = scanned_stack(model, params, _example_inputs(model, batch, 2)) if layouts is None else None
    pp_units, layers = ((stack[0],), stack[1]) if stack and units in ((), (stack[0],)) else (units, None)
    todo = list(layouts) if layouts is not None else [
        replace(lay, mixed_precision=p) for lay in candidate_layouts(len(devices), plan, units)
        for p in (None, *precisions) if p is None or lay.fsdp > 1] + pipeline_layouts(
            len(devices), plan, pp_units, params, rows, layers) + context_expert_layouts(len(devices), plan, units, params, batch, stack)
    todo = [lay if lay.accum_steps >= accum_steps else replace(lay, accum_steps=accum_steps) for lay in todo]
    slices = _slices(depth, loss_fn, units, params, batch, optimizer, where)
    if slices is not None:
        todo = [lay for lay in todo if lay.pp == 1]  # no pipelines: a slice's stages are not the model's
    loss_of = (lambda laid: loss_fn if loss_fn is not None else default_loss(laid))  # noqa: E731
    pairs: dict = {}  # with depth=: a layout's candidates at its slices' blocks
    traced_steps: dict = {}  # with depth= and a budget: a layout's traced slice steps, until compiled
    plans: dict = {}  # what the layouts' plans read off the model, once (abstract_state)

    # no budget, calibrated: each optimizer update timed only where it can rank (_refined)
    pending: dict | None = {} if hw is None and memory_budget_bytes is None and slices is None else None

    def evaluate(lay: Layout, budget: int | None = memory_budget_bytes) -> Candidate:
        # its memory lower bound first: over the budget, its step is not traced (no time can make it fit)
        if slices is None:
            c = evaluate_layout(model, optimizer, batch, devices, lay, loss_fn=loss_fn, params=params,
                                calibration=cal, profile=profile, budget=budget, floor_only=budget is not None,
                                notes=notes, pending=pending, plans=plans)
            if budget is None or not c.fits:
                return c
            return evaluate_layout(model, optimizer, batch, devices, lay, loss_fn=loss_fn, params=params,
                                   calibration=cal, profile=profile, budget=budget, notes=notes, plans=plans)
        if budget is not None:
            c = extrapolated(*[evaluate_layout(m, optimizer, batch, devices, lay, params=p, calibration=cal,
                                               profile=pr, budget=budget, floor_only=True)
                               for m, p, pr in slices["at"]], slices["blocks"], budget, at=slices["depths"][0])
            if not c.fits:
                return c
        steps: list = []  # the slices' traced steps, lowered from these if compiled (not traced again)
        got = [evaluate_layout(m, optimizer, batch, devices, lay, params=p, calibration=cal, profile=pr,
                               budget=budget, built=steps if budget is not None else None)
               for m, p, pr in slices["at"]]
        pairs[lay] = got
        if steps:
            traced_steps[lay] = steps
        return extrapolated(*got, slices["blocks"], budget, at=slices["depths"][0])

    def roofline(lay: Layout, flops: float, nbytes: float) -> float:  # a compiled step's compute on hw
        return replace(cal, dtype=_rated(cal, lay.mixed_precision) if lay.mixed_precision else cal.dtype
                       ).compute_s(flops, nbytes)

    compiled: dict = {}
    keep = compiled if measure else None

    def compile_one(c: Candidate) -> Candidate:
        if slices is None:
            return _with_compiled(c, compile_figures(model, optimizer, loss_of, params, batch, devices,
                                                     c.layout, keep=keep, hardware=hw), cal, memory_budget_bytes)
        steps = traced_steps.pop(c.layout, [None, None])
        jobs = [(copy_context(), lambda m=m, p=p, st=st: compile_figures(
            m, optimizer, default_loss, p, batch, devices, c.layout, built=st, hardware=hw))
            for (m, p, _), st in zip(slices["at"], steps)]
        with ThreadPoolExecutor(2) as pool:  # the slices compiled side by side: XLA's compile releases the GIL
            figs = list(pool.map(lambda job: job[0].run(job[1]), jobs))  # (each in a copy of this context)
        got = [_with_compiled(ci, f, cal, memory_budget_bytes) for ci, f in zip(pairs[c.layout], figs)]
        return extrapolated(*got, slices["blocks"], memory_budget_bytes,
                            roofline if isinstance(cal, HardwareRates) else None, at=slices["depths"][0])

    def variants(c: Candidate, budget: int) -> list[Candidate]:  # those of a layout over once compiled
        return _fitting(c, lambda lay: evaluate(lay, budget), rows, units, rejected, policies())

    got, rejected = [], []
    search_stats: dict = {}  # hardware=: what the search traced and compiled (_budget.searched)
    refused: dict = {}  # "cp" / "ep": the step's refusal of the model's first such layout, standing for the rest
    notes: dict = {}  # "gather": the model's attention runs on the sequence gathered over cp (_cpep.gather_only)
    weighed: list = []  # the checkpointing policies weighed where memory needs them, found at the first need (those

    def policies() -> tuple:  # left out: in rejected, with the reason)
        if not weighed:
            weighed.append(weighed_policies(loss, params, batch, devices, rejected) if units else ())
        return weighed[0]
    bar = _bar(len(todo), f"auto_layout on {len(devices)} devices: layouts", under=profile)
    made: list = []  # the layouts traced so far that gave a candidate

    def traced(lay: Layout) -> list[Candidate]:  # its estimate, or its variants that fit; [] where rejected
        now(bar, "tracing " + lay.name)
        kind = ("cp" if lay.cp > 1 else "ep" if lay.ep > 1 else None) if lay.pp == 1 else (  # a pipeline's: its
            ("pp x tp x cp" if lay.tp > 1 else "pp x cp") if lay.cp > 1 else "pp x ep" if lay.ep > 1 else None)  # own
        if kind in refused:
            rejected.append((lay.name, refused[kind]))
            return []
        if layouts is None and gather_only(notes, lay):
            rejected.append((lay.name, GATHER_ONLY))
            return []
        try:
            over = _state_over(model, devices, lay, params, optimizer, batch, memory_budget_bytes, slices)
            if over:  # no checkpointing or accumulation shrinks the state: nothing traced
                rejected.append((lay.name, over))
                return []
            c = evaluate(lay)
        except Exception as e:  # noqa: BLE001 - a pipeline the model cannot take is no reason to rank nothing
            plain = isinstance(e, (ValueError, TypeError))
            if not plain and lay.pp == 1 and kind is None:
                bar.close()
                raise
            rejected.append((lay.name, ("" if plain else f"{type(e).__name__}: ") + str(e).split("\n")[0][:400]))
            if kind is not None and not any((m.cp > 1 if kind.endswith("cp") else m.ep > 1) and (m.pp > 1) == (
                    lay.pp > 1) for m in made):
                refused[kind] = rejected[-1][1]
            return []
        made.append(lay)
        return [c] if c.fits else _fitting(c, evaluate, rows, units, rejected, policies())

    if hw is None:
        for lay in todo:
            got.extend(traced(lay))
        if pending:
            got = _refined(got, max(measure, 1), pending, lambda c: now(
                bar, "timing the optimizer update of " + c.name, 0))
        bar.close()
    else:  # best-first: traced and compiled in the order of their bounds (_budget.searched)
        work, io = _read_at(slices, loss, params, batch, dot_cost)

        def bound_compute(lay: Layout) -> float:  # a lower bound on its compute: its share of the model's matmuls'
            if lay.pp > 1:  # flops and bytes, its update's bytes (_priced.step_floor)
                return 0.0
            return step_floor(cal.hardware, _rated(cal, lay.mixed_precision or cal.dtype), work / lay.size,
                              dot_bytes(io, lay.mixed_precision) / lay.size, state_floor(lay, params, optimizer))

        traffic: dict = {}  # each tp plan's activation traffic over tp (_priced.tp_traffic), read once

        def bound(lay: Layout) -> float:  # a lower bound on its compiled time: its compute's and its gradients'
            if lay.pp > 1:  # reduction (and FSDP's gathers) at the least bytes, its activations' over tp
                return 0.0
            if lay.tp > 1 and lay.tp_plan not in traffic:
                traffic[lay.tp_plan] = _read_at(slices, loss, params, batch, lambda *a: tp_traffic(*a, lay.tp_plan))
            return (bound_compute(lay) + comm_floor(lay, cal.hardware, params)
                    + (tp_floor(lay, cal.hardware, traffic[lay.tp_plan]) if lay.tp > 1 else 0.0))

        bar2 = _bar(None, "auto_layout: compiling")
        got, _ = searched(
            todo, bound, traced, 1, memory_budget_bytes, compile_one, variants, bound_compute=bound_compute,
            stats=search_stats,
            progress=lambda c: (now(bar, "compiling " + c.name, 0), now(bar2, c.name)))
        bar.close()
        bar2.close()
        best = next((c for c in got if c.fits), None)
        # each layout left untraced, and why: its bound no faster than the pick's (proven), the time spent first,
        rejected.extend(search_stats.pop("left"))  # or its estimate (SHARPEN); the uncompiled: search["not_compiled"]
        if search_stats.get("stopped") == "time":  # the uncompiled candidates that might beat the pick, by name
            search_stats["uncompiled_faster"] = [c.name for c in got if c.measured_peak is None and c.fits
                                                 and c.predicted_s < best.predicted_s]
    if not got:
        raise ValueError(f"{where}: no layout of {len(devices)} devices could be built for this model; "
                         + "; ".join(f"{n}: {r}" for n, r in rejected[:4]))
    if hw is None:
        got.sort(key=lambda c: (not c.fits, c.predicted_s))
    if memory_budget_bytes is not None and not got[0].fits and all(c.measured_peak is None for c in got):
        small = min(got, key=lambda c: c.memory["peak"])
        raise ValueError(
            f"{where}: no layout fits memory_budget_bytes={memory_budget_bytes:,}; the smallest, {small.name}, "
            f"needs at least {small.memory['peak']:,} B per device ({parts(small.memory)}), with the gradient "
            "accumulation the micro-batches allow"
            + (f" and activation checkpointing ({', '.join(repr(p) for p in policies())}) weighed" if units
               else "") + "; use more devices, a larger budget, a smaller batch or fully_shard units (fsdp).")
    if memory_budget_bytes is not None and hw is None:  # compiled in ranked order until the top fit by XLA's peak
        bar = _bar(None, "auto_layout: compiling")
        got = checked(got, max(measure, 1), memory_budget_bytes, compile_one, variants,
                      bound=isinstance(cal, HardwareRates),
                      progress=lambda c: now(bar, "compiling " + c.name))
        bar.close()
    if measure:  # those timed side by side (all fitting: one interleaved set), not compiled again
        bar = _bar(measure, f"auto_layout: timing the top {measure} of {len(got)}")
        spreads: dict = {}  # each timed layout's median's standard error (_measure.median_error)
        got = _measured(got, measure, memory_budget_bytes, lambda lays: [(*r, spreads.get(lay)) for lay, r in zip(
            lays, measure_layouts(model, optimizer, loss_of, params, batch, devices, lays, compiled=compiled,
                                  progress=measuring(bar, len(lays)), spreads=spreads))])
        bar.close()
    compiled.clear()
    if memory_budget_bytes is not None and not got[0].fits:
        small = min((c for c in got if c.measured_peak is not None), key=lambda c: c.measured_peak)
        n = sum(c.measured_peak is not None for c in got)
        raise ValueError(f"{where}: no layout fits memory_budget_bytes={memory_budget_bytes:,} once compiled: "
                         f"{n} whose lower bound fits were compiled (with the accumulation and checkpointing "
                         f"variants of those over), and the smallest, {small.name}, needs {small.measured_peak:,} B "
                         f"per device (bound {int(small.memory['floor']):,}); use more devices, a larger budget or a "
                         "smaller batch.")
    return AutoLayout(tuple(got), tuple(rejected), None if hw is not None else cal, memory_budget_bytes, top,
                      hardware=hw, search=search_stats or None)
