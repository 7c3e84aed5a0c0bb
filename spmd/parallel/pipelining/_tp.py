"""Tensor parallelism inside pipeline stages: ``pipeline(parallelize_module(model, mesh["tp"], plan), mesh["pp"])``.

The order is the one ``fully_shard`` takes: lay the model out over tp first, then pipeline it (the other
order, ``parallelize_module(pipeline(...))``, is refused naming this one). The step stays the pipeline's own
(``spmd.parallel.pipelining._step``), with three changes:

- **the region**: its ``shard_map`` is manual over ``pp`` and the data dims and *automatic* over ``tp``, as
  ``make_train_step``'s region is over tp: each rank still switches on its own action per tick, and inside
  every branch the model runs in global view over tp;
- **the hooks**: the same ``Hooks`` ``make_train_step`` installs (``spmd.parallel.styles._hooks``) are installed
  around the whole region trace, so every styled module call (the first stage's embedding, each unit's
  column / row-parallel projections, the last stage's tied head) runs in its own region manual over tp with
  every tp collective of its style written out (Megatron's ``f`` / ``g``; sequence parallelism's gathers and
  scatters). A unit runs as a module of its own (``UnitCalls.apply_unit``); ``StageHooks.unit`` names it by the
  first unit's path for the duration, so the plan's keys (``block_*.fc``) find it and the user's full-model
  ``ParamPlan`` (``build_plan`` of the tp layout) gives its parameters' tp placements;
- **the parameters**: each stacked stage parameter carries its unit parameter's tp cut on the same dim,
  one later (the stacked dim is first: ``{pp: Shard(0), tp: Shard(d + 1)}``); the rest (embeddings, head)
  carry their own tp cut, replicated over pp. Their gradients leave the region cut the same way, summed over
  pp and the data dims in regions manual over tp too (a data-dim collective on a tp-cut operand would make
  XLA gather it over tp first).

**The table** (``spmd.parallel.pipelining._comm.tp_terms``): the styled calls of one micro-batch are traced
by segment (``segment_records``: the pre-unit code, one unit, the post-unit code), each call's terms as
``spmd.parallel.cost._comm`` writes them, forward and backward apart; a branch's terms follow from what it runs
(``F``: the chunk's forward; ``B``: the recomputed forward and the backward), and the program's are the sum
over ticks of the branches some rank runs then. The activation crosses a stage boundary cut over tp when
the unit's last styled call leaves it cut (sequence parallelism): ``1 / tp`` of the permute bytes.

With ``fully_shard`` too (``pipeline(fully_shard(parallelize_module(model, mesh["tp"], plan),
mesh=mesh["fsdp"]), mesh["pp"])``), each stacked stage parameter is cut over fsdp on another dim than its
tp cut, gathered once per step and its gradient reduce-scattered once, both in regions manual over tp
(``map_tp_aware``). A checkpoint (``PipelineModule.unstack_state``) holds the units whole over tp.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
from jax import lax

from placements import Placement, Replicate, Shard
from spmd.parallel.styles._hooks import Hooks
from spmd.parallel.plan._param_plan import ParamPlan

__all__ = ["StageHooks", "tp_placements", "ep_placements", "stage_hooks", "map_tp_aware", "reduce_tp_aware", "unwrap_layouts",
           "local_unit", "on_ep", "refuse_sliced_heads"]


def unwrap_layouts(model, mesh, where: str) -> tuple[Any, str | None, Any, Any]:
    """``(plain model, the fsdp shard dim or None, the tp layout (a ParallelModule) or None, the ep layout or
    None)`` of ``pipeline``'s model: ``fully_shard(model, mesh=mesh['fsdp'])`` (or HSDP's ``mesh['dp',
    'fsdp']``; no mp_policy), ``parallelize_module(model, mesh['tp'], plan)``, or both; or
    ``parallelize_module(model, mesh['ep'], {experts: ExpertParallel()})`` (with fully_shard and / or tp)."""
    from spmd.parallel.styles._transforms import ParallelModule

    if not isinstance(model, ParallelModule):
        return model, None, None, None
    if model.remat is not None:
        raise ValueError(f"{where}: model={model!r}: activation checkpointing under a pipeline is not offered; "
                         "pipeline the model without activation_checkpointing.")
    if model.fsdp is not None and model.fsdp.mp_policy:
        raise ValueError(f"{where}: model={model!r}: mixed precision under a pipeline is not offered; leave mp_policy "
                         "out of fully_shard.")
    if model.mesh != mesh.root_mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not cut from the mesh the model was sharded on "
                         f"({model.mesh!r}); cut every sub-mesh from one mesh.")
    laid = {model.tp.mesh_dim} if model.tp else set()
    laid |= {model.ep.mesh_dim} if model.ep else set()
    laid |= {model.fsdp.shard_dim, *model.fsdp.replicate_dims} if model.fsdp else set()
    if laid & set(mesh.mesh_dim_names):
        raise ValueError(f"{where}: mesh={mesh!r} holds the dim {sorted(laid & set(mesh.mesh_dim_names))[0]!r} the "
                         "model is laid out on; pipeline over another dim of the mesh (mesh['pp']).")
    return (model.module, (model.fsdp.shard_dim if model.fsdp else None), (model if model.tp else None),
            (model if model.ep else None))


def user_plan(pm, lay) -> ParamPlan:
    """The ``ParamPlan`` of the model's own tree under its tp layout (``build_plan``), built once per layout."""
    from spmd.parallel.styles._transforms import build_plan

    if getattr(lay, "_tp_user_plan", None) is None:
        shapes = jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths])
        stacked = {f"{lay.scanned}/{r}": (lay.scanned, a) for r, a in lay.axis.items()}  # a scanned stack's
        lay._tp_user_plan = build_plan(pm.tp or pm.ep, shapes, stacked)
    return lay._tp_user_plan


def tp_placements(pm, lay) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """``({stage rel: tp placement of the stacked parameter}, {rest path: tp placement})``; ``({}, {})``
    without tp."""
    if pm.tp is None:
        return {}, {}
    plan = user_plan(pm, lay)
    ti = plan.mesh_dim_names.index(pm.tp.tp.mesh_dim)
    stages = {}
    for rel in lay.rel:
        p = plan.entry(f"{lay.module_of(0)}/{rel}").placements[ti]
        d = p.dim - (lay.scanned is not None and p.dim > lay.axis[rel]) if isinstance(p, Shard) else None  # a layer's
        stages[rel] = Shard(d + 1) if d is not None else Replicate()
    rest = {p: plan.entry(p).placements[ti] for p in lay.rest}
    return stages, rest


class StageHooks(Hooks):
    """The tp hooks of a pipeline's region: ``Hooks`` on the model's full plan, with a unit run on its own
    named by the first unit's path. A module left out of a sequence-parallel plan runs as GSPMD lays it out (a
    stage sees a part of the model: the plan's blocks are not read off it)."""

    whole_outside_blocks = False

    @contextlib.contextmanager
    def unit(self, path: str):
        saved, self.prefix = self.prefix, tuple(path.split("/"))
        try:
            yield
        finally:
            self.prefix = saved


def ep_placements(pm, lay) -> dict[str, Placement]:
    """``{stage rel: ep placement of the stacked parameter}`` (a unit's experts cut ``Shard(d)`` over ep: the
    stacked one ``Shard(d + 1)``), only the ep-cut ones; ``{}`` without an ep plan. A parameter outside the units
    that the ep plan cuts is refused (its experts module would run outside every stage's hooks)."""
    if pm.ep is None:
        return {}
    plan = user_plan(pm, lay)
    ei = plan.mesh_dim_names.index(pm.ep.ep.mesh_dim)
    for p in lay.rest:
        if isinstance(plan.entry(p).placements[ei], Shard):
            raise ValueError(f"pipeline: parameter {p!r} is cut over {pm.ep.ep.mesh_dim!r} by the ep plan, outside the "
                             f"units ({pm.units!r}); a pipeline runs expert-parallel modules inside its units only: "
                             "put the experts in the repeated blocks, or leave pp out.")
    out = {}
    for rel in lay.rel:  # a scanned stack's: its entry's cut, less its layer axis where before it
        p = plan.entry(f"{lay.module_of(0)}/{rel}").placements[ei]
        if isinstance(p, Shard):
            out[rel] = Shard(p.dim - (lay.scanned is not None and p.dim > lay.axis[rel]) + 1)
    return out


def stage_hooks(pm, lay) -> StageHooks | None:
    """The hooks of the pipeline's region: the tp styles and / or the ep styles (``ExpertParallel``) of the
    layout the model was pipelined with, a unit named by its kind's first unit; None without either."""
    if pm.tp is None and pm.ep is None:
        return None
    return StageHooks(pm.tp or pm.ep, user_plan(pm, lay), gather_units=False,
                      whole_heads=unit_whole_heads(pm, lay) if pm.tp else None)


def unit_whole_heads(pm, lay) -> dict:
    """``{module: heads}``: the units' projections that run whole over tp (fewer heads than tp;
    ``spmd.parallel.step._heads``), read from one unit's trace (which also refuses a cut that would split a head)
    once per stage layout and shapes (``StageLayout.traced``), for every unit's module names."""
    key = ("tp whole heads", lay.act, tuple(lay.calls.side_shapes), pm.tp.tp.mesh_dim, pm.mesh.size(pm.tp.tp.mesh_dim))
    return dict(lay.traced(key, lambda: _find_whole_heads(pm, lay)))


def _find_whole_heads(pm, lay) -> tuple:
    from spmd.parallel.step._heads import head_splits, whole_over_tp

    hooks = StageHooks(pm.tp, user_plan(pm, lay), gather_units=False)
    with hooks.installed(), hooks.unit(lay.module_of(0)):  # with ep too: the unit as a rank of ep runs it
        jaxpr = jax.make_jaxpr(on_ep(pm, lambda ls, x, sd: lay.apply_unit(ls, x, sd)))(
            local_unit(pm, lay), lay.act, lay.calls.side_shapes).jaxpr
    first = lay.module_of(0).replace("/", ".") + "."
    got = {}
    for fqn, heads in whole_over_tp(head_splits(jaxpr)).items():
        for u in ([lay.scanned] if lay.scanned else lay.units):
            got[u.replace("/", ".") + "." + fqn[len(first):] if fqn.startswith(first) else fqn] = heads
    return tuple(got.items())


def map_tp_aware(hooks: StageHooks | None, entries: Sequence, leaves: Sequence[Any], fn) -> list:
    """``fn(i, leaf)`` of each leaf (``entries``: their stored plan entries), the tp-cut ones in a region manual
    over tp too (each device its tp block: a collective over a data dim never sees a tp-sharded operand)."""
    leaves = list(leaves)
    if hooks is None or hooks.ti is None:
        return [fn(i, x) for i, x in enumerate(leaves)]
    cut = [i for i, e in enumerate(entries) if isinstance(e.placements[hooks.ti], Shard)]
    out = [x if i in cut else fn(i, x) for i, x in enumerate(leaves)]
    if cut:
        ys = hooks.island(lambda *xs: tuple(fn(i, x) for i, x in zip(cut, xs)), [entries[i] for i in cut],
                          [leaves[i] for i in cut])
        for i, y in zip(cut, ys):
            out[i] = y
    return out


def reduce_tp_aware(hooks: StageHooks | None, entries: Sequence, leaves: Sequence[Any], axes: tuple[str, ...],
                    op=lax.psum) -> list:
    """``op(leaf, axes)`` of each leaf (``entries``: its stored plan entries): the tp-cut ones in a region
    manual over tp too, so each device reduces its tp block; the others where they are."""
    leaves = list(leaves)
    if not axes or not leaves:
        return leaves
    if hooks is None or hooks.ti is None:
        return list(op(leaves, axes))
    ti = hooks.ti
    cut = [i for i, e in enumerate(entries) if isinstance(e.placements[ti], Shard)]
    whole = [i for i in range(len(leaves)) if i not in cut]
    out = list(leaves)
    if cut:
        red = hooks.island(lambda *xs: tuple(op(list(xs), axes)), [entries[i] for i in cut], [leaves[i] for i in cut])
        for i, y in zip(cut, red):
            out[i] = y
    if whole:
        for i, y in zip(whole, op([leaves[i] for i in whole], axes)):
            out[i] = y
    return out


def _calls_of(records: list) -> list:
    """What the table reads of a unit's styled calls, but the module names (each unit's own)."""
    return [{k: v for k, v in r.items() if k not in ("module", "input_id")} for r in records]


def local_unit(pm, lay) -> list:
    """One unit's parameter shapes (``lay.rel`` order), the experts as a rank holds them (``E / ep``) with an ep
    plan, traced in a region manual over ep (``on_ep``)."""
    unit = [lay.unit_shapes[rel] for rel in lay.rel]
    if pm.ep is None:
        return unit
    n_ep, eps = pm.mesh.size(pm.ep.ep.mesh_dim), ep_placements(pm, lay)
    return [jax.ShapeDtypeStruct(tuple(n // n_ep if rel in eps and i == eps[rel].dim - 1 else n
                                       for i, n in enumerate(x.shape)), x.dtype) for rel, x in zip(lay.rel, unit)]


def on_ep(pm, f):
    """``f`` (shapes as one device sees them) in a region manual over the ep dim, where its styled calls'
    all-to-alls are bound; ``f`` itself without an ep plan."""
    if pm.ep is None:
        return f
    from jax.sharding import PartitionSpec as P

    def run(*args):
        jax.shard_map(lambda *a: (f(*a), jax.numpy.zeros(()))[1], mesh=pm.mesh.jax_mesh,
                      in_specs=jax.tree.map(lambda _: P(), args), out_specs=P(),
                      axis_names={pm.ep.ep.mesh_dim}, check_vma=False)(*args)
        return 0

    return run


def segment_records(pm, lay, loss_fn, mb, unit_context=contextlib.nullcontext) -> dict[str, list] | None:
    """The styled calls of one micro-batch by segment, traced (shapes only) with the region's hooks:
    ``pre`` (before the first unit: the embedding), ``unit`` (one unit), ``post`` (after the last: the
    head), the tp calls; ``ep``: the calls styled on the ep dim, by the same segments; ``None`` without tp
    or ep. ``unit_context()``: around the unit's trace (under cp, its modules run on the gathered sequence as the
    stages run them, ``pipelining._cp.gathered_context``: a tp style inside one takes the whole sequence)."""
    hooks = stage_hooks(pm, lay)
    if hooks is None:
        return None
    rest = {p: lay.shapes[p] for p in lay.rest}
    unit = local_unit(pm, lay)
    out, ep = {}, {}
    for name, f, args in (("pre", lambda r, b: lay.pre(loss_fn, r, b), (rest, mb)),
                          ("unit", lambda ls, x, sd: lay.apply_unit(ls, x, sd), (unit, lay.act, lay.calls.side_shapes)),
                          ("post", lambda r, b, h: lay.post(loss_fn, r, b, h), (rest, mb, lay.act))):
        hooks.records, hooks.ep_records = [], []
        with hooks.installed(), (hooks.unit(lay.module_of(0)) if name == "unit" else contextlib.nullcontext()), \
                (unit_context() if name == "unit" else contextlib.nullcontext()):
            jax.eval_shape(on_ep(pm, f), *args)
        out[name], ep[name] = list(hooks.records), list(hooks.ep_records)
    for r in out["unit"] if lay.scanned else ():  # one layer of a scanned stack: its calls once (not L times)
        r["calls"] = 1
    for k in range(1, len(lay.calls.kinds)):  # the table counts one unit's styled calls for every unit
        hooks.records = []
        with hooks.installed(), hooks.unit(lay.module_of(lay.calls.kinds[k])):
            jax.eval_shape(lambda ls, x, sd: lay.apply_unit(ls, x, sd, kind=k), unit, lay.act, lay.calls.side_shapes)
        if _calls_of(hooks.records) != _calls_of(out["unit"]):
            a, b = lay.calls.kinds[0], lay.calls.kinds[k]
            raise ValueError(f"pipeline: units {lay.units[a]!r} and {lay.units[b]!r} differ "
                             f"({lay.calls.difference(a, b)}) and make other tensor-parallel calls; tp stages of "
                             "units that differ are offered where their styled calls are the same: match only "
                             "identical blocks with units=, or pipeline without tp.")
    out["dropped"] = (dropped_in_backward(pm, lay, hooks, unit, unit_context) if pm.tp is not None and pm.ep is None
                      else None)
    out["post"] = out["post"][len(out["pre"]):]  # post runs the pre-unit code again, dead (its units return h)
    ep["post"] = ep["post"][len(ep["pre"]):]
    out["ep"] = ep  # the calls styled on the ep dim by segment (ExpertParallel's all-to-alls)
    return out


def _tp_collectives(jaxpr, axis: str) -> int:
    """How many collectives over ``axis`` ``jaxpr`` holds (its sub-jaxprs' too: the styled calls' regions)."""
    from spmd.parallel._jaxprs import sub_jaxprs

    n = 0
    for e in jaxpr.eqns:
        names = e.params.get("axes", e.params.get("axis_name"))
        names = names if isinstance(names, (tuple, list)) else (names,)
        n += axis in names and e.primitive.name not in ("axis_index", "pbroadcast")
        n += sum(_tp_collectives(sub, axis) for sub in sub_jaxprs(e))
    return n


def dropped_in_backward(pm, lay, hooks, unit, unit_context=contextlib.nullcontext) -> int:
    """How many tp collectives of one unit's forward its backward pass leaves dead when nothing reads the unit's
    output (a ``B`` on a stage that is not the last: the recomputed output feeds only the unused primal), read off the
    unit's own vjp: its jaxpr returning the output and the cotangents against the same with the output's uses
    dropped (``dce_jaxpr``, as XLA drops them). A residual block ending in a row-parallel call (``x + out(h)``): its
    reduction, 1; an mlp after it reads the sum in its backward: 0."""
    from jax._src.interpreters import partial_eval as pe

    def fwd_bwd(ls, x, sd, g):
        out, vjp = jax.vjp(lambda ls, x: lay.apply_unit(ls, x, sd), ls, x)
        return out, vjp(g)

    with hooks.installed(), hooks.unit(lay.module_of(0)), unit_context():
        g = jax.eval_shape(lambda ls, x, sd: lay.apply_unit(ls, x, sd), unit, lay.act, lay.calls.side_shapes)
        jaxpr = jax.make_jaxpr(fwd_bwd)(unit, lay.act, lay.calls.side_shapes, g).jaxpr
    n_out = len(jax.tree.leaves(g))
    used = [False] * n_out + [True] * (len(jaxpr.outvars) - n_out)
    axis = pm.tp.tp.mesh_dim
    return _tp_collectives(jaxpr, axis) - _tp_collectives(pe.dce_jaxpr(jaxpr, used)[0], axis)


def refuse_sliced_heads(pm, lay) -> None:
    """Raise ``ValueError`` where a unit slices the heads of a column-parallel projection's output (a fused ``qkv``
    split into q, k and v) with tp in the stages: GSPMD lays each piece out with collective-permutes across the heads
    inside the branches only some ranks run, which hung at run time on XLA:CPU (pp=2, tp=2: 16 permutes against the
    pipeline's 4, 2 of 4 devices at the rendezvous; pp=2, cp=2, tp=2: 4 of 8)."""
    if pm.tp is None:
        return
    from spmd.parallel.step._heads import sliced_heads

    key = ("tp sliced heads", lay.act, tuple(lay.calls.side_shapes), pm.tp.tp.mesh_dim)

    def find() -> tuple:
        hooks = StageHooks(pm.tp, user_plan(pm, lay), gather_units=False)
        with hooks.installed(), hooks.unit(lay.module_of(0)):
            jaxpr = jax.make_jaxpr(on_ep(pm, lambda ls, x, sd: lay.apply_unit(ls, x, sd)))(
                local_unit(pm, lay), lay.act, lay.calls.side_shapes).jaxpr
        return tuple(sliced_heads(jaxpr).items())

    found = lay.traced(key, find)
    if found:
        fqn, (feat, heads) = found[0]
        tp, n_tp = pm.tp.tp.mesh_dim, pm.mesh.size(pm.tp.tp.mesh_dim)
        raise ValueError(
            f"pipeline: unit {lay.module_of(0)!r} cuts {fqn!r} (ColwiseParallel) over {tp}={n_tp} and then slices its "
            f"{heads} heads ({feat} features) into pieces (a fused qkv split into q, k, v), with {tp!r} in the stages "
            f"(mesh dims {pm.mesh.mesh_dim_names}): GSPMD would move heads across {tp!r} with collective-permutes in "
            f"branches only some ranks run, which hang at run time. Give the unit separate q, k and v projections "
            f"(ColwiseParallel each), or leave {tp!r} out of the stages.")
