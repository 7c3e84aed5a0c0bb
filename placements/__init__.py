"""The placement algebra of spmd: pure Python, no JAX.

Placement types (``Shard``, ``Replicate``, ``Partial``), reduce ops, and the
layout math that says which block of a global tensor each rank holds.
"""

from placements._layout import (
    chunk_size,
    coord_to_rank,
    local_shape,
    local_shape_and_offset,
    local_shapes,
    padded_local_shape,
    rank_to_coord,
    shard_size_and_offset,
    shard_sizes,
)
from placements._plan import LATENCY_BYTES, Plan, PlanCost, Step, plan
from placements._reduce_op import ReduceOp, as_reduce_op
from placements._transitions import TRANSITIONS, Transition, transition
from placements._types import (
    PARTIAL_OPS,
    Partial,
    Placement,
    Replicate,
    Shard,
    check_placements,
    format_placements,
)

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "PARTIAL_OPS",
    "ReduceOp",
    "as_reduce_op",
    "check_placements",
    "format_placements",
    "chunk_size",
    "shard_sizes",
    "shard_size_and_offset",
    "rank_to_coord",
    "coord_to_rank",
    "local_shape",
    "local_shape_and_offset",
    "local_shapes",
    "padded_local_shape",
    "Plan",
    "PlanCost",
    "Step",
    "plan",
    "LATENCY_BYTES",
    "Transition",
    "TRANSITIONS",
    "transition",
]
