"""The training job's sharded-state parts: what ``metrics.json`` reports (``"memory"``, ``"collectives"``),
the logical parameters evaluation reads, and checkpoints that restore onto any other mesh and plan.

Every job state is a ``spmd.parallel.TrainState`` whose static ``plan`` (a ``ParamPlan``) says how its
arrays are laid out (DDP: every parameter ``Replicate``). A checkpoint stores each array as the state held
it (padded blocks, each process writing its own shards through orbax) and the meta records the layout
(``layout_meta(state.plan)``): the mesh, every parameter's logical shape and placements. Restoring reads
the arrays in their saved (padded) shapes, checks them against their checksums, trims the saved padding
and pads and places them for the new plan: ``fsdp=8 -> dp=8 -> fsdp=2 -> 1 device`` keeps every value bit
for bit.

A pipelined state (``spmd.parallel.pipeline``: the units' parameters stacked per stage) is saved as the
model's own tree (``checkpoint_state``: ``PipelineModule.unstack_state``, each unit's parameter cut over fsdp
as its stage was), so its checkpoint is one of the model's parameters like any other layout's and restores
onto any mesh; restoring onto a pipeline stacks it again (``PipelineModule.stack_state``):
``pp=2,fsdp=4 -> fsdp=8 -> 1 device`` and ``fsdp=8 -> pp=2,fsdp=4`` keep every value bit for bit.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements import Replicate, Shard
from spmd import DeviceMesh
from spmd.parallel import (ParamPlan, PipelineModule, Rule, TrainState, entry_sharding, executed_collectives,
                           map_like_params, path_str, plan_params, shard_params, unshard_tree)

__all__ = ["layout_meta", "restore_resharded", "restore_job_state", "memory_report", "collectives_report",
           "logical_params", "logical_state", "place_state", "checkpoint_state"]


def logical_params(params: Any, plan: ParamPlan | None, mesh: DeviceMesh) -> Any:
    """The parameters' logical (unpadded) values, replicated on ``mesh`` (what evaluation reads)."""
    return params if plan is None else unshard_tree(params, plan, mesh)


def logical_state(state: TrainState, mesh: DeviceMesh, optimizer) -> TrainState:
    """``state`` with its parameters and optimizer moments logical (unpadded) and replicated on ``mesh``."""
    plan = state.plan
    return TrainState(step=state.step, params=unshard_tree(state.params, plan, mesh),
                      opt_state=unshard_tree(state.opt_state, plan, mesh, optimizer=optimizer), plan=plan)


def place_state(state: TrainState, plan: ParamPlan, mesh: DeviceMesh, optimizer) -> TrainState:
    """A logical (replicated or host) state laid out by ``plan`` on ``mesh``: each parameter and its optimizer
    moments padded to the plan's chunks and placed."""
    plan.check_params(state.params, "place_state")
    return TrainState(step=jax.device_put(state.step, NamedSharding(mesh.jax_mesh, P())),
                      params=shard_params(state.params, plan, mesh),
                      opt_state=shard_params(state.opt_state, plan, mesh, optimizer=optimizer), plan=plan)


def layout_meta(plan: ParamPlan | None) -> dict:
    """What a checkpoint's meta records about the layout its arrays were saved in."""
    if plan is None:
        return {"mesh": None, "fsdp": None, "shapes": None}
    return {"mesh": dict(zip(plan.mesh_dim_names, plan.mesh_shape)), "fsdp": plan.fsdp,
            "shapes": {e.path: list(e.shape) for e in plan.entries},
            "placements": {e.path: [[p.dim] if isinstance(p, Shard) else [] for p in e.placements]
                           for e in plan.entries}}  # [d]: Shard(d), []: Replicate (tensor-parallel layouts too)


def _saved_plan(layout: dict | None, abstract_params: Any, where: str) -> ParamPlan | None:
    """The plan the checkpoint was saved with (None: saved whole, replicated)."""
    if not layout or not layout.get("mesh"):
        return None
    saved_shapes = {k: tuple(v) for k, v in layout["shapes"].items()}
    now = {path: tuple(np.shape(x)) for path, x in _paths(abstract_params)}
    if saved_shapes != now:
        diff = sorted(set(saved_shapes.items()) ^ set(now.items()), key=str)[:4]
        raise ValueError(
            f"{where}: the checkpoint holds parameters of other paths or shapes than the plan was built for "
            f"(first differences: {diff}); restore it with the model it was saved from, or train a new run."
        )
    rules = [Rule(re.escape(path), {n: Shard(p[0]) if p else Replicate() for n, p in zip(layout["mesh"], pl)})
             for path, pl in layout.get("placements", {}).items()]  # the saved placements, exactly
    return plan_params(abstract_params, layout["mesh"], rules, fsdp=layout["fsdp"] or "")


def _paths(tree: Any):
    return [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _abstract_params(plan: ParamPlan) -> Any:
    return jax.tree_util.tree_unflatten(plan.treedef,
                                        [jax.ShapeDtypeStruct(e.shape, np.dtype(e.dtype)) for e in plan.entries])


def restore_resharded(checkpointer, target: TrainState, mesh: DeviceMesh, optimizer,
                      step: int | None = None) -> tuple[TrainState, dict]:
    """The state saved at ``step`` laid out like ``target`` (a state or ``jax.eval_shape`` of one: its
    ``plan``, on ``mesh``), whatever mesh and plan it was saved with; and its meta.

    A checkpoint of other parameters is a ``ValueError``, never a silent reshape.
    """
    where = "restore_resharded"
    plan = target.plan
    if not isinstance(plan, ParamPlan):
        raise TypeError(f"{where}: target={type(target).__name__} must be a TrainState laid out by "
                        "spmd.parallel.init_train_state (its .plan says the layout to restore onto).")
    meta = checkpointer.restore_meta(step)
    abstract_params = _abstract_params(plan)
    saved = _saved_plan(meta.get("layout"), abstract_params, where)
    ref = saved if saved is not None else plan_params(abstract_params, dict(zip(plan.mesh_dim_names, plan.mesh_shape)),
                                                      [Rule(".*", {n: Replicate() for n in plan.mesh_dim_names})])
    rep = NamedSharding(mesh.jax_mesh, P())

    def saved_struct(x, e):  # the saved (padded) shape; sharded like the new plan where it divides, else replicated
        shape = ref.padded_shape(e)
        s = rep
        want = entry_sharding(plan.entry(e.path), mesh)
        if all(d % n == 0 for d, n in zip(shape, _shards_per_dim(want, len(shape)))):
            s = want
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=s)

    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), target.step.dtype, sharding=rep),
        params=map_like_params(ref, target.params, saved_struct),
        opt_state=map_like_params(ref, target.opt_state, saved_struct, optimizer=optimizer,
                                  other=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)),
        plan=ref,
    )
    state, meta = checkpointer.restore(abstract, step)
    logical = TrainState(step=state.step, params=unshard_tree(state.params, ref, mesh),
                         opt_state=unshard_tree(state.opt_state, ref, mesh, optimizer=optimizer), plan=ref)
    return place_state(logical, plan, mesh, optimizer), meta


def _shards_per_dim(sharding: NamedSharding, ndim: int) -> list[int]:
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    out = []
    for entry in list(sharding.spec) + [None] * (ndim - len(sharding.spec)):
        names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        out.append(int(np.prod([sizes[n] for n in names])) if names else 1)
    return out


def memory_report(state: TrainState, plan: ParamPlan | None = None, *, accum_steps: int = 1) -> dict:
    """Bytes of parameters + optimizer state on one device (read from the live arrays' shards on the
    first local device), the logical total, and the most gathered parameter bytes alive at once
    (``plan``: default ``state.plan``)."""
    plan = plan if plan is not None else state.plan
    dev = jax.local_devices()[0]
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state)) if hasattr(x, "addressable_shards")]
    per_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev)
    n_moments = sum(1 for x in jax.tree.leaves(state.opt_state) if x.ndim > 0) // max(len(plan.entries), 1)
    scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
    total = plan.total_bytes * (1 + n_moments) + scalars
    peak = plan.peak_gathered_bytes(accum_steps=accum_steps)
    return {"state_bytes_per_device": int(per_device), "state_bytes_total": int(total),
            "peak_gathered_bytes": int(peak)}


def collectives_report(train_step: Callable, state: TrainState, batch: Any) -> dict:
    """kind -> {"count", "bytes"} the compiled step executes per step (loop bodies times their trips)."""
    got = executed_collectives(train_step, state, batch)
    return {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in got.items() if v["count"]}


def checkpoint_state(state: TrainState, model: Any, optimizer) -> TrainState:
    """What the job's checkpoint holds of ``state``: a pipelined one (``model`` the ``PipelineModule``) as the
    model's own tree, laid out on its mesh (``PipelineModule.unstack_state``); any other as it is."""
    return model.unstack_state(state, optimizer) if isinstance(model, PipelineModule) else state


def restore_job_state(checkpointer, target: TrainState, plan: ParamPlan | None, mesh: DeviceMesh, optimizer,
                      model: Any = None, step: int | None = None) -> tuple[TrainState, dict]:
    """``restore_resharded`` for the training job onto ``target``'s layout (``plan``, when given, must be
    ``target.plan``). ``model``: the model as laid out; a ``PipelineModule`` restores the model's own tree
    (whatever layout saved it) and stacks it for the pipeline."""
    if plan is not None and plan != target.plan:
        raise ValueError("restore_job_state: plan is not the target state's plan; pass the state the programs built.")
    if not isinstance(model, PipelineModule):
        return restore_resharded(checkpointer, target, mesh, optimizer, step)
    saved = (checkpointer.restore_meta(step).get("layout") or {}).get("shapes") or {}
    if set(saved) == {e.path for e in target.plan.entries}:  # the stacked stages themselves, as this layout stores them
        return restore_resharded(checkpointer, target, mesh, optimizer, step)
    own = jax.eval_shape(lambda s: model.unstack_state(s, optimizer), target)
    state, meta = restore_resharded(checkpointer, own, mesh, optimizer, step)
    return model.stack_state(state, optimizer), meta
