"""The one cost model: what a train step communicates per device, by mesh dim role, before it runs.

Per device, in the nccl-tests byte convention of ``spmd.collectives`` (all-reduce: the buffer; all-gather:
the gathered result; reduce-scatter: the input). ``count`` is the number of collectives the algorithm
runs, one per buffer (XLA may combine independent ones of a kind into one op of several buffers: the
HLO reader's ``buffers`` and ``bytes`` are what equal this table).

- **fsdp** (ZeRO-3, per unit and per gather buffer of ``ParamPlan.gather_buffers``; with a
  ``MixedPrecisionPolicy`` the gathers move ``param_dtype`` bytes, the reductions ``reduce_dtype``): one all-gather before
  the unit runs, one more for its backward pass with ``reshard_after_forward`` (not the root unit, which
  is gathered once per step, nor with accumulation, which gathers every unit once), one reduce-scatter of
  its gradient; less the gathers whose result nothing reads, which XLA drops (read off the traced step:
  ``spmd.parallel.cost._recompute.dead_gathers``, a parameter the loss never reads); a train step's table
  counts the re-gathers its backward pass runs (``_recompute.regathered``: none of a bias, whose gradient
  reads no parameter, nor of the first unit's kernels, which only its input's gradient reads);
- **dp** (the replicate dims, HSDP): one all-reduce of the fsdp-cut gradient shards; parameters whole on
  the data dims: one all-reduce of their gradients over every data dim (DDP);
- **tp**, per styled module call and micro-batch (``A``: its activation bytes, global over tp), from its
  style's layouts (``ParallelStyle``), whatever the style: a module on its tp blocks whose input arrives
  ``Shard(d)`` and is needed ``Replicate`` (a ``ColwiseParallel`` input under sequence parallelism): an
  all-gather forward (one per input: the modules reading it, such as q, k and v, share it), a
  reduce-scatter backward (one per module); a ``Replicate`` floating input: its gradient's all-reduce
  (backward, Megatron's ``f``; none for token ids); a ``Partial`` output (``RowwiseParallel``) wanted
  ``Replicate``: an all-reduce forward (Megatron's ``g``); wanted ``Shard``: a reduce-scatter forward, an
  all-gather backward; a cut output (``ColwiseParallel``'s features) wanted ``Replicate``: an all-gather
  forward, a reduce-scatter backward. Parameters whole over tp that it reads (``SequenceParallel`` norms,
  a row-wise bias added to ``Shard`` outputs): an all-reduce of their gradients. A style in global view
  (``PrepareModuleOutput``) from ``Replicate`` to ``Shard`` (a whole embedding's output cut): a slice
  forward, an all-gather of its gradient backward; an input from ``Shard`` to ``Replicate``
  (``PrepareModuleInput`` before a module run whole, such as a tied head after sequence parallelism): an
  all-gather forward per module call (XLA does not merge two modules' gathers of one input), its gradient
  sliced back. A projection with fewer heads than tp
  (``spmd.parallel.step._heads``; grouped-query attention's key / value heads), run whole over tp: an
  all-gather forward of each of its parameters the plan cuts over tp; backward, its output's gradient
  (``A``, whole on each device) summed over the devices sharing a head (an all-reduce of ``A / heads``, when
  tp exceeds the heads) and gathered across the heads (an all-gather of ``A``, when there are several);
  under sequence parallelism its input is all-gathered forward too (one per such module), its gradient
  sliced back.
- **tp, weight-stationary** (a plan cutting the activations on the batch, ``spmd.parallel.styles._weight_stationary``):
  the terms above, plus one all-reduce over tp per micro-batch of the gradient of each parameter whole over
  tp that no module on its tp blocks reads (the model's own
  code reads it on the device's sequences: a position table; GSPMD sums it). The whole parameter is
  counted: a model reading a slice of it (``pos[:t]`` with ``t`` below its length) moves the slice.

- **recomputed** (a ``jax.checkpoint`` of the user's own, such as ``nn.remat`` around scanned blocks, whose
  policy keeps neither an FSDP unit's gathered parameters nor a tp collective's result): the collectives the
  backward pass runs again in its recomputation of the forward pass, read off the traced backward pass
  (``spmd.parallel.cost._recompute``), per buffer and loop trip.

- **batch statistics** (a state with ``batch_stats``): with ``batch_norm="sync"`` (torch's ``SyncBatchNorm``),
  per ``nn.BatchNorm`` call that computes statistics, flax's all-reduce of its moments over the data dims (the
  mean and the mean of squares stacked: 2 x features x 4 B; one each without ``use_fast_variance``), and its
  transpose in the backward pass (read off the traced backward pass: none where the input has no gradient);
  with ``"broadcast"`` (DDP's buffers), one all-reduce per statistics array (rank 0's, the others' zeros).

A parameter whose gradient is zero by construction (read under ``stop_gradient`` only, or not at all: the
backward pass's own instantiated zero, ``spmd.parallel.step._grad_layout.zero_grads``) is not reduced and
not counted (a reduce-scatter only when every parameter of its buffer is such). A parameter whose gradient is
the same value as an earlier parameter's by construction (the same equation on the same inputs in the traced
backward pass, ``spmd.parallel.step._grad_layout.equal_grads``: two BatchNorm biases after a residual sum), both
averaged whole over the data dims, is not counted either: XLA's common-subexpression elimination reduces the
value once. Reduce-scattered in a unit's buffer, or accumulated over micro-batches, each is counted.
Scalars (the loss, metrics, the global norm's partial sums) are not counted.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from placements import Partial, Replicate, Shard
from spmd.parallel.plan._param_plan import ROOT, ParamPlan
from spmd.parallel.plan._scan import scan_of, unstacked
from spmd.parallel.styles._weight_stationary import is_batch_cut

__all__ = ["step_communication", "format_communication", "KINDS"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def _table() -> dict:
    return {k: {"count": 0, "bytes": 0} for k in KINDS}


def _add(table: dict, kind: str, nbytes: int, count: int = 1) -> None:
    if nbytes and count:
        table[kind]["count"] += count
        table[kind]["bytes"] += count * nbytes


def _gather_buffers(plan: ParamPlan, entries, ti) -> list:
    """A unit's gather buffers: its tp-cut and tp-whole parameters apart (``FullyShardUnit.gather``), each group
    cut into ``ParamPlan.gather_buffers``."""
    groups: dict = {}
    for e in entries:
        groups.setdefault(ti is not None and isinstance(e.placements[ti], Shard), []).append(e)
    return [b for g in groups.values() for b in plan.gather_buffers(g)]


def _cast(e, dtype) -> int:
    """``e``'s stored block bytes in ``dtype`` (a mixed-precision gather or reduction), else as stored."""
    if dtype is None or not jnp.issubdtype(np.dtype(e.dtype), jnp.floating):
        return e.local_nbytes
    return e.local_nbytes // e.itemsize * np.dtype(dtype).itemsize


def parameter_terms(plan: ParamPlan, model: Any, *, accum_steps: int = 1, zero: frozenset = frozenset(),
                    dead: dict | None = None, merged: frozenset = frozenset(), regathered: dict | None = None) -> dict:
    """The fsdp and dp terms of one step; ``zero``: the paths of the parameters whose gradient is zero by
    construction (not reduced); ``dead``: ``{"count", "bytes"}`` of the units' all-gathers whose result nothing
    reads (``spmd.parallel.cost._recompute.dead_gathers``: not run), taken off; ``merged``: the paths of those
    whose gradient is another's value, all-reduced with it; ``regathered``: the backward pass's re-gathers as its
    traced program runs them (``spmd.parallel.cost._recompute.regathered``: those the gradients read), in place
    of one per buffer of every re-gathering unit."""
    out = _table()
    if dead:
        out["all-gather"] = {"count": -dead["count"], "bytes": -dead["bytes"]}
    fsdp = model.fsdp
    sizes = dict(zip(plan.mesh_dim_names, plan.mesh_shape))
    data = model.data_dims
    shard = fsdp.shard_dim if fsdp else None
    fi = plan.mesh_dim_names.index(shard) if shard else None
    n_fsdp = sizes.get(shard, 1) if shard else 1
    ti = plan.mesh_dim_names.index(model.tp.mesh_dim) if model.tp else None
    mp = fsdp.mp_policy if fsdp else None
    scans = dict(plan.scans)
    for u in plan.units:
        regather = bool(fsdp and fsdp.reshard_after_forward) and u != ROOT and accum_steps == 1 and regathered is None
        # a unit run inside an nn.scan (not with accumulation, which gathers every unit once, whole) gathers
        # one layer per iteration: its buffers as the block sees them, once per layer
        layers = scan_of(u, scans) if u != ROOT and accum_steps == 1 else 1
        ents = plan.unit_entries(u)
        ents = [unstacked(e) if layers > 1 and e.stacked is not None else e for e in ents]
        for buf in _gather_buffers(plan, ents, ti):
            _add(out, "all-gather", sum(_cast(e, mp and mp.param_dtype) for e in buf) * n_fsdp,
                 (2 if regather else 1) * layers)
            if not all(e.path in zero for e in buf):
                _add(out, "reduce-scatter",
                     sum(_cast(e, mp and (mp.reduce_dtype or mp.param_dtype)) for e in buf) * n_fsdp, layers)
    if regathered is not None and accum_steps == 1:
        for f in ("count", "bytes"):
            out["all-gather"][f] += regathered["all-gather"][f]
    names = plan.mesh_dim_names
    for e in plan.entries:  # averaged over the data dims it is whole on (fsdp and ep cuts sum over theirs)
        whole_on = [sizes[d] for d in data if e.shard_dim(names.index(d)) is None]
        if e.path not in zero and e.path not in merged and int(np.prod(whole_on)) > 1:
            out["all-reduce"]["count"] += 1
            out["all-reduce"]["bytes"] += e.local_nbytes
    return out


def activation_terms(records: Sequence[dict], *, accum_steps: int = 1, part: str | None = None) -> dict:
    """The tp terms of one step from the styled calls of one micro-batch (see the module doc). ``part``:
    ``"forward"`` or ``"backward"``: that pass's terms alone (a pipeline counts them per branch)."""
    out = _table()
    gathered: set = set()

    for r in records:
        def add(direction, kind, nbytes, calls=accum_steps * r.get("calls", 1)):  # under nn.scan: once per layer
            if part is None or part == direction:
                _add(out, kind, nbytes, calls)

        a_in, a_out = r["in_bytes"], r["out_bytes"]
        if r["region"]:  # a module on its tp blocks: the collectives between its style's layouts
            given, need = r["in_layout"], r["in_desired"]
            if isinstance(given, Shard) and isinstance(need, Replicate):
                if r["input_id"] not in gathered:  # one all-gather per input, however many modules read it
                    add("forward", "all-gather", a_in)
                    gathered.add(r["input_id"])
                if r["input_grad"]:
                    add("backward", "reduce-scatter", a_in)
            elif isinstance(given, Replicate) and r["input_grad"]:  # the region's transpose: Megatron's f
                add("backward", "all-reduce", a_in)
            local, wanted = r["local_out"], r["out_layout"]
            if isinstance(local, Partial):  # Megatron's g, or a reduce-scatter onto the sequence
                if isinstance(wanted, Shard):
                    add("forward", "reduce-scatter", a_out)
                    add("backward", "all-gather", a_out)
                else:
                    add("forward", "all-reduce", a_out)
            elif isinstance(local, Shard) and not isinstance(wanted, Shard):
                add("forward", "all-gather", a_out)
                add("backward", "reduce-scatter", a_out)
        elif r.get("gathered_input"):  # a global-view input Shard -> Replicate (PrepareModuleInput): one per call
            add("forward", "all-gather", a_in)
        elif r.get("whole_heads"):  # a projection with fewer heads than tp, run whole over tp
            if isinstance(r["in_layout"], Shard):  # its sequence-cut input gathered whole (its gradient: a slice)
                add("forward", "all-gather", a_in)
            for nbytes in r["gathered_params"]:
                add("forward", "all-gather", nbytes)
            heads, n = r["whole_heads"], r["n_tp"]
            if n > heads:  # the devices sharing a head sum their parts of its gradient
                add("backward", "all-reduce", a_out // heads)
            if heads > 1:  # each group's heads, gathered whole
                add("backward", "all-gather", a_out)
        elif isinstance(r["local_out"], Replicate) and isinstance(r["out_layout"], Shard):
            add("backward", "all-gather", a_out)  # a whole output cut (a slice): its gradient all-gathered
        for nbytes in r["summed_params"]:
            add("backward", "all-reduce", nbytes)
    return out


def batch_cut_terms(plan: ParamPlan, model: Any, *, accum_steps: int = 1) -> dict:
    """The weight-stationary term of one step (see the module doc): none unless the plan cuts the batch."""
    out = _table()
    tp = model.tp
    if tp is None or not is_batch_cut(tp.plan):
        return out
    ti = plan.mesh_dim_names.index(tp.mesh_dim)
    from spmd.parallel.styles._transforms import param_module

    for e in plan.entries:
        hit = tp.style_for(param_module(e.path)[0])
        if isinstance(e.placements[ti], Shard) or len(e.shape) == 0:
            continue
        if hit is None or not hit[1].runs_on_blocks():
            _add(out, "all-reduce", e.nbytes, accum_steps)
    return out


def step_communication(plan: ParamPlan, model: Any, records: Sequence[dict], *, accum_steps: int = 1,
                       zero: frozenset = frozenset(), recomputed: dict | None = None,
                       batch_stats: dict | None = None, dead: dict | None = None,
                       merged: frozenset = frozenset(), regathered: dict | None = None,
                       recomputed_dims: dict | None = None) -> dict:
    """``{"parameters": {kind: {count, bytes}}, "activations": {...}, "recomputed": {...}, "total": {...},
    "modules": [...]}``. ``zero``: the paths of the parameters whose gradient is zero by construction;
    ``merged``: those whose gradient is the same value as another parameter's, both reduced whole by one
    all-reduce (counted once); ``dead``: the units' all-gathers whose result nothing reads (``parameter_terms``);
    ``regathered``: the backward pass's re-gathers, read off its program (``parameter_terms``);
    ``recomputed``: the collectives a checkpoint's recomputation runs again (``_recompute``), per step;
    ``recomputed_dims``: the same by the mesh dims they run over (``{"tp": {kind: ...}}``; the table's
    ``"recomputed_dims"``, which the planner prices at their group);
    ``batch_stats``: SyncBatchNorm's all-reduces of its statistics, per step (a ``"batch_stats"`` term)."""
    par = parameter_terms(plan, model, accum_steps=accum_steps, zero=zero, dead=dead, merged=merged,
                          regathered=regathered)
    act = activation_terms(records, accum_steps=accum_steps)
    ws = batch_cut_terms(plan, model, accum_steps=accum_steps)
    act = {k: {f: act[k][f] + ws[k][f] for f in ("count", "bytes")} for k in KINDS}
    rec, bn = recomputed or _table(), batch_stats or _table()
    total = {k: {f: par[k][f] + act[k][f] + rec[k][f] + bn[k][f] for f in ("count", "bytes")} for k in KINDS}
    return {"parameters": par, "activations": act, "recomputed": rec, "recomputed_dims": dict(recomputed_dims or {}),
            "batch_stats": bn, "total": total, "modules": list(records)}


def format_communication(comm: dict) -> str:
    def line(t):
        return ", ".join(f"{k} x{v['count']} = {v['bytes']:,} B" for k, v in t.items() if v["count"]) or "none"

    lines = [f"step communication per device: {line(comm['total'])}",
             f"  parameters (fsdp / dp): {line(comm['parameters'])}",
             f"  activations (tp): {line(comm['activations'])}"]
    for r in comm.get("vocab", {}).get("calls", ()):  # the loss over a column-parallel output's cut (step._vocab)
        times = f" x{r['calls']}" if r["calls"] > 1 else ""
        lines.append(f"    loss over {r['module']}'s output cut on its features: {r['op']} over them, all-reduce "
                     f"over tp ({r['bytes']:,} B{times})")
    if any(v["count"] for v in comm.get("batch_stats", {}).values()):
        lines.append(f"  batch statistics (BatchNorm): {line(comm['batch_stats'])}")
    if any(v["count"] for v in comm.get("recomputed", {}).values()):
        by = comm.get("recomputed_dims", {})
        lines.append(f"  recomputed (a checkpoint's forward pass again): {line(comm['recomputed'])}"
                     + "".join(f"; over {d}: {line(t)}" for d, t in by.items() if len(by) > 1 and d))
    if "context" in comm:  # a mesh with cp (spmd.parallel.context._calls): the attention calls and the cp reduction
        lines.append(f"  context (cp): {line(comm['context'])}")
        for r in comm["attention"]:
            if r["method"] == "gather sequence":  # a model's own attention, run on the whole sequence
                ins = ", ".join(f"{list(s)} {d}" for s, d in r["gathered"]) or "none"
                routing = any(x["method"] == "experts cut" and x["call"].startswith(r["call"] + ".")
                              for x in comm["attention"])  # an MoE block's routing over the whole sequence
                own = "".join(f"; {m!r} on the device's positions, its output gathered, its gradients summed over cp"
                              for m in r.get("on_cut", ()))  # token-wise submodules (context._tokenwise.run_on_cut)
                lines.append(f"    {'MoE routing' if routing else 'attention'} {r['call']!r}: gather sequence over "
                             f"cp={r['n']} (in {ins}{own}; its output cut back, its "
                             f"{'other ' if own else ''}parameters' gradients whole)")
                continue
            if r["method"] == "experts cut":  # an expert-parallel module inside one: its buffers cut over cp
                (s_, d_) = r["gathered"][0]
                lines.append(f"    {r['call']}: experts cut over cp={r['n']} (buffers {list(s_)} {d_}: each device "
                             "dispatches its part; the output gathered back, the experts' gradients summed over cp)")
                continue
            (qs, qd), (ks, _) = r["q"], r["kv"]
            lines.append(f"    {r['call']}: {r['method']} over cp={r['n']}, q {list(qs)} {qd}, k/v {list(ks)}"
                         + (", causal" if r["causal"] else ""))
    if "experts" in comm:  # styles on the ep dim (spmd.parallel.styles._experts): dispatch and combine
        lines.append(f"  experts (ep): {line(comm['experts'])}")
        for r in comm["expert_calls"]:
            lines.append(f"    {r['module']}: {r['style']} all-to-all in ({r['in']:,} B) and out ({r['out']:,} B)")
    for r in comm["modules"]:
        lines.append(f"    {r['module']}: {r['style']} in {r['in_layout']} ({r['in_bytes']:,} B) -> out "
                     f"{r['out_layout']} ({r['out_bytes']:,} B)")
    return "\n".join(lines)
