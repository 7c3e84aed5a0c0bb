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

# the sub-packages in layer order, each importing only those before it
from spmd.parallel.plan import (ROOT, ParamPlan, PlanEntry, Rule, entry_sharding, gather_unit, map_like_params,
                                pad_tree, path_str, plan_params, replicate, shard_params, shard_rule, unshard_tree)
from spmd.parallel.styles import (ColwiseParallel, ExpertParallel, ExpertTensorParallel, MixedPrecisionPolicy, ParallelModule, ParallelStyle,
                                  PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                  activation_checkpointing, fully_shard, parallelize_module, weight_stationary_plan)
from spmd.parallel.context import (allgather_attention, causal_work, ring_attention, unzigzag_permutation,
                                   zigzag_permutation)
from spmd.parallel.cost import (HARDWARE, Calibration, Hardware, Link, calibrate, executed_collectives,
                                hlo_executed_collectives)
from spmd.parallel.step import (OwnsTrainStep, StepMemory, TrainState, TrainStep, init_train_state, make_train_step,
                                unshard_params)
from spmd.parallel.pipelining import PipelineModule, Schedule, SplitPoint, build_schedule, pipeline
from spmd.parallel.experts import ExpertDispatch, expert_capacity, expert_combine, expert_dispatch, expert_places
from spmd.parallel.auto import AutoLayout, Candidate, Layout, apply_layout, auto_layout

__all__ = [
    "auto_layout",
    "apply_layout",
    "calibrate",
    "Layout",
    "weight_stationary_plan",
    "Calibration",
    "Hardware",
    "Link",
    "HARDWARE",
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
    "ExpertParallel",
    "ExpertTensorParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ParallelStyle",
    "MixedPrecisionPolicy",
    "TrainState",
    "TrainStep",
    "StepMemory",
    "OwnsTrainStep",
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
    "ring_attention",
    "allgather_attention",
    "zigzag_permutation",
    "unzigzag_permutation",
    "causal_work",
    "expert_dispatch",
    "expert_combine",
    "expert_capacity",
    "expert_places",
    "ExpertDispatch",
]
