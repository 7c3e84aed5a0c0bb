"""Cross-mesh redistribute plans: a tensor on one mesh to placements on another mesh
(different shape, different devices, or both). Pure placement logic, no JAX.

torch refuses this (pytorch#126795). The plan has three parts, each printable and costed:

1. on the source mesh, a redistribute plan to the *even layout*: every Partial reduced
   and every unevenly sharded dim gathered (what a ``NamedSharding`` can express);
2. a device-to-device transfer of that layout onto the destination mesh's even layout
   (``jax.device_put`` between the two ``NamedSharding``\\ s); its cost is counted per
   destination device: the bytes of its new block that the same physical device did not
   already hold;
3. on the destination mesh, the (local) steps from its even layout to the requested
   placements: slices for uneven shards, partitions for Partial.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

from placements._layout import local_shape_and_offset
from placements._plan import Plan, plan
from placements._types import Partial, Placement, Replicate, Shard, format_placements

__all__ = ["CrossMeshPlan", "even_layout", "cross_mesh_plan"]


def even_layout(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> tuple:
    """``placements`` with Partial replaced by Replicate and every unevenly cut dim replicated."""
    out = [Replicate() if isinstance(p, Partial) else p for p in placements]
    for d in {p.dim for p in out if isinstance(p, Shard)}:
        k = math.prod(s for s, p in zip(mesh_shape, out) if p == Shard(d))
        if shape[d] % k:
            out = [Replicate() if p == Shard(d) else p for p in out]
    return tuple(out)


def _box(shape, mesh_shape, pl, coord):
    size, off = local_shape_and_offset(shape, mesh_shape, pl, coord)
    return tuple((o, o + s) for o, s in zip(off, size))


def _overlap(a, b) -> int:
    return math.prod(max(0, min(x1, y1) - max(x0, y0)) for (x0, x1), (y0, y1) in zip(a, b))


@dataclasses.dataclass(frozen=True)
class CrossMeshPlan:
    """``src_plan`` (on the source mesh) -> transfer -> ``dst_plan`` (on the destination mesh).

    ``transfer_bytes``: per destination device (by its position in the destination mesh,
    row-major), the bytes of its block it receives from other devices.
    """

    src_mesh_shape: tuple[int, ...]
    dst_mesh_shape: tuple[int, ...]
    src_plan: Plan
    dst_plan: Plan
    transfer_bytes: tuple[int, ...]

    @property
    def bytes(self) -> int:
        """Bytes per device in the collective steps plus the most any device receives in the transfer."""
        return self.src_plan.cost().bytes + max(self.transfer_bytes, default=0) + self.dst_plan.cost().bytes

    def __str__(self) -> str:
        s, d = self.src_plan, self.dst_plan
        lines = [
            f"{format_placements(s.src)} on mesh {self.src_mesh_shape} -> {format_placements(d.dst)} on mesh "
            f"{self.dst_mesh_shape}  (cross-mesh, {self.bytes} B per device at most)",
            f"  1. on the source mesh: {format_placements(s.src)} -> {format_placements(s.dst)}  ({s.cost()})",
        ]
        lines += [f"       {st}" for st in s.steps]
        lines.append(
            f"  2. transfer {format_placements(s.dst)} -> {format_placements(d.src)} (jax.device_put between the "
            f"meshes): {sum(self.transfer_bytes)} B in all, at most {max(self.transfer_bytes, default=0)} B into one device"
        )
        lines.append(f"  3. on the destination mesh: {format_placements(d.src)} -> {format_placements(d.dst)}  ({d.cost()})")
        lines += [f"       {st}" for st in d.steps]
        return "\n".join(lines)


def cross_mesh_plan(
    shape: Sequence[int],
    itemsize: int,
    src_mesh_shape: Sequence[int],
    src_devices: Sequence[int],
    src: Sequence[Placement],
    dst_mesh_shape: Sequence[int],
    dst_devices: Sequence[int],
    dst: Sequence[Placement],
) -> CrossMeshPlan:
    """The plan; ``*_devices`` are the meshes' device ids in row-major order (checked placements)."""
    shape, src_ms, dst_ms = tuple(shape), tuple(src_mesh_shape), tuple(dst_mesh_shape)
    mid_src = even_layout(shape, src_ms, src)
    mid_dst = even_layout(shape, dst_ms, dst)
    p1 = plan(src_ms, shape, itemsize, tuple(src), mid_src, where="DTensor.redistribute (source mesh)")
    p3 = plan(dst_ms, shape, itemsize, mid_dst, tuple(dst), where="DTensor.redistribute (destination mesh)")
    held = {
        dev: _box(shape, src_ms, mid_src, c)
        for dev, c in zip(src_devices, itertools.product(*(range(s) for s in src_ms)))
    }
    moved = []
    for dev, c in zip(dst_devices, itertools.product(*(range(s) for s in dst_ms))):
        want = _box(shape, dst_ms, mid_dst, c)
        have = _overlap(want, held[dev]) if dev in held else 0
        moved.append((math.prod(b - a for a, b in want) - have) * itemsize)
    return CrossMeshPlan(src_ms, dst_ms, p1, p3, tuple(moved))
