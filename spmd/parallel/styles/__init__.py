"""Parallel styles and the transforms that apply them to a model (torch's ``parallelize_module``,
``fully_shard``, activation checkpointing), and the hooks that run a styled module's call on its blocks."""

from spmd.parallel.styles._experts import ExpertParallel, ExpertTensorParallel
from spmd.parallel.styles._styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                          RowwiseParallel, SequenceParallel)
from spmd.parallel.styles._transforms import (MixedPrecisionPolicy, ParallelModule, activation_checkpointing,
                                              fully_shard, parallelize_module)
from spmd.parallel.styles._weight_stationary import weight_stationary_plan

__all__ = [
    "ColwiseParallel",
    "ExpertParallel",
    "ExpertTensorParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ParallelStyle",
    "parallelize_module",
    "fully_shard",
    "MixedPrecisionPolicy",
    "ParallelModule",
    "activation_checkpointing",
    "weight_stationary_plan",
]
