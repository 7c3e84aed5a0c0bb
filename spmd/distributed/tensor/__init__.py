"""``torch.distributed.tensor``'s names: ``from spmd.distributed.tensor import DTensor, Shard, ...``.

The implementation is :mod:`spmd.tensor`; this package only gives a port the
same import path with ``torch`` replaced by ``spmd``.
"""

from placements import Partial, Placement, Replicate, Shard
from spmd.distributed.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import DTensor, distribute_tensor

__all__ = ["DTensor", "distribute_tensor", "DeviceMesh", "init_device_mesh", "Placement", "Shard", "Replicate", "Partial"]
