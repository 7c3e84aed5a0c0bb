"""``torch.distributed.device_mesh``'s names: ``from spmd.distributed.device_mesh import init_device_mesh``."""

from __future__ import annotations

from typing import Sequence

from spmd._launch import launched_world_size
from spmd._mesh import DeviceMesh
from spmd._mesh import init_device_mesh as _mesh_of_devices
from spmd.distributed._init import init_process_group
from spmd.distributed._state import is_initialized

__all__ = ["DeviceMesh", "init_device_mesh"]


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """As torch's: under a launcher (``WORLD_SIZE`` > 1) join the job first
    (``init_process_group()``) unless done, then :func:`spmd.init_device_mesh` over every
    process's devices, row-major by process."""
    if launched_world_size() > 1 and not is_initialized():
        init_process_group()
    return _mesh_of_devices(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
