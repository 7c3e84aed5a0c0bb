"""Uneven shards inside an SPMD region: a device's true local shape, and padding zeroed on entry.

``@spmd`` gives an uneven DTensor argument to the function as its padded block
(every device's block has the largest local shape, torch.chunk's first chunk; a
region is one program, so one shape). The padding at the end of each unevenly
cut dim is zero on entry (:func:`zero_padding`), so sums and contractions over
it are exact; for anything else (max, mean, a loss per row) mask with
:func:`local_shape`, this device's true local shape.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from placements import Placement, check_placements, local_shape as chunk_shape, padded_local_shape, rank_to_coord
from spmd._groups import region_mesh
from spmd.tensor._lower import device_row

__all__ = ["local_shape", "zero_padding", "is_uneven"]


def _table(shape, mesh_shape, placements) -> np.ndarray:
    """Every device's local shape (row = linear device position)."""
    n = int(np.prod(mesh_shape))
    return np.array([chunk_shape(shape, mesh_shape, placements, rank_to_coord(r, mesh_shape)) for r in range(n)],
                    np.int32).reshape(n, len(shape))


def is_uneven(shape, mesh_shape, placements) -> bool:
    """Do the devices' local shapes differ from the padded block (some shard is short)?"""
    padded = padded_local_shape(shape, mesh_shape, placements)
    return bool((_table(shape, mesh_shape, placements) != np.array(padded, np.int32)).any())


def local_shape(shape: Sequence[int], placements: Sequence[Placement]):
    """This device's local shape of a tensor of global ``shape`` placed by ``placements``, inside an
    SPMD region (``@spmd``): an int32 array with one entry per dim (torch.chunk's sizes, as
    ``DTensor.local_tensors()`` has them). Mask an uneven argument's padded block with it, e.g.
    ``rows = jnp.arange(x.shape[0]) < spmd.local_shape(dt.shape, dt.placements)[0]``."""
    where = "spmd.local_shape"
    names, sizes = region_mesh(where)
    mesh_shape = tuple(sizes[n] for n in names)
    shape = tuple(int(s) for s in shape)
    pl = check_placements(placements, mesh_ndim=len(names), tensor_ndim=len(shape), where=f"{where}: placements")
    return device_row(_table(shape, mesh_shape, pl), names, mesh_shape)


def zero_padding(block, shape, placements, names: tuple[str, ...], mesh_shape: tuple[int, ...]):
    """``block`` (this device's padded block) with every element past its local shape set to zero."""
    sizes = device_row(_table(shape, mesh_shape, placements), names, mesh_shape)
    keep = jnp.ones(block.shape, bool)
    for d in range(block.ndim):
        keep &= lax.broadcasted_iota(jnp.int32, block.shape, d) < sizes[d]
    return jnp.where(keep, block, jnp.zeros((), block.dtype))
