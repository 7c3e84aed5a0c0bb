"""Collectives a compiled step *executes*: HLO counts scaled by loop trip counts.

``spmd.collectives`` counts the collective instructions in the HLO text; a
collective inside a ``while`` body (a ``lax.scan`` over layers) is one
instruction that runs once per iteration. ``executed_collectives`` walks the
call graph from the entry computation and multiplies each loop body by its
``known_trip_count``, so the totals compare with the analytic per-step table.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax

from spmd._inspect import hlo_collectives  # the one HLO-text parser of the project

__all__ = ["executed_collectives", "hlo_executed_collectives"]

_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\([^{]*)?\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"\b(?:to_apply|calls|branch_computations|true_computation|false_computation)=\{?%?([\w.\-%, ]+)\}?")


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMP.match(line.strip()) if not line.startswith(" ") else None
        if m:
            current = m[2]
            comps[current] = []
            if m[1]:
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps, entry


def hlo_executed_collectives(text: str, *, scalars: bool = True) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes"}}`` executed by one run of the compiled module ``text``."""
    comps, entry = _computations(text)
    header = next((line for line in text.splitlines() if line.startswith("HloModule")), "")
    memo: dict[str, dict] = {}

    def walk(name: str, stack: tuple = ()) -> dict:
        if name in memo:
            return memo[name]
        lines = comps.get(name, [])
        out = hlo_collectives(header + "\n" + "\n".join(lines), scalars=scalars)
        for line in lines:
            w = _WHILE.search(line)
            if w:
                t = _TRIP.search(line)
                calls = [(w[1], int(t[1]) if t else 1)]
            else:
                calls = [(c.strip().lstrip("%"), 1) for m in _CALLS.finditer(line) for c in m[1].split(",") if c.strip()]
            for callee, times in calls:
                if callee in comps and callee not in stack and callee != name:
                    sub = walk(callee, stack + (name,))
                    for k, v in sub.items():
                        for f in v:
                            out[k][f] += times * v[f]
        memo[name] = out
        return out

    if entry is None:
        return hlo_collectives(text, scalars=scalars)
    return walk(entry)


def executed_collectives(fn: Callable, *args: Any, scalars: bool = True, **kwargs: Any) -> dict[str, dict[str, int]]:
    """What one call of ``fn(*args)`` communicates once compiled, loops unrolled in the count.

    A jitted ``fn`` that already ran is not compiled again (JAX caches its executable)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return hlo_executed_collectives(jitted.lower(*args, **kwargs).compile().as_text(), scalars=scalars)
