"""Validation shared by the DTensor constructors and methods (validate first, then execute)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from placements import Partial, Replicate, check_placements
from placements._plan import check_partial_mix
from spmd._mesh import DeviceMesh

__all__ = ["check_mesh", "check_partial_dtype", "check_target", "check_shape", "is_tracer"]


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_mesh(mesh: Any, where: str) -> DeviceMesh:
    if isinstance(mesh, jax.sharding.Mesh):  # named by its dims and shape: JAX's repr is not ours to print
        raise TypeError(
            f"{where}: device_mesh is a jax.sharding.Mesh with axis_names={tuple(mesh.axis_names)!r} and shape "
            f"{tuple(mesh.axis_sizes)!r}; wrap it as DeviceMesh.from_jax(mesh)."
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: device_mesh={mesh!r} must be a DeviceMesh; make one with "
            "spmd.init_device_mesh('cpu', (8,)) and pass it."
        )
    return mesh


def check_partial_dtype(placements, dtype, where: str, arg: str = "placements") -> None:
    """A Partial needs a numeric dtype, ``Partial('max'|'min')`` an ordered one and ``Partial('avg')`` a
    floating one (as torch)."""
    dtype = np.dtype(dtype)
    for i, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        if dtype == np.bool_:
            raise TypeError(
                f"{where}: {arg}[{i}]={p} on a bool tensor is refused; a Partial needs a numeric dtype: "
                "cast the tensor (e.g. to int32) first."
            )
        if p.reduce_op in ("max", "min") and jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"{where}: {arg}[{i}]={p} on a {dtype.name} tensor is refused: complex numbers have no order "
                "(torch refuses MAX/MIN on complex too); use Partial('sum'), or reduce abs() or the real part."
            )
        if p.reduce_op == "avg" and not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{where}: {arg}[{i}]={p} on a {dtype.name} tensor is refused (torch allows AVG only on "
                "floating dtypes); use Partial('sum') and divide, or cast to a float dtype."
            )


def check_target(
    placements: Any, mesh_ndim: int, ndim: int, dtype, where: str, arg: str = "placements", *, pad: bool = True
):
    """A placement list for a tensor of rank ``ndim`` and ``dtype`` on a mesh of ``mesh_ndim`` dims:
    checked as a list, for mixed Partial ops and for the dtype; returned as a tuple.

    With ``pad`` (DTensor's entry points), a list shorter than the mesh is completed with ``Replicate()``
    on the trailing mesh dims, as torch's ``distribute_tensor`` / ``from_local`` / ``redistribute`` do;
    a longer one is refused."""
    if pad and isinstance(placements, (list, tuple)) and len(placements) < mesh_ndim:
        placements = tuple(placements) + (Replicate(),) * (mesh_ndim - len(placements))
    pl = check_placements(placements, mesh_ndim=mesh_ndim, tensor_ndim=ndim, where=f"{where}: {arg}")
    check_partial_mix(pl, f"{where}: {arg}")
    check_partial_dtype(pl, dtype, where, arg)
    return pl


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape
    ):
        raise TypeError(f"{where}: shape={shape!r} must be a tuple of ints, the global shape, e.g. shape=(10, 4).")
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: shape={tuple(shape)!r} has a negative size; sizes are >= 0.")
    return tuple(int(s) for s in shape)
