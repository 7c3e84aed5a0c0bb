"""``DTensor.visualize``: which ranks hold which block, as a text table."""

from __future__ import annotations

from placements import Partial, local_shape_and_offset, rank_to_coord

__all__ = ["visualize"]


def visualize(shape, mesh, placements, title: str) -> str:
    blocks: dict = {}
    for r in range(mesh.size()):
        coord = rank_to_coord(r, mesh.shape)
        ls, off = local_shape_and_offset(shape, mesh.shape, placements, coord)
        key = tuple((o, o + s) if s else (None, None) for o, s in zip(off, ls))
        blocks.setdefault(key, []).append(r)
    partial = [
        f"{p} over mesh dim {i} ({mesh.mesh_dim_names[i]})" for i, p in enumerate(placements) if isinstance(p, Partial)
    ]
    rows = []
    for key, ranks in blocks.items():
        if any(a is None for a, _ in key):
            blk = "(empty)"
        else:
            blk = "[" + ", ".join(f"{a}:{b}" for a, b in key) + "]" if key else "[] (scalar)"
        shp = str(tuple(0 if a is None else b - a for a, b in key))
        rows.append((blk, shp, ", ".join(str(r) for r in ranks)))
    w = max([len("block")] + [len(b) for b, _, _ in rows])
    v = max([len("shape")] + [len(s) for _, s, _ in rows])
    lines = [title, f"{'block':<{w}}  {'shape':<{v}}  ranks", f"{'-' * w}  {'-' * v}  -----"]
    lines += [f"{b:<{w}}  {s:<{v}}  {r}" for b, s, r in rows]
    if partial:
        lines.append("partial: " + "; ".join(partial) + " (each rank holds an unreduced value)")
    return "\n".join(lines)
