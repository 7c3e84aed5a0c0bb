"""Parameter plans: which mesh dims cut each parameter, its local shape and bytes, and how a unit's
parameters are gathered; a plan is data, computed and printed before anything runs."""

from spmd.parallel.plan._param_plan import ROOT, ParamPlan, PlanEntry, path_str, plan_params
from spmd.parallel.plan._rules import Rule, replicate, shard_rule
from spmd.parallel.plan._shard import entry_sharding, gather_unit, map_like_params, pad_tree, shard_params, unshard_tree

__all__ = [
    "ROOT",
    "ParamPlan",
    "PlanEntry",
    "path_str",
    "plan_params",
    "Rule",
    "replicate",
    "shard_rule",
    "entry_sharding",
    "gather_unit",
    "map_like_params",
    "pad_tree",
    "shard_params",
    "unshard_tree",
]
