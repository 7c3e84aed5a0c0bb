"""What ``metrics.json`` says about a pipelined run (a ``pp`` mesh dim): the schedule, its bubble and its memory.

- ``bubble_formula``: ``(pp - 1) / (M + pp - 1)`` (gpipe, 1f1b) or ``(pp - 1) / (v M + pp - 1)`` (interleaved);
- ``bubble_measured``: the idle rank-ticks of the tick table the step is compiled from (one action per
  rank per tick, a chunk's forward and backward one tick each), over all rank-ticks;
- ``peak_activation_bytes``: the compiled step's temporaries (``compiled.memory_analysis()``'s
  ``temp_size_in_bytes``: the activation slots, the gathered stages and their gradients), beside the
  schedule's bound ``activation_bound_bytes`` (its activation and gradient slots, one micro-batch each).

The collectives are read from the same compiled step (``step.compiled``: the executable the loop ran, not a
second compile).
"""

from __future__ import annotations

from typing import Any, Callable

from spmd.parallel import hlo_executed_collectives

__all__ = ["pipeline_report"]


def pipeline_report(train_step: Callable, state: Any, batch: Any) -> tuple[dict, dict]:
    """``(collectives, pipeline)`` of a pipelined step: kind -> ``{"count", "bytes"}`` per step, and the
    schedule's section of ``metrics.json`` (see the module doc)."""
    compiled = train_step.compiled(state, batch)
    got = hlo_executed_collectives(compiled.as_text())
    collectives = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in got.items() if v["count"]}
    s = train_step.schedule
    table = train_step.communication(state, batch)
    idle = sum(a is None for row in s.ticks for a in row)
    return collectives, {
        "schedule": s.name, "pp": s.pp, "microbatches": s.num_microbatches, "stages_per_rank": s.stages_per_rank,
        "ticks": len(s.ticks), "idle_rank_ticks": idle,
        "bubble_formula": s.formula, "bubble_measured": idle / (len(s.ticks) * s.pp),
        "activation_bytes": table["activation_bytes"], "activation_slots": table["activation_slots"],
        "gradient_slots": table["gradient_slots"], "activation_bound_bytes": table["activation_bound_bytes"],
        "peak_activation_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "transfers": table["collective-permute"]["pairs"],
    }
