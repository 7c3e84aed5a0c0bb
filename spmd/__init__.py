"""spmd: the torch.distributed programming model on JAX.

Meshes, placements, collectives and DTensor as pure functions traced over a
device mesh and lowered to XLA collectives.
"""

from placements import Partial, Placement, ReduceOp, Replicate, Shard
from spmd._collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    axis_index,
    broadcast,
    gather,
    permute,
    reduce,
    reduce_scatter,
    scatter,
)
from spmd._inspect import collectives
from spmd._mesh import DeviceMesh, init_device_mesh
from spmd._process_group import ProcessGroup
from spmd._spawn import spawn
from spmd._spmd import spmd
from spmd._uneven import local_shape
from spmd.tensor import DTensor, distribute_tensor, plan_redistribute

__all__ = [
    "spmd",
    "DeviceMesh",
    "init_device_mesh",
    "ProcessGroup",
    "DTensor",
    "distribute_tensor",
    "plan_redistribute",
    "ReduceOp",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce",
    "scatter",
    "gather",
    "reduce_scatter",
    "all_to_all",
    "permute",
    "axis_index",
    "local_shape",
    "collectives",
    "spawn",
]

# Subpackages that load on first use (PEP 562), so ``import spmd`` then ``spmd.ops.exp(x)`` works as
# ``import torch`` then ``torch.distributed...`` does, and ``import spmd`` costs no more than before.
_LAZY_SUBMODULES = ("ops", "distributed", "parallel", "testing")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"spmd.{name}")  # the import also sets spmd.<name>
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
