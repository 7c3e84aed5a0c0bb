"""A DTensor's storage: one stacked jax.Array of padded blocks.

Storage is one jax.Array of shape ``mesh.shape + padded_local_shape``, sharded
so that device ``(i, j, ...)`` holds exactly its own block ``[i, j, ...]``.
Each block is the rank's local tensor padded at the end of every dim to the
largest local extent (uneven torch.chunk shards); padding never leaves the
tensor package. Replicate and Partial blocks are full-shape; Partial blocks
are unreduced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from placements import Partial, local_shape, local_shape_and_offset, padded_local_shape

__all__ = ["op_identity", "sharding", "pad_block", "np_block", "storage_of_global", "storage_of_blocks", "block_of"]


def op_identity(op: str, dtype):
    """The identity of reduce op ``op`` in ``dtype`` (what a rank holding nothing contributes)."""
    dtype = np.dtype(dtype)
    if op in ("sum", "avg"):
        # -0.0 for floats: x + (-0.0) == x for every x, -0.0 included (+0.0 would turn -0.0 into +0.0).
        return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0
    if op == "product":
        return 1
    if dtype == np.bool_:
        return op == "min"
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.min if op == "max" else info.max
    return -np.inf if op == "max" else np.inf


def sharding(mesh) -> NamedSharding:
    """Block ``[i, j, ...]`` on device ``(i, j, ...)``."""
    return NamedSharding(mesh.jax_mesh, P(*mesh.mesh_dim_names))


def pad_block(x, padded, xp):
    pad = [(0, p - s) for s, p in zip(x.shape, padded)]
    return xp.pad(x, pad) if any(b for _, b in pad) else x


def _partial_keep(placements, coord) -> str | None:
    """For a value partitioned from Replicate: the op whose identity this coord holds, if any."""
    for d, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op in ("sum", "product") and coord[d] != 0:
            return p.reduce_op
    return None


def np_block(x: np.ndarray, shape, mesh_shape, placements, coord) -> np.ndarray:
    """The padded block of a global NumPy ``x`` at ``coord`` (Partial as ``Replicate -> Partial``)."""
    ls, off = local_shape_and_offset(shape, mesh_shape, placements, coord)
    block = x[tuple(slice(o, o + s) if s else slice(0, 0) for o, s in zip(off, ls))]
    op = _partial_keep(placements, coord)
    if op is not None:
        block = np.full_like(block, op_identity(op, x.dtype))
    return pad_block(block, padded_local_shape(shape, mesh_shape, placements), np)


def storage_of_global(arr: np.ndarray, mesh, placements) -> jax.Array:
    """The storage of a global NumPy value laid out by (checked) ``placements``."""
    shape = arr.shape
    padded = padded_local_shape(shape, mesh.shape, placements)
    nd = mesh.ndim

    def cb(index):
        coord = tuple(sl.start or 0 for sl in index[:nd])
        return np_block(arr, shape, mesh.shape, placements, coord).reshape((1,) * nd + padded)

    return jax.make_array_from_callback(tuple(mesh.shape) + padded, sharding(mesh), cb)


def storage_of_blocks(blocks: dict, mesh, placements, gshape) -> jax.Array:
    """The storage from unpadded local tensors at mesh coordinates (this process's devices)."""
    padded = padded_local_shape(gshape, mesh.shape, placements)
    pieces = []
    for coord, a in blocks.items():
        xp = jnp if isinstance(a, jax.Array) else np
        b = pad_block(a, padded, xp).reshape((1,) * mesh.ndim + padded)
        pieces.append(jax.device_put(b, mesh.devices[coord]))
    return jax.make_array_from_single_device_arrays(tuple(mesh.shape) + padded, sharding(mesh), pieces)


def block_of(shard, mesh, placements, gshape) -> tuple:
    """(mesh coordinate, unpadded local tensor) of one addressable shard of the storage."""
    nd = mesh.ndim
    coord = tuple(sl.start or 0 for sl in shard.index[:nd])
    ls = local_shape(gshape, mesh.shape, placements, coord)
    b = shard.data
    return coord, b.reshape(b.shape[nd:])[tuple(slice(0, s) for s in ls)]
