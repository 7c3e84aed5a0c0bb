"""DTensor: a global tensor laid out over a DeviceMesh by a placement list.

Storage: one jax.Array of shape ``mesh.shape + padded_local_shape``, sharded so
that device ``(i, j, ...)`` holds exactly its own block ``[i, j, ...]``. Each
block is the rank's local tensor padded at the end of every dim to the largest
local extent (uneven torch.chunk shards); padding never leaves this module.
Replicate and Partial blocks are full-shape; Partial blocks are unreduced.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    check_placements,
    format_placements,
    local_shape,
    padded_local_shape,
    rank_to_coord,
)
from spmd._mesh import DeviceMesh

__all__ = ["DTensor"]


@jax.tree_util.register_pytree_node_class
class DTensor:
    """A tensor laid out over ``device_mesh`` by ``placements`` (one per mesh dim)."""

    __slots__ = ("_physical", "_mesh", "_placements", "_shape")

    def __init__(self, physical, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]):
        # Private: use distribute_tensor or DTensor.from_local.
        self._physical = physical
        self._mesh = mesh
        self._placements = tuple(placements)
        self._shape = tuple(int(s) for s in shape)

    # --- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._physical,), (self._mesh, self._placements, self._shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    # --- properties -----------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._placements

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self):
        return self._physical.dtype

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={self._shape}, dtype={np.dtype(self.dtype).name}, "
            f"placements={format_placements(self._placements)}, mesh={self._mesh!r})"
        )

    # --- local views ----------------------------------------------------------------------
    def local_tensors(self) -> list:
        """Each rank's local tensor, indexed by rank, with its exact (unpadded) shape."""
        out = []
        for r in range(self._mesh.size()):
            coord = rank_to_coord(r, self._mesh.shape)
            ls = local_shape(self._shape, self._mesh.shape, self._placements, coord)
            out.append(self._physical[coord][tuple(slice(0, s) for s in ls)])
        return out

    def full_tensor(self):
        """The logical global tensor (Partial reduced, shards gathered)."""
        return _full_tensor_even(self)


def _full_tensor_even(dt: DTensor):
    # Even shards only; the redistribute engine generalises this to uneven shards.
    from spmd import _collectives as C

    mesh = dt.device_mesh
    names = mesh.mesh_dim_names
    nd = mesh.ndim
    for mesh_dim, p in enumerate(dt.placements):
        if isinstance(p, Shard) and dt.shape[p.dim] % mesh.shape[mesh_dim]:
            raise NotImplementedError("uneven full_tensor needs the redistribute engine")

    def body(block):
        x = block.reshape(block.shape[nd:])
        for mesh_dim in reversed(range(nd)):
            p = dt.placements[mesh_dim]
            if isinstance(p, Partial):
                x = C.all_reduce(x, p.reduce_op, group=names[mesh_dim])
            elif isinstance(p, Shard):
                x = C.all_gather(x, axis=p.dim, tiled=True, group=names[mesh_dim])
        return x

    f = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=P(*names), out_specs=P(), check_vma=False)
    return jax.jit(f)(dt._physical)
