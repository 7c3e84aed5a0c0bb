"""``spmd.ops.explain``: what a function of DTensors will communicate, before it runs."""

from __future__ import annotations

from typing import Any, Callable

import jax

from placements import PlanCost
from placements._strategy import format_cost
from spmd.tensor._ops_exec import recording

__all__ = ["explain", "Explanation"]


def _total(strategies) -> PlanCost:
    cs = [s.cost() for s in strategies]
    return PlanCost(sum(c.bytes for c in cs), sum(c.collectives for c in cs), sum(c.traffic for c in cs))


class Explanation(tuple):
    """The strategies of every op a traced call ran, in order; ``str`` is the printed report.

    Each strategy is the one the op ran (torch's placements by default); where the cheapest
    strategy (``placement_strategy("cheapest")``) differs, it is the strategy's ``alternative``
    and the report shows its output placements and cost under the op's line."""

    def cost(self) -> PlanCost:
        """What the ops as chosen redistribute."""
        return _total(self)

    def cheapest_cost(self) -> PlanCost:
        """What the ops would redistribute with each op's cheapest strategy, from the same inputs
        (each op on its own: an op's cheaper output placements may change what the next one needs)."""
        return _total(s.alternative or s for s in self)

    def __str__(self) -> str:
        cost, cheap = self.cost(), self.cheapest_cost()
        alt = "" if cheap == cost else f" (the cheapest strategy per op: {format_cost(cheap)})"
        lines = [f"{len(self)} op(s), {format_cost(cost)} to redistribute inputs{alt}:"]
        lines += [f"  {i}. " + str(s).replace("\n", "\n  ") for i, s in enumerate(self)]
        return "\n".join(lines)


def explain(fn: Callable, *args: Any, print_out: bool = True, **kwargs: Any) -> Explanation:
    """Trace ``fn(*args, **kwargs)`` abstractly (``jax.eval_shape``: nothing runs, nothing is
    communicated) and report each DTensor op's strategy: the input placements, the
    redistribute steps (collective, bytes per device) the op needs first, and the output
    placements; where the cheapest strategy differs from torch's, its output placements and
    cost too (run the ops inside ``placement_strategy("cheapest")`` to get it). Redistributes the function calls itself (``.redistribute``) are not ops and
    are not listed."""
    if not callable(fn):
        raise TypeError(f"explain: fn={fn!r} is not callable; pass the function, e.g. explain(spmd.ops.matmul, x, w).")
    with recording() as log:
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
    out = Explanation(log)
    if print_out:
        print(out)
    return out
