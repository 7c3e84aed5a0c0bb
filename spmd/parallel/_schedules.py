"""Pipeline schedules as data: which micro-batch each rank runs forward or backward at each tick.

A schedule is built in two steps, both plain Python (no JAX):

1. *Orders*: each rank's list of actions, ``F(chunk, mb)`` / ``B(chunk, mb)``, in the order it runs them
   (GPipe: every forward, then every backward; 1F1B: ``pp - 1 - rank`` warm-up forwards, then one forward
   and one backward alternately, then the cool-down backwards; interleaved: Megatron's interleaved 1F1B over
   ``v`` chunks per rank, chunk ``c`` on rank ``c % pp``).
2. *Ticks*: a rank runs its next action at the first tick at which its inputs exist: ``F(c, m)`` needs
   ``F(c - 1, m)`` done at an earlier tick (the activation travels between ticks), ``B(c, m)`` needs
   ``B(c + 1, m)`` done earlier (the last chunk: its own ``F``). One action per rank per tick; a rank with
   nothing runnable idles.

The table then assigns buffer *slots*: an activation a rank receives is written into an activation slot at
the end of the tick it was sent and read by the forward and the backward (which recomputes the stage from
it); a received gradient sits in a gradient slot until its backward. Slots are reused as soon as they are
free, so a rank's slot count is the number of micro-batches it holds alive: the schedule's activation bound.

``bubble`` = idle rank-ticks / all rank-ticks, with every action one tick (a chunk's forward and its
backward take equal time); ``formula``: ``(pp - 1) / (M + pp - 1)`` (GPipe, 1F1B) and
``(pp - 1) / (v M + pp - 1)`` (interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "Schedule", "build_schedule", "bubble_formula"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    """One tick's work on one rank: ``kind`` ``"F"`` or ``"B"`` of global chunk ``chunk`` on micro-batch ``mb``."""

    kind: str
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


def bubble_formula(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    v = stages_per_rank if schedule == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches + pp - 1)


def _orders(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            o = [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        elif schedule == "1f1b":
            w = min(pp - 1 - r, m)
            o = [Action("F", r, i) for i in range(w)]
            for i in range(m - w):
                o += [Action("F", r, w + i), Action("B", r, i)]
            o += [Action("B", r, i) for i in range(m - w, m)]
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
    """The tick table of one schedule (see the module doc). ``ticks[t][r]``: rank ``r``'s action at tick ``t``
    (``None``: idle). ``x_slot`` / ``g_slot``: ``{(rank, chunk, mb): slot}`` of the activations and gradients a
    rank receives; ``x_slots`` / ``g_slots``: slots per rank."""

    name: str
    pp: int
    num_microbatches: int
    stages_per_rank: int
    ticks: tuple[tuple[Action | None, ...], ...]
    x_slot: tuple[tuple[tuple[int, int, int], int], ...]
    g_slot: tuple[tuple[tuple[int, int, int], int], ...]
    x_slots: tuple[int, ...]
    g_slots: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    @property
    def bubble(self) -> float:
        idle = sum(a is None for row in self.ticks for a in row)
        return idle / (len(self.ticks) * self.pp)

    @property
    def formula(self) -> float:
        return bubble_formula(self.name, self.pp, self.num_microbatches, self.stages_per_rank)

    def sends(self, kind: str) -> list[list[tuple[int, int]]]:
        """Per tick, the ``(src, dst)`` rank pairs of the activations (``"F"``) or their gradients (``"B"``)
        sent at the end of it."""
        out = []
        s = self.num_stages
        for row in self.ticks:
            pairs = []
            for r, a in enumerate(row):
                if a is None or a.kind != kind:
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
        width = max(4, *(len(str(a)) + 1 for row in self.ticks for a in row if a is not None))
        head = f"{self.name}: pp={self.pp}, M={self.num_microbatches}" + (
            f", v={self.stages_per_rank}" if self.name == "interleaved" else "")
        lines = [head + f"; {len(self.ticks)} ticks, bubble {self.bubble:.4f} (formula {self.formula:.4f}); "
                 f"activation slots per rank {list(self.x_slots)}, gradient slots {list(self.g_slots)}"]
        lines.append("tick " + "".join(f"{t:>{width}}" for t in range(len(self.ticks))))
        for r in range(self.pp):
            cells = [str(row[r]) if row[r] is not None else "." for row in self.ticks]
            lines.append(f"pp{r:<3}" + "".join(f"{c:>{width}}" for c in cells))
        return "\n".join(lines)


def _simulate(orders: list[list[Action]], pp: int, stages: int) -> list[list[Action | None]]:
    done: dict[tuple[str, int, int], int] = {}
    ptr = [0] * pp
    ticks: list[list[Action | None]] = []
    total = sum(map(len, orders))
    t = 0
    while sum(ptr) < total:
        row: list[Action | None] = [None] * pp
        for r in range(pp):
            if ptr[r] == len(orders[r]):
                continue
            a = orders[r][ptr[r]]
            need = ([("F", a.chunk - 1, a.mb)] if a.kind == "F" and a.chunk > 0 else []) + (
                [("F", a.chunk, a.mb)] + ([("B", a.chunk + 1, a.mb)] if a.chunk < stages - 1 else [])
                if a.kind == "B" else [])
            if all(k in done and done[k] < t for k in need):
                row[r] = a
        for r, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.chunk, a.mb)] = t
                ptr[r] += 1
        ticks.append(row)
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
    if name != "interleaved":
        v = 1
    stages = pp * v
    ticks = _simulate(_orders(name, pp, m, v), pp, stages)
    when = {(a.kind, a.chunk, a.mb): t for t, row in enumerate(ticks) for a in row if a is not None}
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
