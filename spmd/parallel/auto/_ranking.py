"""``auto_layout``'s answer: each candidate's predicted (and, under ``measure=``, measured) cost, ranked and
printable."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spmd.parallel.auto._layout import Layout
from spmd.parallel.auto._measure import NOISE, tie_margin
from spmd.parallel.auto._pipeline import PERMUTE
from spmd.parallel.cost._calibrate import Calibration
from spmd.parallel.cost._comm import KINDS
from spmd.parallel.cost._hardware import Hardware

__all__ = ["Candidate", "AutoLayout"]


@dataclass(frozen=True)
class Candidate:
    """One layout's predicted cost: ``predicted_s`` = ``compute_s`` + ``sum(comm_s.values())`` + ``dispatch_s``;
    ``measured_s``: its step's measured seconds where ``auto_layout(measure=)`` timed it; ``measured_peak``:
    its compiled step's peak bytes per device where ``auto_layout`` compiled it (``measure=``, or the pick under
    a memory budget; ``fits`` then says whether that peak fits)."""

    layout: Layout
    predicted_s: float
    compute_s: float
    comm_s: dict
    dispatch_s: float
    communication: dict  # step.communication(...): {"parameters", "activations", "total"}: {kind: {count, bytes}}
    memory: dict  # spmd.parallel.cost._memory.memory_floor; compiled: the step's memory_analysis (auto._compiled)
    flops: float
    fits: bool = True
    measured_s: float | None = None  # auto_layout(measure=): its compiled step timed (_auto_measure)
    measured_peak: int | None = None  # its compiled step's peak bytes per device (memory_analysis)
    measured_spread: float | None = None  # the standard error of its measured median (_measure.median_error)
    bytes_accessed: float | None = None  # its compiled step's bytes accessed (cost_analysis), where compiled

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def comm_bytes(self) -> int:
        return sum(v["bytes"] for v in self.communication["total"].values())


def _dims(c: Candidate) -> int:
    return sum(s > 1 for _, s in c.layout.mesh_dims)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _over(c: "Candidate", budget: int | None) -> str | None:
    """Why ``c`` has no time: a candidate never traced, its memory lower bound over the budget (``untraced``)."""
    if math.isfinite(c.predicted_s):
        return None
    return f"over budget (bound {_gib(c.memory['peak'])} > {_gib(budget)})" if budget else "not traced"


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}" if math.isfinite(x) else "-"


def _peak(c: "Candidate") -> str:
    """The peak column: the compiled step's, or ``>=`` the lower bound where the candidate was not compiled."""
    if c.memory.get("estimated"):  # its bound plus its compiled kin's excess (_budget.over_by_kin)
        return "~" + _mib(c.memory["peak"])
    return _mib(c.memory["peak"]) if c.memory.get("compiled", True) else ">=" + _mib(c.memory["peak"])


@dataclass(frozen=True)
class AutoLayout:
    """``auto_layout``'s answer: ``candidates`` ranked (fitting ones first, fastest predicted first),
    ``best``, ``rejected`` (``(layout name, reason)``), printable with ``table(top=)``."""

    candidates: tuple[Candidate, ...]
    rejected: tuple[tuple[str, str], ...] = ()
    calibration: Calibration | None = None
    budget: int | None = None
    top: int = 5
    hardware: Hardware | None = None  # auto_layout(hardware=): the hardware it was priced for
    search: dict | None = None  # auto_layout(hardware=): layouts traced / untraced, candidates compiled / not

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def why(self) -> str:
        """Why the pick won over the runner-up: the time terms that differ most; then what the pick's layout
        chose not to cut, and why (``Layout.note``: the experts kept whole over tp)."""
        note = self.best.layout.note
        return self._why() + (f" ({note})" if note else "") + self._searched()

    def _searched(self) -> str:
        """What the search (``auto_layout(hardware=)``) compiled and left out, by reason (``_budget.searched``)."""
        s = self.search or {}
        if "pruned_by_bound" not in s:
            return ""
        return (f" Search: {s['compiled']} compiled; {s['pruned_by_bound']} pruned by bound (a lower bound on their "
                f"step time no faster than the pick's), {s['left_by_time']} left by the time budget, "
                f"{s['skipped_by_estimate']} skipped by estimate (not proven slower).")

    def _why(self) -> str:
        if len(self.candidates) < 2:
            return f"{self.best.name}: the only candidate."
        a, b = self.candidates[0], self.candidates[1]
        if a.measured_s is not None and b.measured_s is not None and a.measured_s > b.measured_s:
            return (f"{a.name} ties with {b.name} within the measurement's noise ({1e3 * a.measured_s:.2f} vs "
                    f"{1e3 * b.measured_s:.2f} ms/step measured, within the larger of {NOISE:.0%} and the standard error "
                    f"of their medians' difference, {1e3 * tie_margin(b, a):.2f} ms) and is the simpler: "
                    f"{_dims(a)} vs {_dims(b)} mesh dims over 1, it moves {_mib(a.comm_bytes)} MiB per device and "
                    f"step where {b.name} moves {_mib(b.comm_bytes)} MiB.")
        if a.measured_s is not None and b.measured_s is not None:
            return (f"{a.name} wins over {b.name} by {1e3 * (b.measured_s - a.measured_s):.2f} ms/step measured "
                    f"({1e3 * a.measured_s:.2f} vs {1e3 * b.measured_s:.2f} ms; predicted {1e3 * a.predicted_s:.2f} "
                    f"vs {1e3 * b.predicted_s:.2f} ms); it moves {_mib(a.comm_bytes)} MiB per device and step where "
                    f"{b.name} moves {_mib(b.comm_bytes)} MiB.")
        terms = [("compute", a.compute_s, b.compute_s)] + [
            (k, a.comm_s.get(k, 0.0), b.comm_s.get(k, 0.0)) for k in sorted(set(a.comm_s) | set(b.comm_s))]
        terms.sort(key=lambda t: -abs(t[2] - t[1]))
        said = ", ".join(f"{k} {1e3 * x:.2f} vs {1e3 * y:.2f} ms" for k, x, y in terms[:3] if abs(y - x) > 0)
        if _over(b, self.budget):
            return f"{a.name} wins over {b.name}, which is {_over(b, self.budget)} by its memory lower bound."
        if b.predicted_s < a.predicted_s and b.measured_peak is None and a.measured_peak is not None:
            return (f"{a.name} is the fastest compiled candidate that fits; {b.name} is predicted "
                    f"{1e3 * (a.predicted_s - b.predicted_s):.2f} ms/step faster ({said or 'equal terms'}) but was not "
                    "compiled, so its peak is only bounded from below (the search stopped first: search"
                    "['uncompiled_faster'] names each such candidate).")
        head = f"{a.name} wins over {b.name} by {1e3 * (b.predicted_s - a.predicted_s):.2f} ms/step"
        if not b.fits:
            head += " (the runner-up does not fit the memory budget)"
        return f"{head}: {said or 'equal terms'}; it moves {_mib(a.comm_bytes)} MiB per device and step where " \
               f"{b.name} moves {_mib(b.comm_bytes)} MiB."

    def table(self, top: int | None = None) -> str:
        top = self.top if top is None else top
        timed = any(c.measured_s is not None for c in self.candidates)
        compiled = any(c.measured_peak is not None for c in self.candidates)
        a2a = any(c.communication["total"].get("all-to-all", {}).get("bytes") for c in self.candidates[:top])
        head = ("#", "layout", *(("meas ms",) if timed else ()), "pred ms", "compute", "comm", "all-gather MiB",
                "reduce-scatter MiB", "all-reduce MiB", "permute MiB", *(("all-to-all MiB",) if a2a else ()),
                "peak MiB",
                *(("compiled MiB",) if compiled else ()), "fits")
        rows = []
        for i, c in enumerate(self.candidates[:top]):
            t = c.communication["total"]
            meas = (("-" if c.measured_s is None else f"{1e3 * c.measured_s:.2f}",) if timed else ())
            rows.append((str(i + 1), c.name, *meas, _over(c, self.budget) or _ms(c.predicted_s), _ms(c.compute_s),
                         _ms(sum(c.comm_s.values())), *(_mib(t[k]["bytes"]) for k in KINDS),
                         _mib(t.get(PERMUTE, {"bytes": 0})["bytes"]),
                         *((_mib(t.get("all-to-all", {"bytes": 0})["bytes"]),) if a2a else ()),
                         _peak(c), *((("-" if c.measured_peak is None else _mib(c.measured_peak)),)
                                                   if compiled else ()), "yes" if c.fits else "no"))
        w = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
        fmt = lambda r: "  ".join(x.rjust(n) if j not in (1,) else x.ljust(n) for j, (x, n) in enumerate(zip(r, w)))  # noqa
        lines = [f"auto_layout: {len(self.candidates)} candidates ranked by predicted step time"
                 + (f", the top {sum(c.measured_s is not None for c in self.candidates)} by measured" if timed else "")
                 + (f" on {self.hardware.name}'s figures" if self.hardware is not None else "")
                 + (f" (memory budget {_mib(self.budget)} MiB per device)" if self.budget else ""),
                 fmt(head), *[fmt(r) for r in rows], "pick: " + self.best.name + ". " + self.why()]
        if self.rejected:
            lines.append(f"rejected ({len(self.rejected)}): " + "; ".join(f"{n}: {r}" for n, r in self.rejected[:6])
                         + (" ..." if len(self.rejected) > 6 else ""))
        return "\n".join(lines)

    def to_json(self, top: int | None = None) -> dict:
        """The ranking as plain data (a job's ``metrics.json`` ``"layout"`` entry): the pick, why, and per
        candidate its predicted time terms, bytes by kind and peak memory; a candidate never traced (its memory
        lower bound over the budget) has no time (``predicted_ms`` and ``compute_ms`` None) and says so in
        ``"untraced"`` (valid JSON: no Infinity)."""
        finite = lambda x: 1e3 * x if math.isfinite(x) else None  # noqa: E731 - JSON has no Infinity
        rows = [{"layout": c.name, "predicted_ms": finite(c.predicted_s), "compute_ms": finite(c.compute_s),
                 "measured_ms": None if c.measured_s is None else 1e3 * c.measured_s,
                 "measured_peak_bytes": c.measured_peak,
                 "comm_ms": {k: 1e3 * v for k, v in c.comm_s.items()},
                 "bytes": {k: v["bytes"] for k, v in c.communication["total"].items()},
                 "peak_bytes": int(c.memory["peak"]), "peak_compiled": bool(c.memory.get("compiled", True)),
                 "fits": c.fits, **({"untraced": _over(c, self.budget)} if _over(c, self.budget) else {})}
                for c in self.candidates[: (len(self.candidates) if top is None else top)]]
        return {"pick": self.best.name, "why": self.why(), "candidates": rows, "rejected": [list(r) for r in
                                                                                          self.rejected]}

    def __str__(self) -> str:
        return self.table()

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)
