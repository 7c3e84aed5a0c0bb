"""A DTensor's storage: one stacked jax.Array of padded blocks.

Storage is one jax.Array of shape ``extents + padded_local_shape``: one leading
axis per mesh dim, of the mesh dim's size where the placement is ``Shard`` or
``Partial`` (device ``(i, j, ...)`` holds block ``[i, j, ...]``) and of size 1
where it is ``Replicate`` on a mesh dim of size > 1 (one value, replicated by
the sharding, :func:`spec`). So a ``Replicate`` value is one JAX value, typed
invariant over that mesh dim inside ``shard_map`` (``check_vma``): JAX checks
that it is replicated, and ``jax.grad`` gives it one gradient, reduced as
torch's autograd reduces it (the transpose of using a replicated value on
varying blocks is one all-reduce; of an all-reduce, nothing). Each block is the
rank's local tensor padded at the end of every dim to the largest local extent
(uneven torch.chunk shards); padding never leaves the tensor package.
Replicate and Partial blocks are full-shape; Partial blocks are unreduced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from placements import Partial, Replicate, local_shape, local_shape_and_offset, padded_local_shape

__all__ = [
    "of", "op_identity", "stored_once", "extents", "spec", "sharding", "pad_block", "np_block",
    "storage_of_global", "storage_of_blocks", "block_of",
]


def of(t) -> jax.Array:
    """A DTensor's storage, read through its pytree (one leaf), so that no module needs the class."""
    (leaf,) = jax.tree_util.tree_leaves(t)
    return leaf


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


def stored_once(mesh_shape, placements) -> tuple[bool, ...]:
    """Per mesh dim: is the value stored once (``Replicate`` on a mesh dim of size > 1)?"""
    return tuple(isinstance(p, Replicate) and m > 1 for m, p in zip(mesh_shape, placements))


def extents(mesh_shape, placements) -> tuple[int, ...]:
    """The storage's leading axes: the mesh dim's size, or 1 where the value is stored once."""
    return tuple(1 if once else m for m, once in zip(mesh_shape, stored_once(mesh_shape, placements)))


def spec(mesh, placements) -> P:
    """The storage's ``PartitionSpec``: each leading axis over its mesh dim, replicated where stored once."""
    once = stored_once(mesh.shape, placements)
    return P(*(None if o else n for n, o in zip(mesh.mesh_dim_names, once)))


def sharding(mesh, placements) -> NamedSharding:
    """Block ``[i, j, ...]`` on device ``(i, j, ...)`` (the one value on every device where stored once)."""
    return NamedSharding(mesh.jax_mesh, spec(mesh, placements))


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

    return jax.make_array_from_callback(extents(mesh.shape, placements) + padded, sharding(mesh, placements), cb)


def storage_of_blocks(blocks: dict, mesh, placements, gshape) -> jax.Array:
    """The storage from unpadded local tensors at mesh coordinates (this process's devices; the
    blocks along a dim stored once must be equal: the caller checks or trusts it)."""
    padded = padded_local_shape(gshape, mesh.shape, placements)
    pieces = []
    for coord, a in blocks.items():
        xp = jnp if isinstance(a, jax.Array) else np
        b = pad_block(a, padded, xp).reshape((1,) * mesh.ndim + padded)
        pieces.append(jax.device_put(b, mesh.devices[coord]))
    shape = extents(mesh.shape, placements) + padded
    return jax.make_array_from_single_device_arrays(shape, sharding(mesh, placements), pieces)


def block_of(shard, mesh, placements, gshape) -> tuple:
    """(mesh coordinate, unpadded local tensor) of one addressable shard of the storage."""
    nd = mesh.ndim
    coord = next(c for c, d in np.ndenumerate(mesh.devices) if d == shard.device)
    ls = local_shape(gshape, mesh.shape, placements, coord)
    b = shard.data
    return coord, b.reshape(b.shape[nd:])[tuple(slice(0, s) for s in ls)]
