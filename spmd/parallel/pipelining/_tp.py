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

__all__ = ["StageHooks", "tp_placements", "stage_hooks", "map_tp_aware", "reduce_tp_aware", "unwrap_layouts"]


def unwrap_layouts(model, mesh, where: str) -> tuple[Any, str | None, Any]:
    """``(plain model, the fsdp shard dim or None, the tp layout (a ParallelModule) or None)`` of
    ``pipeline``'s model: ``fully_shard(model, mesh=mesh['fsdp'])`` (or HSDP's ``mesh['dp', 'fsdp']``; no
    mp_policy), ``parallelize_module(model, mesh['tp'], plan)``, or both."""
    from spmd.parallel.styles._transforms import ParallelModule

    if not isinstance(model, ParallelModule):
        return model, None, None
    if model.remat is not None:
        raise ValueError(f"{where}: model={model!r}: activation checkpointing under a pipeline is not offered; "
                         "pipeline the model without activation_checkpointing.")
    if model.ep is not None:
        key, style = model.ep.plan[0]
        ep = model.ep.mesh_dim
        raise ValueError(f"{where}: model={model!r}: {style!r} on {key!r} (a plan on {ep!r}) under a pipeline is not "
                         f"offered: the pipeline's stages carry each stacked unit parameter's tp cut only (not its "
                         f"experts cut over {ep!r}), average every stage gradient over the data dims (an expert's "
                         f"gradient over {ep!r} is its own: divided by {ep!r}, never averaged with another expert's), "
                         f"install the tp styles only (the experts module would run unstyled) and count no "
                         f"all-to-all per tick in their table. Pipeline the model without the {ep!r} plan, or leave "
                         f"pp out and run {type(style).__name__} with make_train_step (with dp / fsdp / tp / cp).")
    if model.fsdp is not None and model.fsdp.mp_policy:
        raise ValueError(f"{where}: model={model!r}: mixed precision under a pipeline is not offered; leave mp_policy "
                         "out of fully_shard.")
    if model.mesh != mesh.root_mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not cut from the mesh the model was sharded on "
                         f"({model.mesh!r}); cut every sub-mesh from one mesh.")
    laid = {model.tp.mesh_dim} if model.tp else set()
    laid |= {model.fsdp.shard_dim, *model.fsdp.replicate_dims} if model.fsdp else set()
    if laid & set(mesh.mesh_dim_names):
        raise ValueError(f"{where}: mesh={mesh!r} holds the dim {sorted(laid & set(mesh.mesh_dim_names))[0]!r} the "
                         "model is laid out on; pipeline over another dim of the mesh (mesh['pp']).")
    return model.module, (model.fsdp.shard_dim if model.fsdp else None), (model if model.tp else None)


def user_plan(pm, lay) -> ParamPlan:
    """The ``ParamPlan`` of the model's own tree under its tp layout (``build_plan``), built once per layout."""
    from spmd.parallel.styles._transforms import build_plan

    if getattr(lay, "_tp_user_plan", None) is None:
        shapes = jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths])
        lay._tp_user_plan = build_plan(pm.tp, shapes)
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
        p = plan.entry(f"{lay.units[0]}/{rel}").placements[ti]
        stages[rel] = Shard(p.dim + 1) if isinstance(p, Shard) else Replicate()
    rest = {p: plan.entry(p).placements[ti] for p in lay.rest}
    return stages, rest


class StageHooks(Hooks):
    """The tp hooks of a pipeline's region: ``Hooks`` on the model's full plan, with a unit run on its own
    named by the first unit's path."""

    @contextlib.contextmanager
    def unit(self, path: str):
        saved, self.prefix = self.prefix, tuple(path.split("/"))
        try:
            yield
        finally:
            self.prefix = saved


def stage_hooks(pm, lay) -> StageHooks | None:
    if pm.tp is None:
        return None
    return StageHooks(pm.tp, user_plan(pm, lay), gather_units=False, whole_heads=unit_whole_heads(pm, lay))


def unit_whole_heads(pm, lay) -> dict:
    """``{module: heads}``: the units' projections that run whole over tp (fewer heads than tp;
    ``spmd.parallel.step._heads``), read once per stage layout from one unit's trace (which also refuses a cut
    that would split a head), for every unit's module names."""
    got = lay.__dict__.get("_whole_heads")
    if got is None:
        from spmd.parallel.step._heads import head_splits, whole_over_tp

        hooks = StageHooks(pm.tp, user_plan(pm, lay), gather_units=False)
        unit = [lay.unit_shapes[rel] for rel in lay.rel]
        with hooks.installed(), hooks.unit(lay.units[0]):
            jaxpr = jax.make_jaxpr(lambda ls, x, sd: lay.apply_unit(ls, x, sd))(unit, lay.act,
                                                                               lay.calls.side_shapes).jaxpr
        first = lay.units[0].replace("/", ".") + "."
        got = {}
        for fqn, heads in whole_over_tp(head_splits(jaxpr)).items():
            for u in lay.units:
                got[u.replace("/", ".") + "." + fqn[len(first):] if fqn.startswith(first) else fqn] = heads
        lay.__dict__["_whole_heads"] = got
    return got


def map_tp_aware(hooks: StageHooks | None, entries: Sequence, leaves: Sequence[Any], fn) -> list:
    """``fn(i, leaf)`` of each leaf (``entries``: their stored plan entries), the tp-cut ones in a region manual
    over tp too (each device its tp block: a collective over a data dim never sees a tp-sharded operand)."""
    leaves = list(leaves)
    if hooks is None:
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
    if hooks is None:
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


def segment_records(pm, lay, loss_fn, mb) -> dict[str, list] | None:
    """The styled calls of one micro-batch by segment, traced (shapes only) with the region's hooks:
    ``pre`` (before the first unit: the embedding), ``unit`` (one unit), ``post`` (after the last: the
    head); ``None`` without tp."""
    hooks = stage_hooks(pm, lay)
    if hooks is None:
        return None
    rest = {p: lay.shapes[p] for p in lay.rest}
    unit = [lay.unit_shapes[rel] for rel in lay.rel]
    out = {}
    for name, f, args in (("pre", lambda r, b: lay.pre(loss_fn, r, b), (rest, mb)),
                          ("unit", lambda ls, x, sd: lay.apply_unit(ls, x, sd), (unit, lay.act, lay.calls.side_shapes)),
                          ("post", lambda r, b, h: lay.post(loss_fn, r, b, h), (rest, mb, lay.act))):
        hooks.records = []
        with hooks.installed(), (hooks.unit(lay.units[0]) if name == "unit" else contextlib.nullcontext()):
            jax.eval_shape(f, *args)
        out[name] = list(hooks.records)
    for k in range(1, len(lay.calls.kinds)):  # the table counts one unit's styled calls for every unit
        hooks.records = []
        with hooks.installed(), hooks.unit(lay.units[lay.calls.kinds[k]]):
            jax.eval_shape(lambda ls, x, sd: lay.apply_unit(ls, x, sd, kind=k), unit, lay.act, lay.calls.side_shapes)
        if _calls_of(hooks.records) != _calls_of(out["unit"]):
            a, b = lay.calls.kinds[0], lay.calls.kinds[k]
            raise ValueError(f"pipeline: units {lay.units[a]!r} and {lay.units[b]!r} differ "
                             f"({lay.calls.difference(a, b)}) and make other tensor-parallel calls; tp stages of "
                             "units that differ are offered where their styled calls are the same: match only "
                             "identical blocks with units=, or pipeline without tp.")
    out["post"] = out["post"][len(out["pre"]):]  # post runs the pre-unit code again, dead (its units return h)
    return out
