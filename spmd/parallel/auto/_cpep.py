"""``auto_layout``'s context- and expert-parallel candidates (``Layout(cp=)``, ``Layout(ep=)``).

- **cp**: the sequence (dim 1 of every batch leaf of rank 2 or more) cut over ``cp`` for every divisor of the
  device count that divides the sequence, the rest of the devices over ``dp`` x ``fsdp`` x ``tp``. The train
  step runs the attention it recognizes (``jax.nn.dot_product_attention``, flax's ``dot_product_attention``)
  as ring attention (or an all-gather of K/V) across the cut, and a model's own einsum attention (its
  ``[.., T, T]`` scores inside a module, found in the traced step) on the sequence gathered over cp (that
  module's ``gather sequence`` rows: whole on every cp rank, so once a traced cp layout shows it, the model's
  other cp layouts are weighed over ``dp`` x ``cp`` (x ``ep``) only: ``gather_only``). A model with neither (no
  attention at all) is refused by ``evaluate_layout`` (``check_attention``), and the first refusal of a model's
  cp candidate (or the step's refusal of its first ep candidate) stands for the rest: ``auto_layout`` lists them
  rejected with the reason.
- **ep**: the experts of a model that has them (a module named ``experts`` whose parameters share a leading
  experts dim: ``models.MoE``'s ``[E, d, f]`` kernels) cut over ``ep`` with ``ExpertParallel`` (the tokens
  exchanged with all-to-alls) for every divisor of the device count that divides the expert count, the
  batch's rows split over ``dp`` x ``fsdp`` x ``ep``, the rest of the devices over ``dp`` x ``fsdp`` x ``tp``.
  With tp, the experts' hidden ``f`` is cut over tp too (``ExpertTensorParallel`` added to the tp plan, as
  ``models.train`` lays them out: ``expert_tp``) where their shapes tell ``d`` from ``f`` and tp divides ``f``,
  with the sequence over cp too (each device of cp runs the experts on its part of the dispatched buffers, its
  all-reduces over tp on that part), and in a scanned stack (``[L, E, d, f]``: past the layer axis); else they
  stay whole over tp and the layout's ``note`` says why
  (``AutoLayout.why`` prints it).
- **cp x ep**: for a model with experts and a sequence, every ``cp`` x ``ep`` of those whose product divides
  the device count (the sequence over cp, the experts over ep: their routers run on the sequence gathered over
  cp), the rest over ``dp`` x ``fsdp`` x ``tp``.
- **pp x cp, pp x ep** (``pipelined``): the repeated blocks (one units glob, its modules holding the same
  parameters as ``pipeline`` requires: not an MoE's with experts in every other block) in ``pp`` stages over the divisors
  of the device count up to the blocks, with the sequence over ``cp`` (the stages' attention calls the ring
  where the stages allow it, else the all-gather of K/V; a module's own einsum attention on the gathered
  sequence, whole on every cp rank) or the experts
  over ``ep`` (stacked with the stages), the rest over ``dp`` x ``fsdp`` x ``tp``, ``tp`` where the plan has a
  tensor-parallel plan for that size: the stages' projections over tp, with the experts over ep
  (``pp=2,ep=2,tp=2``) or the sequence over cp (``pp=2,cp=2,tp=2``: the ring runs manual over tp too, each device
  its heads, and the table counts cp's terms under tp). A pp x cp x tp candidate whose table says it leaves
  collectives over cp out (its ``uncounted``: projections with fewer heads than tp, run whole over tp, which GSPMD
  partitions over cp; or a unit's own einsum attention) is refused with that reason (``check_pipelined_attention``:
  it would be priced below what its program moves). 1F1B at ``pp``
  and ``2 pp`` micro-batches (those a replica's rows divide). Costed as the other
  pipelines (``spmd.parallel.auto._pipeline``), whose table holds the cp terms (the rings' permutes or the K/V
  gathers, a gathered module's gathers, the gradients' all-reduces over cp) and the experts' all-to-alls.

Each is costed as every other layout is (``evaluate_layout``): the step's own table, whose ``total`` holds the
cp and ep terms (priced over their own dim: the all-to-alls over ep, the rest over cp), the lower bound, and
under a budget the compiled step.
A cp layout's compute is read from the one-device step at a device's rows (``cp_work``), at its ``T / cp``
positions and at the whole ``T``: their difference is attention's ``[T, T]`` part. A rank computes the rest on its
``T / cp`` positions and of that part what its attention calls compute: its ``T / cp`` queries against all ``T``
keys (``T^2 / cp``: the all-gather of K/V, the ring), the causal ring's blocks not wholly in the future (the
zigzag cut's busiest rank: ``5 / 8`` of that at cp=2), or all of it for a module run on the gathered sequence
(whole on every cp rank). Counting attention at ``(T / cp)^2`` instead would price ``dp=1,cp=8`` at an eighth of
``dp=8``'s work.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import jax

from spmd.parallel.auto._layout import Layout, factorizations, tp_plan_for
from spmd.parallel.auto._units import count_units, units_alike
from spmd.parallel.context._layout import causal_work
from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.styles._experts import ExpertParallel, ExpertTensorParallel
from spmd.parallel.styles._transforms import param_module

__all__ = ["GATHER_ONLY", "check_attention", "expert_tp", "check_pipelined_attention", "context_expert_layouts", "experts_of",
           "cp_work", "gather_only", "pipelined", "sequence_of", "uncut"]

GATHER_ONLY = ("the model's own attention runs on the sequence gathered over cp, whole on every cp rank (no ring): its "
               "cp layouts are weighed over dp x cp (x ep) only, not with fsdp or tp (pipelined: not with tp in the "
               "stages, whose table would leave that attention's collectives over cp out)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def experts_of(params: Any, stack: str | None = None) -> tuple[str, int] | None:
    """``(glob, experts)`` of the model's experts modules (their fqn with each layer index a ``*``, and the
    leading dim their parameters share: past the layer axis inside the scanned stack ``stack``, its dotted path),
    or None where it has none."""
    mods: dict[str, set] = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        mod, _ = param_module(path_str(kp))
        lead = 1 if stack is not None and (mod + ".").startswith(stack + ".") else 0  # [L, E, d, f]: dim 1
        if mod.split(".")[-1] == "experts" and len(x.shape) >= 3 + lead:
            mods.setdefault(mod, set()).add(x.shape[lead])
    if not mods or any(len(e) != 1 for e in mods.values()):
        return None
    counts = {next(iter(e)) for e in mods.values()}
    if len(counts) != 1:
        return None
    globs = {".".join(re.sub(r"^(.*?_?)(\d+)$", r"\1*", c) for c in m.split(".")) for m in mods}
    return (sorted(globs)[0], counts.pop()) if len(globs) == 1 else None


def sequence_of(batch: Any) -> int | None:
    """The batch's sequence length (dim 1 of its leaves of rank 2 or more, all equal), or None."""
    seqs = {x.shape[1] for x in jax.tree.leaves(batch) if len(x.shape) >= 2}
    return seqs.pop() if len(seqs) == 1 else None


def expert_tp(params: Any, experts: str | None, tp: int, stack: str | None = None) -> tuple[tuple, str | None]:
    """The experts' own tp for an ep x ``tp`` candidate, as ``models.train`` lays them out (``layout_model``):
    ``((glob, ExpertTensorParallel()),)`` to add to its tp plan where ``ExpertTensorParallel`` reads the experts'
    ``d`` and ``f`` from their parameters' shapes (those of the first module matching ``experts``) and ``tp``
    divides ``f``, and no note; else ``()`` (the experts whole over tp) and the note saying why. The same with the
    sequence over cp (the experts' all-reduces over tp on each cp device's part of the dispatched buffers), and for
    the experts of the scanned stack ``stack`` (its dotted path): their ``[L, E, d, f]`` read past the layer axis,
    cut on ``E`` over ep and ``f`` over tp as a tp style on a scanned module is."""
    if experts is None or tp == 1:
        return (), None
    shapes, first = {}, None
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        mod, name = param_module(path_str(kp))
        if fnmatch.fnmatchcase(mod, experts) and first in (None, mod):
            first = mod
            shapes[name] = tuple(x.shape[1:] if stack is not None and (mod + ".").startswith(stack + ".") else x.shape)
    style = ExpertTensorParallel()
    try:
        _, f = style.dims(first or experts, shapes)
    except ValueError as e:
        return (), f"the experts {experts!r} kept whole over tp={tp} (no ExpertTensorParallel): {e}"
    if f % tp:
        return (), f"the experts {experts!r} kept whole over tp={tp}: tp does not divide their hidden f={f}"
    return ((experts, style),), None


def _rest(n: int, plan: Any, units: tuple[str, ...], experts_tp=None, **dims) -> list[Layout]:
    out = []
    for dp, fsdp, tp in factorizations(n):
        tp_plan = tp_plan_for(plan, False, tp) if tp > 1 else None
        if tp > 1 and tp_plan is None:
            continue
        extra, note = experts_tp(tp) if experts_tp is not None and tp > 1 else ((), None)
        for raf in (True, False) if fsdp > 1 else (True,):
            out.append(Layout(dp=dp, fsdp=fsdp, tp=tp, reshard_after_forward=raf, units=units if fsdp > 1 else (),
                              tp_plan=tp_plan and tp_plan + extra, note=note, **dims))
    return out


def context_expert_layouts(n: int, plan: Any, units: tuple[str, ...], params: Any, batch: Any,
                           stack: tuple[str, int] | None = None) -> list[Layout]:
    """The cp, ep and cp x ep layouts ``auto_layout`` weighs on ``n`` devices, then the pipelined ones
    (``pipelined``; see the module doc). ``stack``: the model's scanned stack (``_pipeline.scanned_stack``), whose
    experts' parameters carry the layer axis first."""
    seq = sequence_of(batch)
    cps = [1] + [cp for cp in _divisors(n) if seq is not None and seq % cp == 0]
    got = experts_of(params, stack[0] if stack else None)
    eps = [1] + ([ep for ep in _divisors(n) if got[1] % ep == 0] if got is not None else [])
    out = []
    for ep in eps:
        for cp in cps:
            if cp * ep > 1 and n % (cp * ep) == 0:
                dims = dict(cp=cp, ep=ep, ep_plan=((got[0], ExpertParallel()),) if ep > 1 else None)
                etp = (lambda tp: expert_tp(params, got[0], tp, stack[0] if stack else None)) if ep > 1 else None
                out += _rest(n // (cp * ep), plan, units, etp, **dims)
    rows = jax.tree.leaves(batch)[0].shape[0] if jax.tree.leaves(batch) else 0
    return out + pipelined(n, units, params, rows, cps[1:], eps[1:], got[0] if got is not None else None, plan)


def pipelined(n: int, units: tuple[str, ...], params: Any, rows: int, cps: list[int], eps: list[int],
              experts: str | None, plan: Any = None) -> list[Layout]:
    """The pp x cp and pp x ep (x tp) layouts on ``n`` devices for a batch of ``rows`` (see the module doc):
    ``cps`` / ``eps`` the cuts the sequence / the experts allow, ``experts`` the experts' glob, ``plan`` the
    tensor-parallel plan (``auto_layout``'s: the stages' tp under cp or ep, where it has one for the tp size)."""
    if len(units) != 1 or not units_alike(params, units[0]):  # units of other parameters: refused by pipeline
        return []
    n_units = count_units(params, units[0])
    out = []
    for pp in [d for d in _divisors(n) if d <= n_units]:
        cuts = [dict(cp=cp) for cp in cps] + [dict(ep=ep, ep_plan=((experts, ExpertParallel()),)) for ep in eps]
        for dims in cuts:
            cut = dims.get("cp", 1) * dims.get("ep", 1)
            if n % (pp * cut):
                continue
            for dp, fsdp, tp in factorizations(n // (pp * cut)):
                n_data = dp * fsdp * dims.get("ep", 1)
                # tp stages: the attention projections over tp, the sequence over cp (the ring manual over tp
                # too: each device its heads) or the experts over ep
                tp_plan = tp_plan_for(plan, False, tp) if tp > 1 else None
                if (tp > 1 and tp_plan is None) or rows % n_data:
                    continue
                extra, note = expert_tp(params, experts, tp) if tp_plan and dims.get("ep", 1) > 1 else ((), None)
                for m in (pp, 2 * pp):
                    if (rows // n_data) % m == 0:
                        out.append(Layout(pp=pp, dp=dp, fsdp=fsdp, tp=tp, tp_plan=tp_plan and tp_plan + extra,
                                          units=units, reshard_after_forward=fsdp == 1, microbatches=m, note=note,
                                          **dims))
    return out


def _routes(call: str, ep_plan: tuple | None) -> bool:
    """Whether module ``call`` encloses an expert-parallel module of ``ep_plan`` (its router, run on the gathered
    sequence under cp x ep)."""
    names = call.split(".")
    return any(len(names) < len(glob.split(".")) and all(
        fnmatch.fnmatchcase(n, g) for n, g in zip(names, glob.split("."))) for glob, _ in ep_plan or ())


def gather_only(notes: dict, layout: Layout) -> bool:
    """Whether ``auto_layout`` leaves ``layout`` out: a cp layout with fsdp or tp (unpipelined), or with tp in
    its stages (pipelined), of a model whose attention a traced cp layout found all run on the gathered sequence
    (``notes["gather"]``), whose every cp rank computes it whole, so only dp x cp (x ep) are weighed
    (``GATHER_ONLY``): each cp candidate traces the step several times to find those modules; and under tp in the
    stages GSPMD partitions such attention over cp, which the pipeline's table does not count (its ``uncounted``:
    ``check_pipelined_attention`` refuses it)."""
    return bool(notes.get("gather")) and layout.cp > 1 and (layout.tp > 1 or (layout.pp == 1 and layout.fsdp > 1))


def check_attention(comm: dict, layout: Layout, where: str) -> list[dict]:
    """A cp layout's step must run some attention across the cut: a call the cp step recognizes (ring or
    all-gather of K/V) or a module's own attention run on the gathered sequence (not an experts router's:
    ``_routes``); a model with none is refused with the reason (``comm``: the step's table). Returns those rows."""
    if layout.cp == 1:
        return []
    rows = [r for r in comm.get("attention", ()) if r["method"] != "experts cut"
            and not (r["method"] == "gather sequence" and _routes(r["call"], layout.ep_plan))]
    if not rows:
        raise ValueError(f"{where}: layout {layout.name!r}: the model calls no attention the cp step recognizes "
                         "(jax.nn.dot_product_attention, flax's dot_product_attention) and computes none of its own "
                         "(no [.., T, T] scores inside a module): cutting its sequence runs no attention across the "
                         "cut; context parallelism is weighed for models with attention.")
    return rows



def check_pipelined_attention(comm: dict, layout: Layout, where: str) -> None:
    """A pipelined cp layout's stages must run some attention across the cut (``comm``: the pipeline's table, its
    ``cp`` part): a call the cp step recognizes (the ring, or the all-gather of K/V) or a module's own einsum
    attention run on the gathered sequence (whole on every cp rank: ``cp_work`` counts it so, and the table holds
    its gathers); a model with none is refused with the reason. A table that says it leaves collectives over cp
    out (``uncounted``: under tp in the stages, the projections run whole over tp where the model has fewer heads
    than tp, or a unit's own attention) is refused too, with what it leaves out: such a layout is not priced from
    a table that is not its program's."""
    if layout.cp > 1 and comm.get("uncounted"):  # its table would not be its program's: not priced from it
        raise ValueError(f"{where}: layout {layout.name!r}: not weighed, its table leaving collectives out (it would "
                         "be priced below what its program moves; the pp x cp layouts without tp in the stages are "
                         f"weighed): {comm['uncounted']}")
    if layout.cp > 1 and not (comm.get("cp") or {}).get("calls"):
        raise ValueError(f"{where}: layout {layout.name!r}: the pipeline's stages call no attention the cp step "
                         "recognizes (jax.nn.dot_product_attention, flax's dot_product_attention) and compute none "
                         "of their own (no [.., T, T] scores inside a module): cutting the sequence runs no "
                         "attention across the cut; cp under a pipeline is weighed for models with attention.")


def uncut(micro: Any, cp: int) -> Any:
    """A device's micro-batch (shape structs, its sequence cut over ``cp``) with the whole sequence."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], x.shape[1] * cp, *x.shape[2:]) if x.ndim >= 2
                                                       else x.shape, x.dtype), micro)


def _rank_share(rec: dict) -> float:
    """The share of one attention call's ``[T, T]`` work (the one-device program's) a cp rank computes: ``1 / cp``
    for the all-gather of K/V and the ring without a mask (its ``T / cp`` queries against all ``T`` keys), the
    busiest rank's (query piece, key piece) blocks over all of them for the causal ring (the pairs wholly in the
    future skipped: ``causal_work``; ``5 / 8`` of ``1 / cp`` at zigzag cp=2), and all of it for a module run on the
    gathered sequence (whole on every cp rank)."""
    n = rec["n"]
    if rec["method"] == "gather sequence":
        return 1.0
    if rec["method"].startswith("ring") and rec.get("causal"):
        layout = "zigzag" if "zigzag" in rec["method"] else "contiguous"
        try:
            blocks = causal_work(rec["q"][0][1], n, layout=layout)["blocks"]
        except ValueError:  # a local sequence not cut in two pieces: every block counted
            return 1.0 / n
        return float(blocks.max()) / (4 * n * n)  # each rank: 2 query pieces x 2 key pieces of each of n ranks
    return 1.0 / n


def cp_work(cut: tuple, whole: tuple, cp: int, rows: list[dict]) -> tuple[float, float]:
    """``(flops, bytes)`` of a cp layout's device (see the module doc) from the one-device program's at the
    device's rows: ``cut`` at its ``T / cp`` positions, ``whole`` at all ``T`` (``uncut``). Each is ``a t + b t^2``
    in the positions ``t`` (the ``b t^2`` attention's ``[t, t]`` scores); the two give the whole sequence's
    quadratic part ``Q = (whole - cp cut) / (1 - 1 / cp)`` and the rest ``whole - Q``. A rank computes the rest
    on its ``T / cp`` positions (``(whole - Q) / cp``) and ``Q`` times the mean share of its attention calls
    (``rows``, the step's table: ``_rank_share``): ``whole / cp`` for the all-gather of K/V and the unmasked
    ring, less for the causal ring's skipped blocks, ``Q`` whole on every rank for a module run on the gathered
    sequence."""
    share = sum(_rank_share(r) for r in rows) / len(rows)
    out = []
    for c, w in zip(cut[:2], whole[:2]):
        q = min(max((w - cp * c) / (1 - 1 / cp), 0.0), w)
        out.append((w - q) / cp + share * q)
    return out[0], out[1]
