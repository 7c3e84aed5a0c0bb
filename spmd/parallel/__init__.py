"""Sharded training layouts: parameter placement plans (FSDP / ZeRO, later tensor parallel).

``plan_params(params, mesh, rules)`` is data: each parameter's placements per
mesh dim, local (padded) shape, bytes per device, gather unit, and what a train
step communicates. Rules (``Rule``, ``fully_shard``, ``replicate``) map
parameter path patterns to placements; the first match wins.
"""

from spmd.parallel._hlo import executed_collectives, hlo_executed_collectives
from spmd.parallel._param_plan import ROOT, ParamPlan, PlanEntry, path_str, plan_params
from spmd.parallel._rules import Rule, fully_shard, replicate
from spmd.parallel._tp import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_rules
from spmd.parallel._shard import entry_sharding, gather_unit, map_like_params, shard_params, unshard_params

__all__ = [
    "Rule",
    "fully_shard",
    "replicate",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "parallelize_rules",
    "plan_params",
    "ParamPlan",
    "PlanEntry",
    "ROOT",
    "path_str",
    "entry_sharding",
    "shard_params",
    "unshard_params",
    "gather_unit",
    "map_like_params",
    "executed_collectives",
    "hlo_executed_collectives",
]
