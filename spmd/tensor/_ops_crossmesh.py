"""Run a cross-mesh redistribute (``placements/_crossmesh.py`` plans it): reduce / gather to the
even layout on the source mesh, ``jax.device_put`` the ``NamedSharding`` array onto the
destination mesh (JAX moves the blocks between devices), then the local steps on the
destination mesh. Eager only: one ``jax.jit`` program spans one mesh.
"""

from __future__ import annotations

import numpy as np

import jax
from jax.sharding import NamedSharding

from placements._crossmesh import CrossMeshPlan, cross_mesh_plan
from spmd.tensor import _dispatch
from spmd.tensor._checks import check_mesh, check_target, is_tracer
from spmd.tensor._ops_interop import from_jax, partition_spec, to_jax
from spmd.tensor._storage import of as storage_of

__all__ = ["plan_cross_mesh", "redistribute_cross_mesh"]


def plan_cross_mesh(x, mesh, placements, where: str = "DTensor.redistribute") -> CrossMeshPlan:
    """The plan ``x.redistribute(mesh, placements)`` runs when ``mesh`` is not ``x``'s mesh."""
    check_mesh(mesh, where)
    dst = check_target(placements, mesh.ndim, x.ndim, x.dtype, where)
    src_mesh = x.device_mesh
    return cross_mesh_plan(
        x.shape, np.dtype(x.dtype).itemsize, src_mesh.shape, [d.id for d in src_mesh.devices.flat],
        x.placements, mesh.shape, [d.id for d in mesh.devices.flat], dst,
    )


def _on(x, mesh, placements, storage):
    return type(x).tree_unflatten((mesh, tuple(placements), tuple(x.shape)), (storage,))


def redistribute_cross_mesh(x, mesh, placements):
    """``x`` on ``mesh`` with ``placements`` (values exact: only data movement and the source's reductions)."""
    where = "DTensor.redistribute"
    if is_tracer(storage_of(x)):
        raise TypeError(
            f"{where}: redistributing onto another mesh ({mesh!r}) inside jax.jit is not supported (one jitted "
            "program runs on one mesh); call it outside jit."
        )
    p = plan_cross_mesh(x, mesh, placements, where)
    s1, s3 = p.src_plan, p.dst_plan
    mid = _on(x, x.device_mesh, s1.dst, _dispatch.program(x.device_mesh, s1)(storage_of(x))) if s1.steps else x
    arr = to_jax(mid)
    moved = jax.device_put(arr, NamedSharding(mesh.jax_mesh, partition_spec(s3.src, mesh.mesh_dim_names, x.ndim)))
    y = from_jax(type(x), moved, mesh)
    return _on(y, mesh, s3.dst, _dispatch.program(mesh, s3)(storage_of(y))) if s3.steps else y
