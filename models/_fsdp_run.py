"""The training job's sharded parts: programs on an ``fsdp`` mesh, what ``metrics.json`` reports
(``"memory"``, ``"collectives"``), and checkpoints that restore onto any other mesh and plan.

A checkpoint stores each array as the state held it (padded blocks, each
process writing its own shards through orbax) and the meta records the layout
(``layout_meta``): the mesh and every parameter's logical shape. Restoring
reads the arrays in their saved (padded) shapes, checks them against their
checksums, trims the saved padding and pads and places them for the new plan:
``fsdp=8 -> dp=8 -> fsdp=2 -> 1 device`` keeps every value bit for bit.
"""

from __future__ import annotations

import re

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models._ddp import TrainState, init_train_state
from models._fsdp import make_fsdp_train_step, shard_train_state, state_shardings
from placements import Replicate, Shard
from spmd import DeviceMesh
from spmd.parallel import (ParamPlan, Rule, entry_sharding, executed_collectives, map_like_params, path_str, plan_params,
                           unshard_params)

__all__ = ["fsdp_parts", "layout_meta", "restore_resharded", "restore_job_state", "memory_report",
           "collectives_report", "logical_params"]


def fsdp_parts(model: Any, optimizer, loss: Callable, mesh: DeviceMesh, sample: Any, *, accum_steps: int = 1,
               regather: bool = True, rules=(), make_step: Callable | None = None
               ) -> tuple[ParamPlan, Callable, Callable, Any]:
    """``(plan, init, train_step, state_sharding)`` of a run on a mesh with an ``fsdp`` dim.

    ``loss(logits, batch) -> (loss, metrics)``; ``sample``: model inputs for the
    abstract init (shapes only). ``init(key, inputs)`` builds the step-0 state
    placed by the plan (the same values as the replicated init of a ``dp`` run
    with that key). ``rules``/``make_step(plan)``: other layouts' plan rules and train step (tensor parallel).
    """
    abstract = jax.eval_shape(model.init, jax.random.key(0), sample)["params"]
    plan = plan_params(abstract, mesh, rules, units=model.fsdp_units(), keep=model.fsdp_keep())
    step = make_step(plan) if make_step is not None else make_fsdp_train_step(
        lambda p, b, gather: loss(model.apply({"params": p}, b["inputs"], gather=gather), b),
        optimizer, mesh, plan, accum_steps=accum_steps, regather=regather)
    replicated = jax.jit(lambda key, x: init_train_state(model.init(key, x)["params"], optimizer),
                         out_shardings=NamedSharding(mesh.jax_mesh, P()))

    def init(key, x):
        return shard_train_state(replicated(key, x), plan, mesh, optimizer)

    abstract_state = jax.eval_shape(lambda: init_train_state(
        jax.tree.map(lambda e: jax.ShapeDtypeStruct(plan.padded_shape(e), e.dtype),
                     jax.tree_util.tree_unflatten(plan.treedef, list(plan.entries))), optimizer))
    return plan, init, step, state_shardings(abstract_state, plan, mesh, optimizer)


def logical_params(params: Any, plan: ParamPlan | None, mesh: DeviceMesh) -> Any:
    """The parameters' logical values, replicated on ``mesh`` (what evaluation reads)."""
    return params if plan is None else unshard_params(params, plan, mesh)


def layout_meta(plan: ParamPlan | None) -> dict:
    """What a checkpoint's meta records about the layout its arrays were saved in."""
    if plan is None:
        return {"mesh": None, "fsdp": None, "shapes": None}
    return {"mesh": dict(zip(plan.mesh_dim_names, plan.mesh_shape)), "fsdp": plan.fsdp,
            "shapes": {e.path: list(e.shape) for e in plan.entries},
            "placements": {e.path: [[p.dim] if isinstance(p, Shard) else [] for p in e.placements]
                           for e in plan.entries}}  # [d]: Shard(d), []: Replicate (tensor-parallel layouts too)


def _saved_plan(layout: dict | None, abstract_params: Any, units, where: str) -> ParamPlan | None:
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
    return plan_params(abstract_params, layout["mesh"], rules, fsdp=layout["fsdp"], units=units)


def _paths(tree: Any):
    return [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def restore_resharded(checkpointer, target: TrainState, plan: ParamPlan | None, mesh: DeviceMesh, optimizer,
                      abstract_params: Any, units=(), step: int | None = None) -> tuple[TrainState, dict]:
    """The state saved at ``step`` laid out by ``plan`` on ``mesh`` (``plan=None``: replicated, as a
    ``dp`` run holds it), whatever mesh and plan it was saved with; and its meta.

    ``abstract_params``: the model's logical parameter shapes. A checkpoint of
    other parameters is a ``ValueError``, never a silent reshape.
    """
    where = "restore_resharded"
    meta = checkpointer.restore_meta(step)
    saved = _saved_plan(meta.get("layout"), abstract_params, units, where)
    if plan is not None:
        plan.check_params(abstract_params, where)
    if saved is None and plan is None:
        return checkpointer.restore(target, step)
    rep = NamedSharding(mesh.jax_mesh, P())

    def saved_struct(x, e):  # the saved (padded) shape; sharded like the new plan where it divides, else replicated
        shape = saved.padded_shape(e) if saved is not None else e.shape
        s = rep
        if plan is not None:
            want = entry_sharding(plan.entry(e.path), mesh)
            if all(d % n == 0 for d, n in zip(shape, _shards_per_dim(want, len(shape)))):
                s = want
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=s)

    ref_plan = saved if saved is not None else plan
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), target.step.dtype, sharding=rep),
        params=map_like_params(ref_plan, target.params, saved_struct),
        opt_state=map_like_params(ref_plan, target.opt_state, saved_struct, optimizer=optimizer,
                                  other=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)),
    )
    state, meta = checkpointer.restore(abstract, step)
    if saved is not None:
        state = TrainState(step=state.step, params=unshard_params(state.params, saved, mesh),
                           opt_state=unshard_params(state.opt_state, saved, mesh, optimizer=optimizer))
    if plan is not None:
        state = shard_train_state(state, plan, mesh, optimizer)
    return state, meta


def _shards_per_dim(sharding: NamedSharding, ndim: int) -> list[int]:
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    out = []
    for entry in list(sharding.spec) + [None] * (ndim - len(sharding.spec)):
        names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        out.append(int(np.prod([sizes[n] for n in names])) if names else 1)
    return out


def memory_report(state: TrainState, plan: ParamPlan | None, *, regather: bool = True, accum_steps: int = 1) -> dict:
    """Bytes of parameters + optimizer state on one device (read from the live arrays' shards on the
    first local device), the logical total, and the most gathered parameter bytes alive at once."""
    dev = jax.local_devices()[0]
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state)) if hasattr(x, "addressable_shards")]
    per_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev)
    if plan is None:
        total = sum(x.nbytes for x in leaves)
        peak = 0
    else:
        n_moments = sum(1 for x in jax.tree.leaves(state.opt_state) if x.ndim > 0) // max(len(plan.entries), 1)
        scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
        total = plan.total_bytes * (1 + n_moments) + scalars
        peak = plan.peak_gathered_bytes(regather=regather, accum_steps=accum_steps)
    return {"state_bytes_per_device": int(per_device), "state_bytes_total": int(total),
            "peak_gathered_bytes": int(peak)}


def collectives_report(train_step: Callable, state: TrainState, batch: Any) -> dict:
    """kind -> {"count", "bytes"} the compiled step executes per step (loop bodies times their trips)."""
    got = executed_collectives(train_step, state, batch)
    return {k: v for k, v in got.items() if v["count"]}


def restore_job_state(checkpointer, target: TrainState, plan: ParamPlan | None, mesh: DeviceMesh, optimizer,
                      model: Any, step: int | None = None) -> tuple[TrainState, dict]:
    """``restore_resharded`` for the training job: the logical parameter shapes come from the plan
    (or from ``target``, replicated, when there is none)."""
    if plan is not None:
        abstract = jax.tree_util.tree_unflatten(
            plan.treedef, [jax.ShapeDtypeStruct(e.shape, np.dtype(e.dtype)) for e in plan.entries])
    else:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target.params)
    return restore_resharded(checkpointer, target, plan, mesh, optimizer, abstract, model.fsdp_units(), step)
