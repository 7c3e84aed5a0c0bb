"""``distribute_tensor`` (a global value onto a mesh) and ``plan_redistribute`` (a plan, nothing runs)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from placements import Placement, Replicate, format_placements
from placements._plan import Plan, plan as make_plan
from spmd._arrays import as_array
from spmd._mesh import DeviceMesh
from spmd.tensor import _dispatch
from spmd.tensor._checks import check_mesh, check_target, is_tracer
from spmd._x64 import x64_for
from spmd.tensor._dtensor import DTensor
from spmd.tensor._source import from_source
from spmd.tensor._storage import sharding, storage_of_global

__all__ = ["distribute_tensor", "plan_redistribute"]


def distribute_tensor(x: Any, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Lay out a global tensor ``x`` (NumPy or JAX array) over ``device_mesh`` by ``placements``.

    ``placements`` defaults to Replicate on every mesh dim (as torch). A Partial
    placement partitions the value as ``Replicate -> Partial`` does. Across processes,
    as torch, every rank takes mesh rank ``src_data_rank``'s ``x`` (``None``: each
    process's own, which must then agree); 64-bit dtypes keep their values.
    """
    where = "distribute_tensor"
    mesh = check_mesh(device_mesh, where)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(
                f"{where}: x is a DTensor on {x.device_mesh!r}, not on {mesh!r}; distribute x.full_tensor() instead."
            )
        pl = check_target(placements, mesh.ndim, x.ndim, x.dtype, where)
        if pl != x.placements:
            raise ValueError(
                f"{where}: x is already a DTensor placed {format_placements(x.placements)}, not "
                f"{format_placements(pl)}; call x.redistribute(placements=...) instead."
            )
        return x
    if is_tracer(x):
        return _distribute_traced(x, mesh, placements, where)
    arr = np.asarray(as_array(x, where, "x"))
    pl = check_target(placements, mesh.ndim, arr.ndim, arr.dtype, where)
    arr = from_source(arr, mesh, src_data_rank, where)  # torch's src_data_rank (multi-process)
    with x64_for(arr.dtype):  # int64 / float64 storage keeps its dtype (spmd/_x64.py)
        return DTensor(storage_of_global(arr, mesh, pl), mesh, pl, arr.shape)


def _distribute_traced(x, mesh: DeviceMesh, placements, where: str) -> DTensor:
    """Inside jax.jit: replicate, then run the plan ``R... -> placements``."""
    pl = check_target(placements, mesh.ndim, x.ndim, x.dtype, where)
    rep = (Replicate(),) * mesh.ndim
    phys = jnp.reshape(x, (1,) * mesh.ndim + tuple(x.shape))  # Replicate: stored once (_storage.py)
    phys = jax.lax.with_sharding_constraint(phys, sharding(mesh, rep))
    plan = make_plan(mesh.shape, x.shape, np.dtype(x.dtype).itemsize, rep, pl, where=where)
    if plan.steps:
        phys = _dispatch.program(mesh, plan)(phys)
    return DTensor(phys, mesh, pl, x.shape)


def plan_redistribute(dt: DTensor, placements: Sequence[Placement]) -> Plan:
    """The plan ``dt.redistribute(placements=placements)`` runs, without running it: print it,
    cost it (``.cost()``), list its ``.collectives``."""
    where = "plan_redistribute"
    if not isinstance(dt, DTensor):
        raise TypeError(
            f"{where}: dt={dt!r} must be a DTensor; make one with distribute_tensor(x, mesh, placements)."
        )
    dst = check_target(placements, dt.device_mesh.ndim, dt.ndim, dt.dtype, where)
    return make_plan(dt.device_mesh.shape, dt.shape, np.dtype(dt.dtype).itemsize, dt.placements, dst, where=where)
