"""Redistribute planning: the steps that turn one placement list into another.

A plan is data (torch's ``_TransformInfo`` list): a tuple of :class:`Step`,
each acting on a group of mesh dims that share one source placement and go
to one destination placement, with the collective it lowers to and the bytes
it moves per device. It is computed before anything runs, printed, costed,
and cached per (mesh shape, global shape, dtype, src, dst).

Lowering of one step on a group ``G`` of mesh dims (``K`` devices):

========================  ==========================================================
``S(a) -> R``             all_gather (pad to chunk, gather, compact)
``S(a) -> S(b)``          all_to_all (split ``b`` into ``K`` chunks, concat on ``a``)
``P(op) -> R``            all_reduce with ``op`` (``product``: all_gather + local product)
``P(sum|avg) -> S(b)``    reduce_scatter
``P(max|min|product)``    ``-> S(b)``: all_to_all + local reduce (same bytes)
``R -> S(b)``             local slice
``R -> P(op)``            local: ``sum`` keeps the value on group rank 0 and zeros
                          elsewhere, ``product`` ones elsewhere, ``avg/max/min`` keep it
``S(a) -> P(op)``         local for ``sum/max/min/product``: the block at its offset in
                          a tensor filled with the op's identity (``avg`` goes via ``R``)
========================  ==========================================================

Bytes per device follow the nccl-tests convention used by ``spmd.collectives``
(``spmd/_inspect.py``), counted on the padded blocks the compiled program
moves: all_gather counts the gathered result, reduce_scatter its input,
all_reduce and all_to_all their buffer. So a plan's bytes equal the bytes
the compiled HLO reports.

A step on group ``G`` that touches tensor dim ``d`` (as source or destination
``Shard``) is allowed only if every other mesh dim sharding ``d`` comes
before all of ``G``: torch's nesting rule (mesh dims shard a tensor dim left
to right), under which every step is a plain collective over ``G``. The
planner searches all step orders (Dijkstra over placement lists) for the
cheapest plan in an alpha-beta model: the bytes each device receives with
bandwidth-optimal algorithms (``traffic``: ``bytes * (K-1)/K``, twice that for
all_reduce, as nccl-tests' bus bandwidth) plus ``LATENCY_BYTES`` per
collective (all_to_all bytes weighted by ``ALL_TO_ALL_WEIGHT``); ties go to less traffic, fewer collectives, fewer steps. Groups
of several mesh dims give the direct (flattened) all_to_all / all_gather /
all_reduce of torch's graph planner.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from typing import Sequence

from placements._layout import padded_local_shape
from placements._types import Partial, Placement, Replicate, Shard, format_placements

__all__ = ["Step", "Plan", "PlanCost", "plan", "check_partial_mix", "torch_greedy_steps", "LINEAR_OPS"]

#: Partial ops that commute with each other (torch allows sum and avg together).
LINEAR_OPS = frozenset({"sum", "avg"})

_COLLECTIVES = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")

#: The search's latency term: one collective costs as much as receiving this many bytes
#: (an alpha-beta model: a few us of launch latency at ~25 GB/s). It only decides between
#: plans whose traffic differs by less than this.
LATENCY_BYTES = 64 * 1024

#: The search weighs a byte moved by all_to_all this much more than one moved by a ring
#: collective: all_to_all is point-to-point and reaches a lower bus bandwidth (measured by
#: benchmarks/collectives.py on 8 XLA:CPU devices: 0.2-0.6 GB/s against 1.0-2.5 GB/s for
#: all_gather / reduce_scatter; NCCL's all_to_all also trails its ring collectives). Above
#: 1.14 it keeps ``S(0)S(1) -> S(1)S(0)`` on a 2x4 mesh at 2 collectives (all_gather +
#: all_to_all) at every size instead of 3 all_to_alls receiving 5% fewer bytes.
ALL_TO_ALL_WEIGHT = 1.25


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: mesh dims ``mesh_dims`` go from ``src`` to ``dst`` with ``collective``.

    ``collective`` is None for a local step. ``bytes`` is per device (nccl-tests
    convention). ``before`` / ``after`` are the whole placement lists.
    """

    mesh_dims: tuple[int, ...]
    src: Placement
    dst: Placement
    collective: str | None
    bytes: int
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    traffic: float = 0.0

    @property
    def mesh_dim(self) -> int | tuple[int, ...]:
        """The mesh dim (an int), or the tuple of mesh dims of a flattened step."""
        return self.mesh_dims[0] if len(self.mesh_dims) == 1 else self.mesh_dims

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.mesh_dims)
        what = self.collective or "local"
        return (
            f"{format_placements(self.before)} -> {format_placements(self.after)}  "
            f"[mesh dim {dims}: {self.src} -> {self.dst}, {what}, {self.bytes} B]"
        )


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """``bytes``: per device, nccl-tests convention (what ``spmd.collectives`` reads from the HLO).
    ``collectives``: how many. ``traffic``: bytes a device receives with bandwidth-optimal (ring)
    algorithms, nccl-tests' "bus bytes": ``bytes * (K-1)/K``, twice that for all_reduce."""

    bytes: int
    collectives: int
    traffic: float = 0.0

    def __str__(self) -> str:
        return f"{self.bytes} B per device in {self.collectives} collective(s)"


@dataclasses.dataclass(frozen=True)
class Plan:
    """An immutable redistribute plan: ``src -> dst`` as a tuple of :class:`Step`."""

    mesh_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    itemsize: int
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[Step, ...]

    def cost(self) -> PlanCost:
        """Bytes per device (nccl-tests convention, padded blocks) and collective count."""
        return PlanCost(
            sum(s.bytes for s in self.steps),
            sum(1 for s in self.steps if s.collective is not None),
            sum(s.traffic for s in self.steps),
        )

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(s.collective for s in self.steps if s.collective is not None)

    def __str__(self) -> str:
        head = f"{format_placements(self.src)} -> {format_placements(self.dst)}"
        c = self.cost()
        lines = [f"{head}  ({c.bytes} B per device, {c.collectives} collective(s))"]
        lines += [f"  {i}. {s}" for i, s in enumerate(self.steps)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Plan({format_placements(self.src)} -> {format_placements(self.dst)}, mesh_shape={self.mesh_shape}, "
            f"global_shape={self.global_shape}, steps={len(self.steps)}, bytes={self.cost().bytes})"
        )


def check_partial_mix(placements: Sequence[Placement], where: str) -> None:
    """Refuse mixed Partial ops in one list, as torch does (sum and avg may mix)."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1 and not ops <= LINEAR_OPS:
        raise ValueError(
            f"{where}={format_placements(placements)} mixes Partial ops {sorted(ops)}; a DTensor may mix only "
            "'sum' and 'avg' (as in torch): reduce one of them to Replicate first."
        )


def _step_kind(c: Placement, t: Placement) -> str | None | bool:
    """The collective of a one-group step ``c -> t``; None for local; False if not a step."""
    if isinstance(c, Shard):
        if isinstance(t, Replicate):
            return "all_gather"
        if isinstance(t, Shard):
            return "all_to_all"
        return None if t.reduce_op != "avg" else False  # S -> P(op): local identity fill
    if isinstance(c, Replicate):
        return None  # R -> S slices, R -> P partitions
    # c is Partial
    if isinstance(t, Replicate):
        return "all_gather" if c.reduce_op == "product" else "all_reduce"
    if isinstance(t, Shard):
        return "reduce_scatter" if c.reduce_op in LINEAR_OPS else "all_to_all"
    return False  # P -> P of another op: never


def _step_bytes(kind, c, t, before, after, mesh_shape, global_shape, itemsize, k, padded=None) -> int:
    if kind is None or k == 1:
        return 0
    pad = padded or (lambda pl: padded_local_shape(global_shape, mesh_shape, pl))
    sb = list(pad(before))
    if kind == "all_gather" and isinstance(c, Shard):
        sb[c.dim] *= k
    elif kind == "all_gather":  # product all-reduce: gather K full blocks
        sb = [k] + sb
    elif isinstance(t, Shard):  # all_to_all or reduce_scatter: dim t.dim split into K chunks
        sb[t.dim] = k * pad(after)[t.dim]
    return math.prod(sb) * itemsize


def _traffic(kind, c, nbytes: int, k: int) -> float:
    """Bus bytes (nccl-tests): what a device receives with a ring algorithm."""
    if kind is None or k == 1:
        return 0.0
    f = (k - 1) / k
    if kind == "all_gather" and isinstance(c, Partial):  # product all-reduce: gather K blocks
        return nbytes * f
    return nbytes * f * (2 if kind == "all_reduce" else 1)


def _neighbours(state, candidates, mesh_shape, global_shape, itemsize, padded, kinds):
    """Edges out of ``state``: tuples (group, src, dst, collective, bytes, after, traffic)."""
    nd = len(state)
    empty = math.prod(global_shape) == 0
    for r in range(1, nd + 1):
        for group in itertools.combinations(range(nd), r):
            c = state[group[0]]
            if any(state[i] != c for i in group[1:]):
                continue
            lo = group[0]
            later = [state[j].dim for j in range(lo + 1, nd) if j not in group and isinstance(state[j], Shard)]
            k = math.prod(mesh_shape[i] for i in group)
            for t in candidates:
                if t == c:
                    continue
                kind = kinds[c, t]
                if kind is False:
                    continue
                if later and (
                    (isinstance(c, Shard) and c.dim in later) or (isinstance(t, Shard) and t.dim in later)
                ):
                    continue  # torch's nesting rule
                after = tuple(t if i in group else p for i, p in enumerate(state))
                if isinstance(t, Partial):
                    ops = {p.reduce_op for p in after if isinstance(p, Partial)}
                    if len(ops) > 1 and not ops <= LINEAR_OPS:
                        continue
                if k == 1 or empty:  # nothing to communicate
                    kind = None
                b = _step_bytes(kind, c, t, state, after, mesh_shape, global_shape, itemsize, k, padded)
                yield group, c, t, kind, b, after, _traffic(kind, c, b, k)


@functools.lru_cache(maxsize=4096)
def _plan_cached(mesh_shape, global_shape, itemsize, src, dst) -> Plan:
    if src == dst:
        return Plan(mesh_shape, global_shape, itemsize, src, dst, ())
    cands = [Replicate()] + sorted(
        {p for p in src + dst if isinstance(p, Shard)}, key=lambda p: p.dim
    ) + [p for p in dict.fromkeys(dst) if isinstance(p, Partial)]
    memo: dict = {}

    def padded(pl):
        v = memo.get(pl)
        if v is None:
            v = memo[pl] = padded_local_shape(global_shape, mesh_shape, pl)
        return v

    every = set(src) | set(cands)
    kinds = {(a, b): _step_kind(a, b) for a in every for b in cands}
    # Dijkstra on (traffic + LATENCY_BYTES * collectives, traffic, collectives, steps);
    # ties broken by insertion order (deterministic).
    start = (0.0, 0.0, 0, 0)
    best = {src: start}
    heap = [(start, 0, src, None)]
    counter = itertools.count(1)
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dst:
            edges = []
            while path is not None:
                path, edge, before = path
                edges.append((edge, before))
            steps = tuple(
                Step(g, c, t, kind, b, before, after, tr) for (g, c, t, kind, b, after, tr), before in reversed(edges)
            )
            return Plan(mesh_shape, global_shape, itemsize, src, dst, steps)
        if best.get(state, cost) < cost:
            continue
        for edge in _neighbours(state, cands, mesh_shape, global_shape, itemsize, padded, kinds):
            coll = edge[3] is not None
            tr = edge[6]
            weighted = tr * ALL_TO_ALL_WEIGHT if edge[3] == "all_to_all" else tr
            new = (cost[0] + weighted + LATENCY_BYTES * coll, cost[1] + tr, cost[2] + coll, cost[3] + 1)
            nxt = edge[5]
            if nxt not in best or new < best[nxt]:
                best[nxt] = new
                heapq.heappush(heap, (new, next(counter), nxt, (path, edge, state)))
    raise ValueError(
        f"plan_redistribute: no plan from {format_placements(src)} to {format_placements(dst)}; "
        "a Partial op cannot be switched to another (reduce to Replicate first)."
    )


def plan(
    mesh_shape: Sequence[int],
    global_shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    *,
    where: str = "plan_redistribute",
) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` (checked placement lists, non-negative Shard dims)."""
    src, dst = tuple(src), tuple(dst)
    check_partial_mix(src, f"{where}: src placements")
    check_partial_mix(dst, f"{where}: placements")
    for i, (a, b) in enumerate(zip(src, dst)):
        if isinstance(a, Partial) and isinstance(b, Partial) and a != b:
            raise ValueError(
                f"{where}: placements[{i}]={b} would switch mesh dim {i} from {a} to {b}; switching a Partial op "
                f"is refused (as in torch): redistribute to Replicate (or Shard) first, then to {b}."
            )
    return _plan_cached(tuple(mesh_shape), tuple(global_shape), int(itemsize), src, dst)


def torch_greedy_steps(src: Sequence[Placement], dst: Sequence[Placement]) -> list:
    """The steps torch 2.13's default planner (``generate_greedy_transform_infos``) takes,
    as ``(mesh_dim, src, dst, placements_before)``: an inner-to-outer pass that replicates
    misaligned nested shards, then an outer-to-inner pass. For comparing plans with torch's
    (tests check it against torch's own planner)."""
    cur, tgt = list(src), list(dst)
    steps = []
    if any(isinstance(p, Shard) for p in src):
        for m in reversed(range(len(cur))):
            c, t = cur[m], tgt[m]
            if isinstance(t, Shard):
                cm = [i for i in range(m) if cur[i] == Shard(t.dim)]
                tm = [i for i in range(m) if tgt[i] == Shard(t.dim)]
                if cm != tm:
                    t = Replicate()
            if c != t:
                steps.append((m, c, t, tuple(cur)))
                cur[m] = t
    for m, (c, t) in enumerate(zip(cur, tgt)):
        if c != t:
            steps.append((m, c, t, tuple(cur)))
            cur[m] = t
    return steps
