"""Redistribute planning: the steps that turn one placement list into another.

A plan is data (torch's ``_TransformInfo`` list): a tuple of :class:`Step`,
each acting on a group of mesh dims that share one source placement and go
to one destination placement, with the collective it lowers to and the bytes
it moves per device. It is computed before anything runs, printed, costed,
and cached per (mesh shape, global shape, dtype, src, dst).

What each step kind is (legal or not, its collective, bytes and traffic)
comes from the transition table, ``placements/_transitions.py``. Bytes per
device follow the nccl-tests convention used by ``spmd.collectives``, counted
on the padded blocks the compiled program moves, so a plan's bytes equal the
bytes the compiled HLO reports.

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
from typing import NamedTuple, Sequence

from placements._layout import padded_local_shape
from placements._transitions import LINEAR_OPS, Transition, transition
from placements._types import Partial, Placement, Replicate, Shard, format_placements

__all__ = ["Step", "Plan", "PlanCost", "plan", "make_step", "check_partial_mix", "torch_greedy_steps", "LINEAR_OPS"]


#: The search's latency term: one collective costs as much as receiving this many bytes
#: (an alpha-beta model: a few us of launch latency at ~25 GB/s). It only decides between
#: plans whose traffic differs by less than this.
LATENCY_BYTES = 64 * 1024

#: The search weighs a byte moved by all_to_all this much more than one moved by a ring
#: collective: all_to_all is point-to-point and reaches a lower bus bandwidth (XLA:CPU's and
#: NCCL's alike; the figures in docs/benchmarks.md, "Measurements behind the code"). It keeps
#: ``S(0)S(1) -> S(1)S(0)`` on a 2x4 mesh at 2 collectives (all_gather + all_to_all) rather
#: than 3 all_to_alls receiving slightly fewer bytes.
ALL_TO_ALL_WEIGHT = 1.25


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: mesh dims ``mesh_dims`` go from ``src`` to ``dst`` with ``collective``.

    ``collective`` is None for a local step. ``bytes`` is per device (nccl-tests
    convention), ``traffic`` the bus bytes. ``before`` / ``after`` are the whole
    placement lists. ``lowering`` names the transition's lowering function (see
    ``placements/_transitions.py``): the executor dispatches on it.
    """

    mesh_dims: tuple[int, ...]
    src: Placement
    dst: Placement
    collective: str | None
    bytes: int
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    traffic: float
    lowering: str

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


class _Edge(NamedTuple):
    """One step out of a search state: ``group`` goes from ``src`` to ``dst`` by ``transition``."""

    group: tuple[int, ...]
    src: Placement
    dst: Placement
    transition: Transition
    collective: str | None
    bytes: int
    after: tuple[Placement, ...]
    traffic: float

    def step(self, before: tuple[Placement, ...]) -> Step:
        return Step(
            self.group, self.src, self.dst, self.collective, self.bytes, before, self.after, self.traffic,
            self.transition.lowering,
        )


def _neighbours(state, candidates, mesh_shape, global_shape, itemsize, padded):
    """The edges out of ``state``: every group of equal placements to every legal target."""
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
                tr = transition(c, t)
                if t == c or tr is None:
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
                yield _edge(group, c, t, tr, state, after, k, itemsize, padded, empty)


def _edge(group, c, t, tr: Transition, state, after, k: int, itemsize: int, padded, empty: bool) -> _Edge:
    if k == 1 or empty:  # nothing to communicate
        return _Edge(group, c, t, tr, None, 0, after, 0.0)
    b = tr.bytes(c, t, padded(state), padded(after), k, itemsize)
    return _Edge(group, c, t, tr, tr.collective, b, after, tr.traffic(b, k))


def make_step(mesh_shape, global_shape, itemsize: int, before, mesh_dims: Sequence[int], dst: Placement) -> Step | None:
    """The step taking mesh dims ``mesh_dims`` of placement list ``before`` (all equal) to
    ``dst``, costed as the planner costs it; None if the transition table has no such step.
    (No nesting or Partial-mix check: for costing other planners' steps.)"""
    before, group = tuple(before), tuple(mesh_dims)
    c = before[group[0]]
    tr = transition(c, dst)
    if tr is None or dst == c:
        return None
    after = tuple(dst if i in group else p for i, p in enumerate(before))
    k = math.prod(mesh_shape[i] for i in group)

    def padded(pl):
        return padded_local_shape(global_shape, mesh_shape, pl)

    return _edge(group, c, dst, tr, before, after, k, itemsize, padded, math.prod(global_shape) == 0).step(before)


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

    # Dijkstra on (traffic + LATENCY_BYTES * collectives, traffic, collectives, steps);
    # ties broken by insertion order (deterministic).
    start = (0.0, 0.0, 0, 0)
    best = {src: start}
    heap = [(start, 0, src, None)]
    counter = itertools.count(1)
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dst:
            steps = []
            while path is not None:
                path, edge, before = path
                steps.append(edge.step(before))
            return Plan(mesh_shape, global_shape, itemsize, src, dst, tuple(reversed(steps)))
        if best.get(state, cost) < cost:
            continue
        for edge in _neighbours(state, cands, mesh_shape, global_shape, itemsize, padded):
            coll = edge.collective is not None
            weighted = edge.traffic * ALL_TO_ALL_WEIGHT if edge.collective == "all_to_all" else edge.traffic
            new = (cost[0] + weighted + LATENCY_BYTES * coll, cost[1] + edge.traffic, cost[2] + coll, cost[3] + 1)
            if edge.after not in best or new < best[edge.after]:
                best[edge.after] = new
                heapq.heappush(heap, (new, next(counter), edge.after, (path, edge, state)))
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
