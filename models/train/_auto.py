"""``--mesh auto``: the job's layout picked by ``spmd.parallel.auto_layout``, and what ``metrics.json`` says of it.

``choose_layout(cfg)`` ranks the layouts of the job's model on the visible devices (``auto_layout``'s
candidates: every ``dp`` x ``fsdp`` x ``tp`` mesh, sequence parallel, weight-stationary,
``reshard_after_forward`` on and off, the pipelines over ``pp`` with their schedule and micro-batches,
accumulation where ``--memory-budget`` needs it) with the
job's own model, loss, optimizer and first batch, the transformer's tensor-parallel plan
(``models._plans.transformer_tp_plan``) and ``fully_shard`` units (``shard_units``), on this machine's
calibration (``spmd.parallel.calibrate``: measured once, then read from its cache). Ranking traces every
candidate's step on abstract inputs (nothing of them is compiled but the single-device programs the memory
and compute estimates read, and that step timed on every device at once under a measured calibration). On a measured
calibration and one process, the top ``MEASURE`` predicted are then compiled and timed side by side and the
fastest measured is picked (``auto_layout(measure=)``: the cost model misses what a host does to a step).
``--hardware h100`` (a ``spmd.parallel.HARDWARE`` built-in) plans for that hardware instead: nothing is
calibrated or timed here, the candidates are priced on its published figures (``auto_layout(hardware=)``),
and its memory is the budget unless ``--memory-budget`` is given.
It prints the top 5 and why the pick won, and returns the config with the pick as the explicit flags an ``--mesh`` run takes
(``layout_config``): the run, its checkpoints and ``--resume`` then see exactly what ``--mesh fsdp=8
--no-reshard-after-forward`` (or ``--mesh pp=2,dp=4 --schedule 1f1b --microbatches 4``) would have given,
and a resume without ``--mesh`` reuses the pick.

``layout_report`` is ``metrics.json``'s ``"layout"``: the ranking (``AutoLayout.to_json``: the pick, why,
every candidate's predicted time terms, bytes by kind and peak memory, the rejected layouts), the pick's
flags, and its predicted step time and peak memory per device beside the measured ones: the median over the
loop's timed windows of the seconds per step (the steps after the first, which compiles; each window's
time includes making and placing its batches), and ``argument + output + temp - alias`` of the compiled
step's ``memory_analysis()`` (what the chooser's estimate models).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from models._plans import reshard_after_forward, shard_units, transformer_tp_plan
from models.train._config import Config
from models.train._loop import report
from models.train._programs import layout, make_loss_fn, make_model, make_optimizer, make_task
from spmd.parallel import AutoLayout, Calibration, Layout, StepMemory, auto_layout, calibrate

__all__ = ["Choice", "choose_layout", "layout_config", "layout_flags", "layout_report", "layout_line", "TOP"]

TOP = 5  # the candidates the job prints
MEASURE = 3  # the top predicted candidates timed before the pick (a measured calibration, one process)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``--mesh auto`` picked: the ranking, the picked config's flags, the request and its cost."""

    ranking: AutoLayout
    flags: str  # the pick as command-line flags: "--mesh fsdp=8 --no-reshard-after-forward"
    memory_budget: int | None
    seconds: float  # calibration (when not cached) and ranking
    calibration: str  # the calibration's cache file ("none: --hardware h100" under --hardware)


def layout_config(cfg: Config, lay: Layout, model: Any) -> Config:
    """``cfg`` with ``lay`` as the job's explicit layout flags (``reshard_after_forward`` left at None where
    it is the model's default, as a user would leave the flag out)."""
    raf = None if lay.fsdp == 1 or lay.pp > 1 or lay.reshard_after_forward == reshard_after_forward(model) else \
        lay.reshard_after_forward  # a pipeline keeps its stages gathered: the flag is not the pipeline's
    pipe = dict(schedule=lay.schedule, microbatches=lay.microbatches, stages_per_rank=lay.stages_per_rank) \
        if lay.pp > 1 else {}
    return dataclasses.replace(cfg, mesh=",".join(f"{n}={s}" for n, s in lay.mesh_dims),
                               sequence_parallel=lay.sequence_parallel, weight_stationary=lay.weight_stationary,
                               reshard_after_forward=raf, activation_checkpointing=lay.activation_checkpointing,
                               accum_steps=lay.accum_steps, memory_budget=None, hardware=None, **pipe)


def layout_flags(cfg: Config) -> str:
    """The command-line flags of ``cfg``'s layout (what to type for the same run with an explicit mesh)."""
    out = [f"--mesh {cfg.mesh}"]
    if cfg.sequence_parallel:
        out.append("--sequence-parallel")
    if cfg.weight_stationary:
        out.append("--weight-stationary")
    if cfg.reshard_after_forward is not None:
        out.append("--reshard-after-forward" if cfg.reshard_after_forward else "--no-reshard-after-forward")
    if cfg.activation_checkpointing is not None:
        out.append(f"--activation-checkpointing {cfg.activation_checkpointing}")
    if cfg.schedule is not None:
        out.append(f"--schedule {cfg.schedule} --microbatches {cfg.microbatches}")
    if cfg.stages_per_rank != 1:
        out.append(f"--stages-per-rank {cfg.stages_per_rank}")
    if cfg.accum_steps > 1:
        out.append(f"--accum-steps {cfg.accum_steps}")
    return " ".join(out)


def _plan(model: Any, cfg: Config):
    if cfg.model != "transformer":
        return None  # the mlp has no tensor-parallel plan: dp and fsdp only

    def plan(sequence_parallel: bool, tp_size: int) -> dict:
        return transformer_tp_plan(sequence_parallel, vocab_size=model.vocab_size, tp_size=tp_size)

    return plan


def _agreed(name: str) -> str:
    """Process 0's pick, under a launcher (each process calibrated itself; all must run one layout)."""
    from spmd.distributed import broadcast_object_list, is_initialized

    return broadcast_object_list([name], src=0)[0] if is_initialized() else name


def choose_layout(cfg: Config, lead: bool) -> tuple[Config, Choice]:
    """Rank the layouts of ``cfg``'s run (its ``--mesh auto``), print the top 5 and why the pick won, and
    return ``cfg`` with the pick's explicit flags (see the module doc)."""
    devices = jax.devices()
    if len(devices) < 2:
        raise ValueError(f"models.train: --mesh auto weighs the layouts of 2 or more devices, but {len(devices)} "
                         f"{devices[0].platform} device is visible; run on more devices (on CPU: XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8) or leave --mesh out.")
    t0 = time.perf_counter()
    model, optimizer = make_model(cfg), make_optimizer(cfg)
    batch = make_task(cfg).batch(cfg.seed, 0, cfg.batch_size, layout(cfg))
    path, calibration = f"none: --hardware {cfg.hardware}", None
    if cfg.hardware is None:  # --hardware: priced on its published figures, nothing measured here
        path = Calibration.cache_path(devices)
        if not os.path.exists(path):
            report(f"models.train: --mesh auto: measuring this machine's collectives and compute (once, about 10 s "
                   f"on 8 CPU fake devices; cached in {path})", lead)
        calibration = calibrate(devices)
    units = tuple(shard_units(model))
    plan = _plan(model, cfg)
    report(f"models.train: --mesh auto: ranking the layouts of {cfg.model} on {len(devices)} "
           f"{devices[0].platform} devices at batch {cfg.batch_size}"
           + (f", priced on {cfg.hardware}'s figures" if cfg.hardware else "") + " ...", lead)
    try:
        ranking = auto_layout(model, optimizer, batch, devices, memory_budget_bytes=cfg.memory_budget, plan=plan,
                              loss_fn=make_loss_fn(model), units=units, calibration=calibration, top=TOP,
                              accum_steps=cfg.accum_steps,  # the user's accumulation is each candidate's least
                              measure=MEASURE if calibration is not None and calibration.measured
                              and jax.process_count() == 1 else 0, hardware=cfg.hardware)
    except ValueError as e:
        reason = str(e).removeprefix("auto_layout: ")
        if cfg.memory_budget is not None and "no layout fits" in reason:
            raise ValueError(f"models.train: --memory-budget={cfg.memory_budget:,} B ({cfg.memory_budget / 2**20:,.2f} "
                             f"MiB) per device fits no layout --mesh auto weighs: {reason}") from None
        raise ValueError(f"models.train: --mesh auto found no layout of {len(devices)} devices for this run: "
                         f"{reason}") from None
    name = _agreed(ranking.best.name)
    if name != ranking.best.name:  # another process ranked differently: run process 0's pick everywhere
        hit = [c for c in ranking.candidates if c.name == name]
        ranking = dataclasses.replace(ranking, candidates=tuple(hit) + tuple(
            c for c in ranking.candidates if c.name != name))
    picked = layout_config(cfg, ranking.best.layout, model)
    choice = Choice(ranking, layout_flags(picked), ranking.budget, time.perf_counter() - t0, path)
    report(ranking.table(top=TOP), lead)
    report(f"models.train: --mesh auto ran {choice.seconds:.1f} s and picked {ranking.best.name}: the same run as "
           f"{choice.flags} (its checkpoints record these flags; --resume keeps them)", lead)
    return picked, choice


def _memory(compiled: Any) -> dict:
    m = StepMemory.from_compiled(compiled)
    return {"peak_bytes": m.peak, "argument": m.argument, "output": m.output, "temp": m.temp, "alias": m.alias}


def layout_report(choice: Choice, step_s: float | None, timed: int, compiled: Any) -> dict:
    """``metrics.json``'s ``"layout"`` (see the module doc); ``step_s``: the measured seconds per step, over
    ``timed`` windows; ``compiled``: the train step the loop ran, compiled."""
    best = choice.ranking.best
    measured = {"step_ms": None if step_s is None else 1e3 * step_s, "timed_windows": timed, **_memory(compiled)}
    predicted = {"step_ms": 1e3 * best.predicted_s, "peak_bytes": int(best.memory["peak"])}
    return {**choice.ranking.to_json(), "flags": choice.flags, "memory_budget": choice.memory_budget,
            "choose_s": choice.seconds, "calibration": choice.calibration, "predicted": predicted,
            # --hardware: the prediction is for that hardware, the measurement this machine's
            "hardware": None if choice.ranking.hardware is None else choice.ranking.hardware.name,
            "measured": measured,
            "measured_over_predicted": {
                "step": None if step_s is None else measured["step_ms"] / predicted["step_ms"],
                "peak": measured["peak_bytes"] / predicted["peak_bytes"]}}


def layout_line(entry: dict) -> str:
    """The job's line on the pick's predicted and measured cost."""
    p, m = entry["predicted"], entry["measured"]
    step = "not timed (too few steps)" if m["step_ms"] is None else (
        f"{m['step_ms']:.2f} ms/step (median of {m['timed_windows']} timed windows)")
    return (f"models.train: --mesh auto: {entry['pick']} predicted {p['step_ms']:.2f} ms/step and "
            f"{p['peak_bytes'] / 2**20:.2f} MiB per device; measured {step} and {m['peak_bytes'] / 2**20:.2f} MiB "
            "(the compiled step's memory_analysis)")
