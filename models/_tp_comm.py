"""What a train step on a ``dp x fsdp x tp`` mesh communicates, analytically (Megatron-LM + ZeRO-3).

Per device, in the nccl-tests byte convention of ``spmd.collectives`` (all-reduce: the buffer;
all-gather: the gathered result; reduce-scatter: the input). ``A = b x T x D`` activation bytes, ``b``
the micro-batch of one data-parallel rank (``B / (dp x fsdp x accum_steps)``), ``L`` layers:

- tensor parallel, per micro-batch: forward one all-reduce of ``A`` over ``tp`` after attention and one
  after the MLP in every block, and the same two in backward (the column-parallel inputs' gradients),
  plus the embedding's (forward) and the output projection's input gradient (backward): ``4L + 2``
  all-reduces of ``A``; under sequence parallelism each becomes an all-gather + reduce-scatter pair of
  ``A`` each (``4L + 2`` of both); the vocab-parallel cross-entropy all-reduces ``b x T`` maxima, sums
  of exponentials and target logits, and ``b x T`` argmax indices (3 all-reduces, ``16 b T`` bytes);
- fsdp (ZeRO-3, per unit and per buffer: each dtype and tp-cut/tp-whole group, a single group under
  sequence parallelism, cut into ``ParamPlan.gather_buffers``: each array of 2+ dims alone, the vectors
  together): one all-gather before the unit runs, one more for its backward pass when re-gathering (not
  the held root, not with accumulation), one reduce-scatter of its gradient;
- dp: one all-reduce of the fsdp-cut gradient bytes (per group); parameters whole on fsdp: one
  all-reduce of their gradients over the data dims; under sequence parallelism one all-reduce over
  ``tp`` of the tp-replicated (norm, bias, position) gradients.

Scalars (loss, metrics, the global norm's per-leaf partial sums) are not counted.
"""

from __future__ import annotations

import re
from typing import Sequence

from spmd.parallel import ParamPlan

__all__ = ["tp_communication"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def tp_communication(plan: ParamPlan, *, batch: int, seq_len: int, d_model: int, num_layers: int, dp: str = "dp",
                     tp: str = "tp", sequence_parallel: bool = False, accum_steps: int = 1, regather: bool = True,
                     keep: Sequence[str] = ("root",), itemsize: int = 4) -> dict:
    """``{"activations": {kind: {count, bytes}}, "parameters": {...}, "total": {...}}`` of one step."""
    names = plan.mesh_dim_names
    size = dict(zip(names, plan.mesh_shape))
    n_data = size.get(dp, 1) * size.get(plan.fsdp, 1)
    b = batch // (n_data * accum_steps)
    a = b * seq_len * d_model * itemsize
    act = {k: {"count": 0, "bytes": 0} for k in KINDS}
    par = {k: {"count": 0, "bytes": 0} for k in KINDS}

    def add(table, kind, count, nbytes):
        if count and nbytes:
            table[kind]["count"] += count
            table[kind]["bytes"] += count * nbytes

    n_act = (4 * num_layers + 2) * accum_steps
    if size.get(tp, 1) > 1:
        for kind in (("all-gather", "reduce-scatter") if sequence_parallel else ("all-reduce",)):
            add(act, kind, n_act, a)
        add(act, "all-reduce", 2 * accum_steps, 4 * b * seq_len)  # max, argmax index
        add(act, "all-reduce", accum_steps, 8 * b * seq_len)  # sum of exponentials + target logit
    ti = names.index(tp) if tp in names else None
    fi = names.index(plan.fsdp) if plan.fsdp in names else None
    n_fsdp = size.get(plan.fsdp, 1)

    def group(e):  # the flat buffer a leaf travels in
        return (e.dtype, sequence_parallel or (ti is not None and e.shard_dim(ti) is not None))

    def grouped(entries):
        out: dict = {}
        for e in entries:
            out[group(e)] = out.get(group(e), 0) + e.local_nbytes
        return out

    def buffers(entries):  # one per all-gather: each group cut into the plan's gather buffers, as TPGather does
        by: dict = {}
        for e in entries:
            by.setdefault(group(e), []).append(e)
        return [sum(e.local_nbytes for e in b) for g in by.values() for b in plan.gather_buffers(g)]

    cut = [e for e in plan.entries if fi is not None and e.shard_dim(fi) is not None]
    whole = [e for e in plan.entries if fi is None or e.shard_dim(fi) is None]
    for u in plan.units:
        held = any(re.fullmatch(k, u) for k in keep)
        gathers = 1 if (not regather or held or accum_steps > 1) else 2
        for nbytes in buffers([e for e in cut if e.unit == u]):
            add(par, "all-gather", gathers, nbytes * n_fsdp)
            add(par, "reduce-scatter", 1, nbytes * n_fsdp)
    if size.get(dp, 1) > 1:
        for nbytes in grouped(cut).values():
            add(par, "all-reduce", 1, nbytes)
    if n_data > 1:
        for nbytes in grouped(whole).values():
            add(par, "all-reduce", 1, nbytes)
    if sequence_parallel and ti is not None:
        add(par, "all-reduce", 1, sum(e.local_nbytes for e in plan.entries if e.shard_dim(ti) is None))
    total = {k: {"count": act[k]["count"] + par[k]["count"], "bytes": act[k]["bytes"] + par[k]["bytes"]}
             for k in KINDS}
    return {"activations": act, "parameters": par, "total": total}
