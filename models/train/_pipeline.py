"""What ``metrics.json`` says about a pipelined run (a ``pp`` mesh dim): the schedule, its bubble and its memory.

- ``bubble_formula``: ``(pp - 1) / (M + pp - 1)`` (gpipe, 1f1b) or ``(pp - 1) / (v M + pp - 1)``
  (interleaved, looped_bfs);
- ``bubble_measured``: counted in the tick table the step is compiled from (a tick holds at most one
  forward and one backward per rank and lasts the most actions a rank runs in it, every action one unit):
  ``idle_rank_units`` over ``pp x tick_units``;
- ``bubble_timed_lockstep``: the table replayed with the chunk's backward 2x its forward, each tick lasting
  its slowest rank, as the step runs (``Schedule.timed``);
- ``activation_bound_bytes``: the schedule's bound (its activation and gradient slots, one micro-batch each);
  ``activation_measured_bytes``: the memory the stash takes per device, measured from
  ``compiled.memory_analysis()`` by ``spmd.parallel.pipelining._memory.measure_activation_stash`` (its module
  doc: the method), with ``activation_bytes_per_slot`` (what one more live micro-batch costs, fitted) and
  ``activation_measure_compiles``: the extra compiles it took (the step's loop form, the state donated, at a
  few micro-batch counts), made for these metrics only;
- ``bytes_table`` / ``bytes_hlo``: per collective kind, the bytes a device moves per step by the step's
  analytic table (``step.communication``) and in the compiled step (scalars aside: the loss's and the
  gradient norm's reductions);
- ``peak_temp_bytes``: the job's compiled step's temporaries (``memory_analysis()``'s ``temp_size_in_bytes``:
  the stash, the chunk's working buffers, the gathered stages and their gradients).

The collectives are read from the same compiled step (``step.compiled``: the executable the loop ran, not a
second compile).
"""

from __future__ import annotations

from typing import Any

from models.train._programs import make_loss_fn
from spmd.parallel import hlo_executed_collectives
from spmd.parallel.pipelining._memory import measure_activation_stash

__all__ = ["pipeline_report"]

_KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def pipeline_report(progs: Any, state: Any, batch: Any, accum_steps: int = 1) -> tuple[dict, dict]:
    """``(collectives, pipeline)`` of a pipelined run's step (``progs``: its ``models.train._programs.Programs``):
    kind -> ``{"count", "bytes"}`` per step, and the schedule's section of ``metrics.json`` (see the module doc)."""
    train_step = progs.train_step
    compiled = train_step.compiled(state, batch)
    got = hlo_executed_collectives(compiled.as_text())
    nonscalar = hlo_executed_collectives(compiled.as_text(), scalars=False)  # the table leaves scalars aside
    collectives = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in got.items() if v["count"]}
    s = train_step.schedule
    table = train_step.communication(state, batch)
    stash = measure_activation_stash(progs.layout, make_loss_fn(progs.model), progs.optimizer, state, batch,
                                     accum_steps=accum_steps)
    return collectives, {
        "schedule": s.name, "pp": s.pp, "microbatches": s.num_microbatches, "stages_per_rank": s.stages_per_rank,
        "ticks": len(s.ticks), "tick_units": sum(s.widths), "idle_rank_units": s.idle,
        "bubble_formula": s.formula, "bubble_measured": s.bubble,
        "bubble_timed_lockstep": s.timed(1.0, 2.0)["lockstep"],
        "activation_bytes": table["activation_bytes"], "activation_slots": table["activation_slots"],
        "gradient_slots": table["gradient_slots"], "activation_bound_bytes": table["activation_bound_bytes"],
        "activation_measured_bytes": stash["measured"][0]["measured_bytes"],
        "activation_bytes_per_slot": stash["bytes_per_slot"], "activation_measure_compiles": stash["compiles"],
        "peak_temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "transfers": table["collective-permute"]["pairs"],
        "bytes_table": {k: table[k]["bytes"] for k in _KINDS},  # the analytic table beside the compiled step's
        "bytes_hlo": {k: nonscalar[k]["bytes"] for k in _KINDS},
    }
