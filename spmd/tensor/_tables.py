"""Index tables of a redistribute step: which element of which block goes where.

Pure NumPy, shared by the JAX lowering (``_lower.py``) and the NumPy simulator
(``spmd/testing``). A step is a collective over a group of mesh dims plus
*compactions*: a gather of indices along one tensor dim with a static table
per device (a row per device, indexed by its linear position). The tables
come from the layout math alone (``local_shape_and_offset``), so uneven and
nested shards need no special case: a collective moves padded chunks, a
compaction drops the padding. Entries: an index into the input dim,
``DONT_CARE`` (padding) or ``IDENTITY`` (inside the block, held by nobody: the
op's identity).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from placements import local_shape, local_shape_and_offset, padded_local_shape, rank_to_coord
from placements._plan import Step

__all__ = ["DONT_CARE", "IDENTITY", "Geometry", "geometry", "coords", "group_rank", "size_table"]

DONT_CARE = -1  # padding: any value
IDENTITY = -2  # inside the logical block, but held by nobody: the op's identity


def coords(mesh_shape) -> list[tuple[int, ...]]:
    """Every mesh coordinate, in linear (row-major) order."""
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _blocks(global_shape, mesh_shape, placements):
    """(offsets, sizes): int arrays of shape (devices, ndim)."""
    offs, sizes = [], []
    for c in coords(mesh_shape):
        s, o = local_shape_and_offset(global_shape, mesh_shape, placements, c)
        sizes.append(s)
        offs.append(o)
    shape = (len(offs), len(global_shape))  # explicit: a 0-d tensor has (devices, 0) tables
    return np.array(offs, dtype=np.int64).reshape(shape), np.array(sizes, dtype=np.int64).reshape(shape)


def _members(mesh_shape, group):
    """For every device (linear index), the linear indices of its group, by group rank."""
    cs = coords(mesh_shape)
    lin = {c: i for i, c in enumerate(cs)}
    out = []
    for c in cs:
        mem = []
        for g in itertools.product(*(range(mesh_shape[d]) for d in group)):
            cc = list(c)
            for d, v in zip(group, g):
                cc[d] = v
            mem.append(lin[tuple(cc)])
        out.append(mem)
    return out


def group_rank(mesh_shape, group, coord) -> int:
    """The rank of the device at ``coord`` in its group over mesh dims ``group``."""
    r = 0
    for d in group:
        r = r * mesh_shape[d] + coord[d]
    return r


@dataclasses.dataclass(frozen=True, eq=False)
class Geometry:
    """A step's blocks before (``boff``/``bsize``, padded ``sb``) and after (``aoff``/``asize``,
    padded ``sa``), its group's ``members`` per device, the group size ``k``, and per device
    whether it is its group's rank 0 (``first``)."""

    boff: np.ndarray
    bsize: np.ndarray
    aoff: np.ndarray
    asize: np.ndarray
    sb: tuple[int, ...]
    sa: tuple[int, ...]
    members: list
    k: int
    first: np.ndarray  # per device: is it rank 0 of its group?

    def gather(self, dim: int, *, need_all: bool = True) -> np.ndarray:
        """Table along ``dim`` after a collective that concatenates the group members' padded
        blocks (``sb[dim]`` each): position ``t`` of my new block <- the member holding it."""
        chunk, out_len = self.sb[dim], self.sa[dim]
        n = len(self.members)
        table = np.full((n, out_len), DONT_CARE, dtype=np.int64)
        for dev in range(n):
            for t in range(self.asize[dev, dim]):
                g = self.aoff[dev, dim] + t
                for r, m in enumerate(self.members[dev]):
                    if self.boff[m, dim] <= g < self.boff[m, dim] + self.bsize[m, dim]:
                        table[dev, t] = r * chunk + g - self.boff[m, dim]
                        break
                else:
                    if need_all:
                        raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} held by no member")
                    table[dev, t] = IDENTITY
        return table

    def split(self, dim: int) -> np.ndarray:
        """Table along ``dim`` before a collective that sends chunk ``r`` to group rank ``r``:
        chunk ``r`` (``sa[dim]`` long) holds member ``r``'s new block, taken from my old block."""
        chunk = self.sa[dim]
        n = len(self.members)
        table = np.full((n, self.k * chunk), DONT_CARE, dtype=np.int64)
        for dev in range(n):
            for r, m in enumerate(self.members[dev]):
                for u in range(self.asize[m, dim]):
                    g = self.aoff[m, dim] + u
                    if not self.boff[dev, dim] <= g < self.boff[dev, dim] + self.bsize[dev, dim]:
                        raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} not held locally")
                    table[dev, r * chunk + u] = g - self.boff[dev, dim]
        return table

    def local(self, dim: int, *, fill_missing: bool) -> np.ndarray:
        """Table along ``dim`` of a local step: my new block from my old one (``IDENTITY`` where
        the old block does not hold an element, if ``fill_missing``)."""
        n = self.boff.shape[0]
        table = np.full((n, self.sa[dim]), DONT_CARE, dtype=np.int64)
        for dev in range(n):
            for t in range(self.asize[dev, dim]):
                g = self.aoff[dev, dim] + t
                if self.boff[dev, dim] <= g < self.boff[dev, dim] + self.bsize[dev, dim]:
                    table[dev, t] = g - self.boff[dev, dim]
                elif fill_missing:
                    table[dev, t] = IDENTITY
                else:
                    raise RuntimeError(f"redistribute: internal error, element {g} of dim {dim} not held locally")
        return table


def geometry(step: Step, mesh_shape, global_shape) -> Geometry:
    boff, bsize = _blocks(global_shape, mesh_shape, step.before)
    aoff, asize = _blocks(global_shape, mesh_shape, step.after)
    return Geometry(
        boff, bsize, aoff, asize,
        padded_local_shape(global_shape, mesh_shape, step.before),
        padded_local_shape(global_shape, mesh_shape, step.after),
        _members(mesh_shape, step.mesh_dims),
        math.prod(mesh_shape[d] for d in step.mesh_dims),
        np.array([group_rank(mesh_shape, step.mesh_dims, c) == 0 for c in coords(mesh_shape)]),
    )


def size_table(shape, mesh_shape, placements, dims=None) -> np.ndarray:
    """Every device's local size along ``dims`` (default: every dim), torch.chunk's: a row per
    device, by linear position."""
    dims = range(len(shape)) if dims is None else dims
    n = math.prod(mesh_shape)
    rows = [local_shape(shape, mesh_shape, placements, rank_to_coord(r, mesh_shape)) for r in range(n)]
    return np.array([[row[d] for d in dims] for row in rows], dtype=np.int32).reshape(n, len(dims))
