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

import numpy as np

from placements import Placement, check_placements, padded_local_shape
from spmd._groups import region_mesh
from spmd.tensor._lower import device_row, fill_padding
from spmd.tensor._tables import size_table

__all__ = ["local_shape", "zero_padding", "is_uneven"]


def is_uneven(shape, mesh_shape, placements) -> bool:
    """Do the devices' local shapes differ from the padded block (some shard is short)?"""
    padded = padded_local_shape(shape, mesh_shape, placements)
    return bool((size_table(shape, mesh_shape, placements) != np.array(padded, np.int32)).any())


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
    return device_row(size_table(shape, mesh_shape, pl), names, mesh_shape)


def zero_padding(block, shape, placements, names: tuple[str, ...], mesh_shape: tuple[int, ...]):
    """``block`` (this device's padded block) with every element past its local shape set to zero."""
    return fill_padding(block, shape, placements, range(block.ndim), 0, names, mesh_shape)
