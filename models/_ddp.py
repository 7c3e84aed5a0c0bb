"""The job's batch layout: ``Shard(0)`` over the data-parallel mesh dims, ``Replicate`` on the others.

The train step of every layout (DDP included) is ``spmd.parallel.make_train_step``; its state is
``spmd.parallel.TrainState`` (re-exported here as the job's ``TrainState``).
"""

from __future__ import annotations

from placements import Replicate, Shard
from spmd import DeviceMesh
from spmd.parallel import TrainState

__all__ = ["TrainState", "batch_placements"]


def batch_placements(mesh: DeviceMesh, dp: str | tuple[str, ...] = "dp") -> list:
    """``Shard(0)`` on the data-parallel mesh dim (or each of a tuple of them), ``Replicate`` on the others."""
    dims = (dp,) if isinstance(dp, str) else tuple(dp)
    for d in dims:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"batch_placements: mesh={mesh!r} must be a spmd.DeviceMesh, e.g. init_device_mesh('cpu', "
                            "(8,), mesh_dim_names=('dp',)).")
        if d not in mesh.mesh_dim_names:
            raise ValueError(f"batch_placements: dp={d!r} is not a dim of {mesh!r}; name the data-parallel mesh dim, "
                             f"one of {mesh.mesh_dim_names}.")
    return [Shard(0) if n in dims else Replicate() for n in mesh.mesh_dim_names]
