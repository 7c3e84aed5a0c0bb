"""A pipeline's train state as the model's own tree, and back: what a checkpoint of a pipelined run holds.

A ``PipelineModule``'s state stores the units' parameters stacked per stage (``stages/<name>``, leading dim
``pp x v x slots``, cut over pp) and its optimizer moments alike. ``unstack_state`` gives the same values
as the model's own parameter tree and optimizer state, the tree every other layout trains, laid out on the
pipeline's mesh by ``checkpoint_plan``: each unit's parameter cut over fsdp as its stacked stage parameter
is (the same dim, less the stacked one), replicated over pp; the rest replicated. A checkpoint of that
state does not depend on the pp layout: it restores onto any mesh and plan, and ``stack_state`` lays the
model's own state (restored from any layout) out for the pipeline again, bit for bit. A skipped slot of an
unequal split is stored zero, as ``init_train_state`` stores it (its gradient is zero: it stays zero).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements import Shard
from spmd.parallel.plan._param_plan import ParamPlan, path_str, plan_params
from spmd.parallel.pipelining._comm import REST, STAGES
from spmd.parallel.plan._rules import Rule
from spmd.parallel.step._state import TrainState, state_shardings

__all__ = ["checkpoint_plan", "unstack_state", "stack_state"]


def _own_shapes(lay) -> Any:
    return jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths])


def checkpoint_plan(pm, lay) -> ParamPlan:
    """The plan of the model's own tree on the pipeline's mesh (see the module doc)."""
    rules = []
    for rel in lay.rel:
        d = lay.fsdp_dim(rel)
        if d is not None:
            pattern, dim = lay.own_param(rel, d)
            rules.append(Rule(pattern, {lay.fsdp: Shard(dim)}, name="pipeline unit + fully_shard"))
    return plan_params(_own_shapes(lay), dict(zip(pm.mesh.mesh_dim_names, pm.mesh.shape)), rules, fsdp="")


def _is_stored(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == {STAGES, REST}


def _programs(pm, lay, optimizer) -> tuple[ParamPlan, Any, Any]:
    """(checkpoint plan, jitted unstack, jitted stack) of one layout and optimizer, built once."""
    key = (lay.plan, optimizer)
    if key not in pm._checkpoints:
        plan = checkpoint_plan(pm, lay)
        own = _own_shapes(lay)
        own_sh = state_shardings(plan, pm.mesh, own, jax.eval_shape(optimizer.init, own), optimizer)
        stored = lay.stored_shapes()
        stored_sh = state_shardings(lay.plan, pm.mesh, stored, jax.eval_shape(optimizer.init, stored), optimizer)
        is_own = lambda v: not _is_stored(v) and jax.tree_util.tree_structure(v) == lay.treedef  # noqa: E731

        def unstack(params, opt_state):
            return lay.unstack(params), optax.tree_map_params(optimizer, lay.unstack, opt_state, is_leaf=_is_stored)

        def stack(params, opt_state):
            return lay.stack(params), optax.tree_map_params(optimizer, lay.stack, opt_state, is_leaf=is_own)

        pm._checkpoints[key] = (plan, jax.jit(unstack, out_shardings=own_sh), jax.jit(stack, out_shardings=stored_sh))
    return pm._checkpoints[key]


def unstack_state(pm, state: TrainState, optimizer) -> TrainState:
    """``state`` (laid out by ``init_train_state(pm, ...)``) as the model's own tree, laid out by
    ``checkpoint_plan``."""
    where = "PipelineModule.unstack_state"
    if not isinstance(state, TrainState):
        raise TypeError(f"{where}: state={type(state).__name__} must be the TrainState init_train_state({pm!r}, "
                        "...) returns.")
    lay = next((lay for lay in pm._layouts.values() if lay.plan == state.plan), None)
    if lay is None or not _is_stored(state.params):
        raise ValueError(f"{where}: state is not laid out by this pipeline (its plan is none of {pm!r}'s stage "
                         "layouts); pass a state init_train_state or stack_state built on this PipelineModule.")
    plan, unstack, _ = _programs(pm, lay, optimizer)
    params, opt_state = unstack(state.params, state.opt_state)
    return TrainState(step=_replicated(state.step, pm), params=params, opt_state=opt_state, plan=plan)


def stack_state(pm, state: TrainState, optimizer) -> TrainState:
    """The model's own state (parameters of their logical shapes, on ``pm``'s mesh or on the host) laid out
    for the pipeline: the units stacked per stage, as ``init_train_state(pm, ...)`` lays them out."""
    where = "PipelineModule.stack_state"
    if not isinstance(state, TrainState):
        raise TypeError(f"{where}: state={type(state).__name__} must be a TrainState of the model's own parameter "
                        "tree (e.g. restored from a checkpoint, or unstack_state's).")
    if _is_stored(state.params):
        raise ValueError(f"{where}: state holds stacked pipeline stages already ({STAGES!r}, {REST!r}); pass the "
                         "model's own tree (unstack_state(state) gives it).")
    lay = pm.layout(state.params)
    got = {path_str(kp): tuple(np.shape(x)) for kp, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    bad = [(p, got[p], tuple(lay.shapes[p].shape)) for p in lay.paths if got[p] != tuple(lay.shapes[p].shape)]
    if bad:
        raise ValueError(f"{where}: parameters of other shapes than the model's (path, given, the model's: "
                         f"{bad[:3]}); trim padded (sharded) arrays to their logical shapes first (unshard_tree).")
    _, _, stack = _programs(pm, lay, optimizer)
    params, opt_state = stack(state.params, state.opt_state)
    return TrainState(step=_replicated(state.step, pm), params=params, opt_state=opt_state, plan=lay.plan)


def _replicated(step: Any, pm) -> jax.Array:
    return jax.device_put(step, NamedSharding(pm.mesh.jax_mesh, P()))
