"""``spmd.ops.explain``: what a function of DTensors will communicate, before it runs."""

from __future__ import annotations

from typing import Any, Callable

import jax

from placements import PlanCost
from spmd.tensor._ops_exec import recording

__all__ = ["explain", "Explanation"]


class Explanation(tuple):
    """The strategies of every op a traced call ran, in order; ``str`` is the printed report."""

    def cost(self) -> PlanCost:
        cs = [s.cost() for s in self]
        return PlanCost(sum(c.bytes for c in cs), sum(c.collectives for c in cs), sum(c.traffic for c in cs))

    def __str__(self) -> str:
        lines = [f"{len(self)} op(s), {self.cost()} to redistribute inputs:"]
        lines += [f"  {i}. " + str(s).replace("\n", "\n  ") for i, s in enumerate(self)]
        return "\n".join(lines)


def explain(fn: Callable, *args: Any, print_out: bool = True, **kwargs: Any) -> Explanation:
    """Trace ``fn(*args, **kwargs)`` abstractly (``jax.eval_shape``: nothing runs, nothing is
    communicated) and report each DTensor op's strategy: the input placements, the
    redistribute steps (collective, bytes per device) the op needs first, and the output
    placements. Redistributes the function calls itself (``.redistribute``) are not ops and
    are not listed."""
    if not callable(fn):
        raise TypeError(f"explain: fn={fn!r} is not callable; pass the function, e.g. explain(spmd.ops.matmul, x, w).")
    with recording() as log:
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
    out = Explanation(log)
    if print_out:
        print(out)
    return out
