"""Pipeline schedules as data: which micro-batch each rank runs forward or backward at each tick.

A schedule is built in two steps, both plain Python (no JAX):

1. *Orders*: each rank's list of actions, ``F(chunk, mb)`` / ``B(chunk, mb)``, in the order it runs them
   (GPipe: every forward, then every backward; 1F1B: ``2 (pp - 1 - rank)`` warm-up forwards, then one
   forward and one backward alternately, then the cool-down backwards; interleaved: Megatron's interleaved
   1F1B over ``v`` chunks per rank, chunk ``c`` on rank ``c % pp``, whose warm-up is
   ``2 (pp - 1 - rank) + (v - 1) pp``; looped BFS (torch's ``ScheduleLoopedBFS``): GPipe over the ``v``
   chunks, every forward of each chunk in turn, then every backward, the last chunk's first).
2. *Ticks*: a tick holds at most one forward and one backward per rank. A rank takes its next actions in
   order, as many as are runnable and fit (a forward and a backward, either order): ``F(c, m)`` needs
   ``F(c - 1, m)`` done at an earlier tick (the activation travels between ticks), ``B(c, m)`` needs
   ``B(c + 1, m)`` done earlier (the last chunk: its own ``F``). A rank with nothing runnable idles.

Why a forward and a backward per tick: the program runs in lockstep (every tick's sends are one
``ppermute``), so a tick lasts as long as its slowest rank. Were a tick one action, a tick in which one rank
runs a backward and its neighbour a forward would last the backward (about 2-3 forwards here: it recomputes
the stage), and 1F1B's steady state alternates exactly so: its timed bubble grows far over the formula
(pp=4, M=16: 0.40 against 0.16). With every rank running one of each per tick in the steady state, each
tick lasts ``t_F + t_B`` on every rank, and the bubble equals the formula at any ratio of the two. The
price is the warm-up: a micro-batch's round trip from rank ``r`` to the last stage and back takes
``2 (pp - 1 - r) + 1`` ticks, and rank ``r`` starts one forward per tick meanwhile, so under 1F1B a rank
``r > 0`` stashes ``min(2 (pp - r), M)`` received activations (rank 1: ``2 pp - 2``; still independent of
``M``) where one action per tick stashed ``min(pp - r + 1, M)``. A lockstep program cannot have that
stash and the formula's bubble both when a backward outlasts a forward; torch's MPMD runtime can, its
ranks not waiting for each other's ticks.

The table then assigns buffer *slots*: an activation a rank receives is written into an activation slot at
the end of the tick it was sent and read by the forward and the backward (which recomputes the stage from
it); a received gradient sits in a gradient slot until its backward. Slots are reused as soon as they are
free, so a rank's slot count is the number of micro-batches it holds alive: the schedule's activation bound.

``bubble``: with every action one unit of time (a chunk's forward and its backward take equal time), a tick
lasts the most actions a rank runs in it (``widths``); bubble = idle rank-units / all rank-units.
``formula``: ``(pp - 1) / (M + pp - 1)`` (GPipe, 1F1B) and
``(pp - 1) / (v M + pp - 1)`` (interleaved, looped BFS).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "Schedule", "build_schedule", "bubble_formula"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")
CHUNKED = ("interleaved", "looped_bfs")  # the schedules with v = stages_per_rank chunks per rank


@dataclass(frozen=True)
class Action:
    """One tick's work on one rank: ``kind`` ``"F"`` or ``"B"`` of global chunk ``chunk`` on micro-batch ``mb``."""

    kind: str
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


def bubble_formula(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    v = stages_per_rank if schedule in CHUNKED else 1
    return (pp - 1) / (v * num_microbatches + pp - 1)


def _orders(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            o = [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        elif schedule == "1f1b":
            w = min(2 * (pp - 1 - r), m)  # the round trip in ticks (see the module doc)
            o = [Action("F", r, i) for i in range(w)]
            for i in range(m - w):
                o += [Action("F", r, w + i), Action("B", r, i)]
            o += [Action("B", r, i) for i in range(m - w, m)]
        elif schedule == "looped_bfs":
            cs = [k * pp + r for k in range(v)]
            o = ([Action("F", c, i) for c in cs for i in range(m)]
                 + [Action("B", c, i) for c in cs[::-1] for i in range(m)])
        else:  # Megatron's interleaved 1F1B (M a multiple of pp)
            total = m * v

            def mb(k):
                return (k // (pp * v)) * pp + k % pp

            def fwd(k):
                return Action("F", ((k // pp) % v) * pp + r, mb(k))

            def bwd(k):
                return Action("B", (v - 1 - (k // pp) % v) * pp + r, mb(k))

            w = min((pp - r - 1) * 2 + (v - 1) * pp, total)
            o = [fwd(k) for k in range(w)]
            for k in range(total - w):
                o += [fwd(w + k), bwd(k)]
            o += [bwd(k) for k in range(total - w, total)]
        orders.append(o)
    return orders


@dataclass(frozen=True)
class Schedule:
    """The tick table of one schedule (see the module doc). ``ticks[t][r]``: rank ``r``'s actions at tick ``t``
    (a tuple: empty when idle, else a forward, a backward or one of each, forward first). ``x_slot`` /
    ``g_slot``: ``{(rank, chunk, mb): slot}`` of the activations and gradients a
    rank receives; ``x_slots`` / ``g_slots``: slots per rank."""

    name: str
    pp: int
    num_microbatches: int
    stages_per_rank: int
    ticks: tuple[tuple[tuple[Action, ...], ...], ...]
    x_slot: tuple[tuple[tuple[int, int, int], int], ...]
    g_slot: tuple[tuple[tuple[int, int, int], int], ...]
    x_slots: tuple[int, ...]
    g_slots: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def actions(self, kind: str) -> list[list[Action | None]]:
        """Per tick, per rank: its ``kind`` (``"F"`` / ``"B"``) action, ``None`` where it runs none."""
        return [[next((a for a in acts if a.kind == kind), None) for acts in row] for row in self.ticks]

    @property
    def widths(self) -> tuple[int, ...]:
        """Per tick: the most actions a rank runs in it (0, 1 or 2), its length with every action one unit."""
        return tuple(max(map(len, row)) for row in self.ticks)

    @property
    def idle(self) -> int:
        """Idle rank-units: ``pp x sum(widths)`` less the actions run."""
        return self.pp * sum(self.widths) - sum(len(acts) for row in self.ticks for acts in row)

    @property
    def bubble(self) -> float:
        return self.idle / (self.pp * sum(self.widths))

    def timed(self, t_f: float, t_b: float) -> dict:
        """The table replayed with a forward lasting ``t_f`` and a backward ``t_b``: ``lockstep`` (each tick
        lasts its slowest rank, as this SPMD program runs) and ``async`` (each rank starts an action once its
        inputs exist, as an MPMD runtime runs the same orders): the bubble and the seconds of each."""
        dur = {"F": t_f, "B": t_b}
        busy = sum(dur[a.kind] for row in self.ticks for acts in row for a in acts)
        lock = sum(max(sum(dur[a.kind] for a in acts) for acts in row) for row in self.ticks)
        free, fin = [0.0] * self.pp, {}
        for row in self.ticks:
            for r, acts in enumerate(row):
                for a in acts:
                    start = max([free[r]] + [fin[d] for d in _needs(a, self.num_stages)])
                    fin[(a.kind, a.chunk, a.mb)] = free[r] = start + dur[a.kind]
        return {"lockstep": 1 - busy / (self.pp * lock), "async": 1 - busy / (self.pp * max(free)),
                "lockstep_s": lock, "async_s": max(free)}

    @property
    def formula(self) -> float:
        return bubble_formula(self.name, self.pp, self.num_microbatches, self.stages_per_rank)

    def sends(self, kind: str) -> list[list[tuple[int, int]]]:
        """Per tick, the ``(src, dst)`` rank pairs of the activations (``"F"``) or their gradients (``"B"``)
        sent at the end of it."""
        out = []
        s = self.num_stages
        for row in self.actions(kind):
            pairs = []
            for r, a in enumerate(row):
                if a is None:
                    continue
                if kind == "F" and a.chunk < s - 1:
                    pairs.append((r, self.rank_of(a.chunk + 1)))
                if kind == "B" and a.chunk > 0:
                    pairs.append((r, self.rank_of(a.chunk - 1)))
            out.append(pairs)
        return out

    def transfers(self) -> dict[str, int]:
        """Activation (``forward``) and gradient (``backward``) transfers between ranks per step, of one
        micro-batch each: ``M x (stages - 1)`` each way."""
        return {"forward": sum(map(len, self.sends("F"))), "backward": sum(map(len, self.sends("B")))}

    def __str__(self) -> str:
        def cell(acts):
            return "+".join(map(str, acts)) or "."

        width = max(4, *(len(cell(acts)) + 1 for row in self.ticks for acts in row))
        head = f"{self.name}: pp={self.pp}, M={self.num_microbatches}" + (
            f", v={self.stages_per_rank}" if self.name in CHUNKED else "")
        lines = [head + f"; {len(self.ticks)} ticks, bubble {self.bubble:.4f} (formula {self.formula:.4f}); "
                 f"activation slots per rank {list(self.x_slots)}, gradient slots {list(self.g_slots)}"]
        lines.append("tick " + "".join(f"{t:>{width}}" for t in range(len(self.ticks))))
        for r in range(self.pp):
            cells = [cell(row[r]) for row in self.ticks]
            lines.append(f"pp{r:<3}" + "".join(f"{c:>{width}}" for c in cells))
        return "\n".join(lines)


def _needs(a: Action, stages: int) -> list[tuple[str, int, int]]:
    """The actions ``a`` reads the output of (done at an earlier tick)."""
    if a.kind == "F":
        return [("F", a.chunk - 1, a.mb)] if a.chunk > 0 else []
    return [("F", a.chunk, a.mb)] + ([("B", a.chunk + 1, a.mb)] if a.chunk < stages - 1 else [])


def _simulate(orders: list[list[Action]], pp: int, stages: int) -> list[tuple[tuple[Action, ...], ...]]:
    done: dict[tuple[str, int, int], int] = {}
    ptr = [0] * pp
    ticks: list[tuple[tuple[Action, ...], ...]] = []
    total = sum(map(len, orders))
    t = 0
    while sum(ptr) < total:
        row = []
        for r in range(pp):
            took: list[Action] = []
            while ptr[r] + len(took) < len(orders[r]):
                a = orders[r][ptr[r] + len(took)]
                if any(b.kind == a.kind for b in took) or not all(done.get(k, t) < t for k in _needs(a, stages)):
                    break
                took.append(a)
            row.append(tuple(sorted(took, key=lambda a: a.kind, reverse=True)))  # F first
        for r, acts in enumerate(row):
            for a in acts:
                done[(a.kind, a.chunk, a.mb)] = t
            ptr[r] += len(acts)
        ticks.append(tuple(row))
        t += 1
        if t > 4 * total + 4:
            raise RuntimeError(f"pipeline schedule: the orders deadlock at tick {t}: {orders}")
    return ticks


def _assign(intervals: list[tuple[int, int, tuple]]) -> tuple[dict, int]:
    """Greedy interval colouring: ``(first tick alive, last tick alive, key)`` -> ``{key: slot}``, slot count."""
    free_at: list[int] = []  # per slot: the last tick it is alive
    out = {}
    for start, end, key in sorted(intervals):
        slot = next((i for i, last in enumerate(free_at) if last < start), None)
        if slot is None:
            slot = len(free_at)
            free_at.append(end)
        else:
            free_at[slot] = end
        out[key] = slot
    return out, len(free_at)


def build_schedule(name: str, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The tick table of schedule ``name`` (one of ``SCHEDULES``) on ``pp`` ranks and ``num_microbatches``."""
    m, v = num_microbatches, stages_per_rank
    if name not in CHUNKED:
        v = 1
    stages = pp * v
    ticks = _simulate(_orders(name, pp, m, v), pp, stages)
    when = {(a.kind, a.chunk, a.mb): t for t, row in enumerate(ticks) for acts in row for a in acts}
    x_iv: list[list] = [[] for _ in range(pp)]
    g_iv: list[list] = [[] for _ in range(pp)]
    for c in range(stages):
        r = c % pp
        for i in range(m):
            if c > 0:  # the activation arrives after F(c-1) and lives until B(c)
                x_iv[r].append((when[("F", c - 1, i)] + 1, when[("B", c, i)], (r, c, i)))
            if c < stages - 1:  # its gradient arrives after B(c+1) and lives until B(c)
                g_iv[r].append((when[("B", c + 1, i)] + 1, when[("B", c, i)], (r, c, i)))
    xs, gs, xn, gn = {}, {}, [], []
    for r in range(pp):
        a, n = _assign(x_iv[r])
        xs.update(a)
        xn.append(n)
        a, n = _assign(g_iv[r])
        gs.update(a)
        gn.append(n)
    return Schedule(name, pp, m, v, tuple(tuple(row) for row in ticks), tuple(sorted(xs.items())),
                    tuple(sorted(gs.items())), tuple(xn), tuple(gn))
