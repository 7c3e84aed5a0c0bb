"""The memory a pipeline schedule's activation stash takes per device, measured from ``compiled.memory_analysis()``.

The step (``spmd.parallel.pipelining._step``) stashes each received activation in a buffer of ``kx + 1`` slots
and each received gradient in one of ``kg + 1`` (``kx``, ``kg``: the schedule's ``max(x_slots)``,
``max(g_slots)``; the extra slot of each is the scratch row a rank writes at a tick it receives nothing).
The backward recomputes its chunk from the stashed input, so nothing else per micro-batch lives across
ticks: the schedule's bound is ``(kx + kg) x activation_bytes``.

``temp_size_in_bytes`` holds the stash beside the chunk's working buffers, and does not say which bytes are
whose. The method makes the stash the only thing that changes between a few compiles and fits it out:

- each compile is the step in its loop form (``pipeline(..., unroll=False)``: one ``fori_loop`` over the tick
  table, the same program body for every ``M``) at the caller's micro-batch shape, so the working buffers
  are the same in every compile; and with the state donated (``jax.jit(step, donate_argnums=0)``, as a
  training loop runs it), so the outputs reuse the inputs' buffers. Without donation XLA may put the stash
  in the step's output buffers (empty until the step ends), at some ``M`` and not at others; the unrolled
  form (the job's step) grows with ``M`` (one ``lax.switch`` per tick) and does both: its temp moves by
  other amounts than the stash (gpipe pp=2, 1 KiB activations: +4 KiB per micro-batch);
- the reference compiles (gpipe at ``M`` = 2, 3 for one chunk per rank: ``kx = M``; looped BFS, GPipe
  over the chunks, at ``M`` = pp, pp + 1 otherwise: ``kx = v M``) fit the line
  ``temp = base + bytes_per_slot x (kx + kg) + table``:
  ``bytes_per_slot`` is what one more live micro-batch costs, ``base`` the working buffers, the gradient
  accumulators and the two scratch slots, which no schedule changes;
- ``table``: the tick table's int32 ``(ticks, pp)`` columns that hold one value throughout and index a
  dim longer than 1; XLA rewrites such a column as a broadcast carried through the loop (equal columns as
  one), so it sits in temp, rounded up to 64 bytes, and grows with the tick count: it is subtracted (the
  chunk index is none: a chunk's units are sliced together, at a constant with one chunk per rank);
- the schedule's own step, compiled the same way: ``measured = temp - base - table``.

On CPU this is exact to the byte (``tests/parallel/pipelining/test_pipeline_memory.py``): ``bytes_per_slot``
equals the activation's bytes, further reference compiles lie on the line, and each schedule's measured stash equals
its bound. ``M = 1`` is no reference point: a one-micro-batch step lies 64 bytes under the line. Several compiles, each of the loop form
(``compiles`` says how many): the job's own step is not one of them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from spmd.parallel.pipelining._pipeline import PipelineModule
from spmd.parallel.pipelining._step import build_pipeline_step, seq_batch_leaves
from spmd.parallel.pipelining._tables import tick_tables
from spmd.parallel.pipelining._schedules import build_schedule
from spmd.parallel.step._loss_io import _as_arrays

__all__ = ["measure_activation_stash"]


def _variant(pm: PipelineModule, name: str, m: int) -> PipelineModule:
    """``pm`` (its model, mesh, units, fsdp / tp, split points), schedule ``name`` at ``m`` micro-batches, looped."""
    s = pm.schedule
    return PipelineModule(pm.module, pm.mesh, pm.pp, pm.units, build_schedule(name, s.pp, m, s.stages_per_rank),
                          False, pm.fsdp, pm.split_points, pm.tp, pm.ep)


def _table_bytes(pm: PipelineModule, lay) -> int:
    """Temp bytes of the tick table's uniform int32 columns that index a dim longer than 1 (a dim of 1 is
    indexed by a constant 0, the column dropped): 64-byte rounded."""
    s, tables = pm.schedule, tick_tables(pm)
    size = {"j": s.stages_per_rank, "m": s.num_microbatches}  # the rest index 2 or more
    keys = ("fcode", "fj", "fm", "fxr", "bcode", "bj", "bm", "bxr", "bgr", "rx", "rg")
    cols = [np.stack([t[k] for t in tables]) for k in keys if size.get(k[1:], 2) > 1]
    uniform = {(c.shape, int(c.flat[0])) for c in cols if (c == c.flat[0]).all()}  # equal columns: one constant
    return sum(-(-int(np.prod(shape)) * 4 // 64) * 64 for shape, _ in uniform)


def _compile(pm: PipelineModule, shapes, loss_fn, optimizer, state, batch, rows: int, accum: int) -> tuple[int, int]:
    """``(temp bytes, activation bytes)`` of ``pm``'s looped step, state donated, on ``rows`` rows like ``batch``."""
    lay = pm.layout(shapes)

    def zeros(x):  # the caller's sharding, so the step compiles as it does on the real batch
        z = np.zeros((rows, *np.shape(x)[1:]), x.dtype)
        return jax.device_put(z, x.sharding) if isinstance(x, jax.Array) else z

    like = jax.tree.map(zeros, batch)
    n_data = int(np.prod([pm.mesh.size(d) for d in pm.data_dims])) if pm.data_dims else 1
    mb = rows // (n_data * pm.schedule.num_microbatches * accum)
    mbs = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb, *np.shape(x)[1:]), x.dtype), like)
    lay.record(loss_fn, shapes, mbs)
    step = build_pipeline_step(pm, lay, loss_fn, optimizer, accum, state.plan,
                               seq=seq_batch_leaves(pm, lay, loss_fn, mbs))
    temp = jax.jit(step, donate_argnums=0).lower(state, like).compile().memory_analysis().temp_size_in_bytes
    return int(temp), int(np.prod(lay.act.shape)) * lay.act.dtype.itemsize


def _check(where, arg, value, name, pp, least):
    whole = name == "interleaved"  # its micro-batches run in groups of pp
    ok = [m for m in value
          if isinstance(m, int) and not isinstance(m, bool) and m >= least and (not whole or m % pp == 0)]
    if len(ok) != len(value) or len(set(ok)) != len(ok) or not ok:
        raise ValueError(f"{where}: {arg}={tuple(value)!r} must be distinct {name} micro-batch counts >= {least}"
                         + (f", multiples of pp={pp}" if whole else "") + f"; use e.g. {arg}={(least, 2 * least)}.")


def measure_activation_stash(pm: PipelineModule, loss_fn: Callable, optimizer, state, batch: Any, *,
                             accum_steps: int = 1, reference: Sequence[int] | None = None,
                             microbatches: Sequence[int] | None = None, cache: dict | None = None) -> dict:
    """The activation stash of ``pm``'s schedule per device, measured (see the module doc), beside its bound.

    ``state`` / ``batch``: what ``make_train_step(pm, loss_fn, optimizer, accum_steps=...)`` takes (their
    shapes and shardings; the micro-batch: ``batch``'s rows over data x M x accum). ``reference``: the
    micro-batch counts of the reference compiles (gpipe with one chunk per rank, else looped_bfs); default
    ``(2, 3)`` / ``(pp, pp + 1)``. ``microbatches``: the counts to measure ``pm``'s schedule at (default its
    own ``M``), at the same micro-batch shape. ``cache``: a dict shared by calls on one model, mesh and batch
    (the schedules of a benchmark), so each reference compile is made once. Compiles ``len(reference) + len(microbatches)`` steps, less
    those that are reference ones (``compiles``). Returns the fit (``bytes_per_slot``, ``base_bytes``), the
    ``reference`` points (each with its ``residual_bytes`` off the line) and ``measured``: per count,
    ``measured_bytes`` beside ``bound_bytes``, with the compile's ``temp_bytes`` and ``table_bytes``."""
    where = "measure_activation_stash"
    if not isinstance(pm, PipelineModule):
        raise TypeError(f"{where}: pm={type(pm).__name__} must be the PipelineModule pipeline() returns.")
    s = pm.schedule
    ref_name, v = ("gpipe", 1) if s.stages_per_rank == 1 else ("looped_bfs", s.stages_per_rank)
    ref = tuple(reference) if reference is not None else ((2, 3) if v == 1 else (s.pp, s.pp + 1))
    _check(where, "reference", ref, ref_name, s.pp, 2 if v == 1 else s.pp)
    own = tuple(microbatches) if microbatches is not None else (s.num_microbatches,)
    _check(where, "microbatches", own, s.name, s.pp, 1 if s.name == "gpipe" else s.pp)
    sched = {(n, m): build_schedule(n, s.pp, m, v) for n, ms in ((ref_name, ref), (s.name, own)) for m in ms}
    if len({max(sched[ref_name, m].x_slots) + max(sched[ref_name, m].g_slots) for m in ref}) < 2:
        raise ValueError(f"{where}: reference={ref!r}: {ref_name} holds as many slots at each of these counts; the fit "
                         f"needs two slot counts: add a count (gpipe holds M activations).")
    lay = next((lay for lay in pm._layouts.values() if lay.plan == state.plan), None)
    if lay is None:
        raise ValueError(f"{where}: the state was not laid out for {pm!r}; build it with init_train_state(pm, ...).")
    shapes = jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths])
    batch = _as_arrays(batch)
    per_m = np.shape(jax.tree.leaves(batch)[0])[0] // s.num_microbatches  # data x micro-batch rows x accum
    done: dict = {}
    shared = cache if cache is not None else {}

    def point(name, m):
        key = (name, m, per_m, accum_steps)
        if (name, m) not in done and key in shared:
            done[name, m] = shared[key]
        if (name, m) not in done:
            pv = _variant(pm, name, m)
            temp, act = _compile(pv, shapes, loss_fn, optimizer, state, batch, per_m * m, accum_steps)
            r = sched[name, m]
            done[name, m] = {"schedule": name, "num_microbatches": m, "activation_slots": max(r.x_slots),
                             "gradient_slots": max(r.g_slots), "temp_bytes": temp,
                             "table_bytes": _table_bytes(pv, pv.layout(shapes)), "act": act}
            shared[key] = done[name, m]
        return done[name, m]

    pts = [point(ref_name, m) for m in ref]
    x = [p["activation_slots"] + p["gradient_slots"] for p in pts]
    slope, base = (int(round(c)) for c in np.polyfit(x, [p["temp_bytes"] - p["table_bytes"] for p in pts], 1))
    act = pts[0]["act"]

    def entry(p):
        slots = p["activation_slots"] + p["gradient_slots"]
        return {**{k: w for k, w in p.items() if k != "act"}, "bound_bytes": slots * act,
                "measured_bytes": p["temp_bytes"] - p["table_bytes"] - base}

    reference_pts = [{**entry(p), "residual_bytes": entry(p)["measured_bytes"] - slope * n} for p, n in zip(pts, x)]
    return {"schedule": s.name, "stages_per_rank": v, "activation_bytes": act, "bytes_per_slot": slope,
            "base_bytes": base, "reference": reference_pts, "measured": [entry(point(s.name, m)) for m in own],
            "compiles": len(done)}
