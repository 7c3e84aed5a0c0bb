"""Layout math: which block of a global tensor each rank holds.

``Shard(d)`` cuts like ``torch.chunk``: with ``c = ceil(n / k)``, rank ``i``
holds ``[min(i*c, n), min((i+1)*c, n))``, which may be empty (n=5, k=4 gives
sizes 2, 2, 1, 0). Several mesh dims that shard the same tensor dim nest left
to right: mesh dim 0 cuts first, then each of its chunks is cut again over the
next such mesh dim. Ranks are row-major over the mesh shape.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from placements._types import Placement, Shard

__all__ = [
    "chunk_size",
    "shard_sizes",
    "shard_size_and_offset",
    "rank_to_coord",
    "coord_to_rank",
    "local_shape_and_offset",
    "local_shape",
    "local_shapes",
    "padded_local_shape",
]


def _check_nk(n: int, k: int) -> None:
    if n < 0:
        raise ValueError(f"chunk_size: dim size n={n!r} must be >= 0. A tensor dim cannot have a negative size.")
    if k < 1:
        raise ValueError(f"chunk_size: number of ranks k={k!r} must be >= 1. A mesh dim holds at least one rank.")


def chunk_size(n: int, k: int) -> int:
    """The size of a full chunk when ``n`` elements are cut over ``k`` ranks."""
    _check_nk(n, k)
    return -(-n // k)


def shard_size_and_offset(n: int, k: int, i: int) -> tuple[int, int]:
    """``(size, offset)`` of rank ``i``'s chunk of a dim of size ``n`` over ``k`` ranks."""
    c = chunk_size(n, k)
    if not 0 <= i < k:
        raise ValueError(f"rank i={i!r} is out of range for k={k} ranks; use 0 <= i < {k}.")
    start = min(i * c, n)
    return min(start + c, n) - start, start


def shard_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of all ``k`` chunks: ``shard_sizes(5, 4) == (2, 2, 1, 0)``."""
    return tuple(shard_size_and_offset(n, k, i)[0] for i in range(k))


def rank_to_coord(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major: on a ``(a, b)`` mesh, rank ``r`` sits at ``(r // b, r % b)``."""
    size = math.prod(mesh_shape)
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank!r} is out of range for a mesh of {size} ranks.")
    coord = []
    for s in reversed(mesh_shape):
        coord.append(rank % s)
        rank //= s
    return tuple(reversed(coord))


def coord_to_rank(coord: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """The row-major rank of mesh coordinate ``coord`` on a mesh of ``mesh_shape`` (``(1, 2)`` on ``(2, 4)`` is 6)."""
    rank = 0
    for c, s in zip(coord, mesh_shape):
        rank = rank * s + c
    return rank


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the block held at mesh coordinate ``coord``.

    Mirrors torch's ``compute_local_shape_and_global_offset``: each mesh dim,
    left to right, cuts the current local extent of its tensor dim again. An
    empty block's offset is the dim's global size (torch's convention).
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size, off = shard_size_and_offset(shape[p.dim], mesh_shape[mesh_dim], coord[mesh_dim])
            shape[p.dim] = size
            offset[p.dim] += off
    for p in placements:
        # As torch: an empty block's offset is the dim's global size, wherever it nests.
        if isinstance(p, Shard) and shape[p.dim] == 0:
            offset[p.dim] = global_shape[p.dim]
    return tuple(shape), tuple(offset)


def local_shape(global_shape, mesh_shape, placements, coord) -> tuple[int, ...]:
    """The shape of the block that mesh coordinate ``coord`` holds of ``global_shape`` (``torch.chunk`` cuts)."""
    return local_shape_and_offset(global_shape, mesh_shape, placements, coord)[0]


def local_shapes(global_shape, mesh_shape, placements) -> tuple[tuple[int, ...], ...]:
    """The local shape of every rank, indexed by rank."""
    return tuple(
        local_shape(global_shape, mesh_shape, placements, coord)
        for coord in itertools.product(*(range(s) for s in mesh_shape))
    )


def padded_local_shape(global_shape, mesh_shape, placements) -> tuple[int, ...]:
    """The largest local extent in each dim: the shape every rank's block is padded to.

    Per tensor dim this is the product of chunk sizes taken left to right, the
    size of rank 0's block, since torch.chunk puts the largest chunk first.
    """
    shape = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] = chunk_size(shape[p.dim], mesh_shape[mesh_dim])
    return tuple(shape)
