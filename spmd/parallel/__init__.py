"""Sharded training for any flax model: torch's ``parallelize_module`` / ``fully_shard`` and one train step.

```python
model = parallelize_module(model, mesh["tp"], {"layers_*.mlp.up_proj": ColwiseParallel(), ...})
model = fully_shard(model, mesh=mesh["dp", "fsdp"], units=["layers_*"])
model = activation_checkpointing(model, units=["layers_*"], policy="full")   # recompute in the backward pass
state = init_train_state(model, optimizer, params=params)
step = make_train_step(model, loss_fn, optimizer)
```

The layouts are data: ``model.plan(params)`` (or ``state.plan``) is a ``ParamPlan``, each parameter's
placements per mesh dim, local shapes, bytes per device and what a step communicates, printable before
anything runs. ``Rule`` / ``shard_rule`` / ``replicate`` / ``plan_params`` build plans by hand.
"""

from spmd.parallel._auto import AutoLayout, Candidate, auto_layout
from spmd.parallel._auto_layout import Layout, apply_layout
from spmd.parallel._calibrate import Calibration, calibrate
from spmd.parallel._hlo import executed_collectives, hlo_executed_collectives
from spmd.parallel._pipeline import PipelineModule, SplitPoint, pipeline
from spmd.parallel._param_plan import ROOT, ParamPlan, PlanEntry, path_str, plan_params
from spmd.parallel._schedules import Schedule, build_schedule
from spmd.parallel._remat import activation_checkpointing
from spmd.parallel._rules import Rule, replicate, shard_rule
from spmd.parallel._shard import entry_sharding, gather_unit, map_like_params, pad_tree, shard_params, unshard_tree
from spmd.parallel._step import TrainState, init_train_state, make_train_step, unshard_params
from spmd.parallel._styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                   RowwiseParallel, SequenceParallel)
from spmd.parallel._transforms import MixedPrecisionPolicy, ParallelModule, fully_shard, parallelize_module
from spmd.parallel._weight_stationary import weight_stationary_plan

__all__ = [
    "auto_layout",
    "apply_layout",
    "calibrate",
    "Layout",
    "weight_stationary_plan",
    "Calibration",
    "AutoLayout",
    "Candidate",
    "parallelize_module",
    "fully_shard",
    "activation_checkpointing",
    "pipeline",
    "PipelineModule",
    "SplitPoint",
    "Schedule",
    "build_schedule",
    "ParallelModule",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ParallelStyle",
    "MixedPrecisionPolicy",
    "TrainState",
    "init_train_state",
    "make_train_step",
    "unshard_params",
    "Rule",
    "shard_rule",
    "replicate",
    "plan_params",
    "ParamPlan",
    "PlanEntry",
    "ROOT",
    "path_str",
    "entry_sharding",
    "shard_params",
    "unshard_tree",
    "pad_tree",
    "gather_unit",
    "map_like_params",
    "executed_collectives",
    "hlo_executed_collectives",
]
