"""Op strategies of views (transpose, reshape, basic indexing): placements move with their dims,
nothing is communicated; a view that cannot keep a shard is refused with the redistribute to run.

Pure placement logic (no JAX), the view part of ``placements/_strategy.py``.
"""

from __future__ import annotations

import math
from typing import Sequence

from placements._plan import plan
from placements._strategy import Operand, OpStrategy, _shards
from placements._types import Replicate, Shard, format_placements

__all__ = ["transpose_strategy", "reshape_strategy", "index_strategy"]

R = Replicate()


def _local(op: str, mesh_shape, x: Operand, out_pl, out_shape) -> OpStrategy:
    p = plan(mesh_shape, x.shape, x.itemsize, x.placements, x.placements, where=op)
    return OpStrategy(op, tuple(mesh_shape), (x.placements,), tuple(out_pl), tuple(out_shape), (p,), ((),))


def transpose_strategy(mesh_shape, x: Operand, axes: Sequence[int]) -> OpStrategy:
    """A permutation moves each ``Shard(d)`` to ``Shard(axes.index(d))``; no communication."""
    axes = tuple(axes)
    out = tuple(Shard(axes.index(p.dim)) if isinstance(p, Shard) else p for p in x.placements)
    return _local("transpose", mesh_shape, x, out, tuple(x.shape[a] for a in axes))


def _view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pair up runs of dims of ``a`` and ``b`` with equal products (both non-empty tensors)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(i)
                pa *= a[i]
                i += 1
            else:
                outs.append(j)
                pb *= b[j]
                j += 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def reshape_strategy(mesh_shape, x: Operand, new_shape: Sequence[int]) -> OpStrategy:
    """A reshape keeps ``Shard(d)`` when every rank's block stays one contiguous block of the new
    shape: ``d`` is kept as is, is the leading dim of merged dims and evenly sharded, or is split
    with the leading new dim divisible by its shard count. Otherwise a ValueError says which
    redistribute makes it possible (no implicit communication)."""
    mesh_shape = tuple(mesh_shape)
    shape, new_shape = tuple(x.shape), tuple(new_shape)
    pl = x.placements
    sharded = sorted({p.dim for p in pl if isinstance(p, Shard)})
    out_dim: dict[int, int] = {}
    bad: list[str] = []
    if sharded and shape != new_shape:
        if math.prod(shape) == 0:
            bad = [f"dim {d}" for d in sharded]
        else:
            for ins, outs in _view_groups(shape, new_shape):
                for d in ins:
                    if d not in sharded:
                        continue
                    k = _shards(pl, mesh_shape, d)
                    if len(ins) == 1 and len(outs) == 1:
                        out_dim[d] = outs[0]
                    elif outs and d == ins[0] and len(outs) == 1 and shape[d] % k == 0 and not any(
                        e in sharded for e in ins[1:]
                    ):
                        out_dim[d] = outs[0]
                    elif outs and len(ins) == 1 and new_shape[outs[0]] % k == 0:
                        out_dim[d] = outs[0]
                    else:
                        bad.append(f"dim {d} (size {shape[d]}, {k} shards)")
    else:
        out_dim = {d: d for d in sharded}
    if bad:
        fix = tuple(R if isinstance(p, Shard) and f"dim {p.dim}" in " ".join(bad) else p for p in pl)
        raise ValueError(
            f"reshape: a tensor of shape {shape} placed {format_placements(pl)} cannot become shape {new_shape} "
            f"without communication: the shard of {', '.join(bad)} would not stay one contiguous block per rank. "
            f"Redistribute first, e.g. x.redistribute(placements={list(fix)!r}), then reshape."
        )
    out = tuple(Shard(out_dim[p.dim]) if isinstance(p, Shard) else p for p in pl)
    return _local("reshape", mesh_shape, x, out, new_shape)


def index_strategy(mesh_shape, x: Operand, index: tuple) -> OpStrategy:
    """Basic indexing (ints, slices, None, Ellipsis already expanded to one entry per dim plus
    Nones): dims taken whole keep their ``Shard``; an int or a partial slice on a sharded dim is
    refused (it would need the owning rank's data on every rank)."""
    mesh_shape = tuple(mesh_shape)
    pl = x.placements
    sharded = {p.dim for p in pl if isinstance(p, Shard)}
    new_pos: dict[int, int] = {}
    out_shape: list[int] = []
    d = 0
    for item in index:
        if item is None:
            out_shape.append(1)
            continue
        n = x.shape[d]
        if isinstance(item, int):
            if d in sharded:
                raise ValueError(
                    f"indexing: index {item!r} on dim {d}, which placements {format_placements(pl)} shard; index "
                    "only dims that are not sharded, or redistribute that dim to Replicate() first."
                )
        else:
            start, stop, step = item.indices(n)
            size = len(range(start, stop, step))
            if d in sharded and (start, size, step) != (0, n, 1):
                raise ValueError(
                    f"indexing: slice {item!r} on dim {d}, which placements {format_placements(pl)} shard; a sharded "
                    "dim can only be taken whole (:), or redistribute that dim to Replicate() first."
                )
            new_pos[d] = len(out_shape)
            out_shape.append(size)
        d += 1
    out = tuple(Shard(new_pos[p.dim]) if isinstance(p, Shard) else p for p in pl)
    return _local("indexing", mesh_shape, x, out, tuple(out_shape))
