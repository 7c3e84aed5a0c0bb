"""``run(cfg)``: one training run from a config, and ``restore_state``: a saved run's state onto any mesh.

Order of a run: check the config (no device, no file written) -> join the process group under a launcher
-> with ``--mesh auto``, pick the layout (``_auto``: the config gets the pick's explicit flags) -> build the
mesh and check the batch fits it -> lock ``--out`` and decide what may be done with what it holds
-> build (or reuse) the programs -> initialise or restore the state -> the loop -> held-out evaluation ->
``metrics.json`` and ``loss.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np

from models._checkpoint import Checkpointer, CheckpointError, abstract_like
from models._ddp import TrainState
from models._fsdp_run import collectives_report, layout_meta, memory_report, restore_job_state
from models.train._auto import Choice, choose_layout, layout_line, layout_report
from models.train._config import (AUTO, Config, check_config, check_resume_config, job_flags, parse_mesh, pipeline_settings,
                                  resume_config, run_config)
from models.train._loop import MetricLog, NonFiniteError, progress_bar, report, train_loop
from models.train._outdir import OutFolder, RunLock, write_outputs
from models.train._pipeline import pipeline_report
from models.train._programs import (build_mesh, check_fits, data_dims, device_memory, layout, make_task, place_batch,
                                    programs, task_dims)
from spmd import DeviceMesh
from spmd.distributed import init_process_group, is_initialized
from spmd.parallel import hlo_executed_collectives

__all__ = ["run", "restore_state"]

_EVAL_DEFAULT = 512


def _maybe_init_distributed() -> None:
    """Join the process group when started by a launcher (spmdrun / torchrun variables)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    if not is_initialized():
        init_process_group()


def _check_batch_sizes(cfg: Config, mesh: DeviceMesh) -> tuple[int, int]:
    """(data-parallel size, held-out examples); the batch sizes must split evenly over the data ranks."""
    dims = data_dims(mesh)
    n_data = math.prod(mesh.size(d) for d in dims)
    label = (" x ".join(dims) or "data-parallel") + " size"  # "dp size", "dp x fsdp size"
    if cfg.batch_size % (n_data * cfg.accum_steps):
        unit = n_data * cfg.accum_steps
        raise ValueError(
            f"models.train: --batch-size={cfg.batch_size} is not divisible by the {label} {n_data}"
            + (f" times --accum-steps={cfg.accum_steps}" if cfg.accum_steps > 1 else "")
            + f"; use a multiple of {unit} (e.g. {unit * max(1, cfg.batch_size // unit)})."
        )
    pipe = pipeline_settings(cfg)
    per_replica = cfg.batch_size // (n_data * cfg.accum_steps)
    split = (f"--batch-size={cfg.batch_size} over the {label} {n_data}"
             + (f" and --accum-steps={cfg.accum_steps}" if cfg.accum_steps > 1 else ""))
    if cfg.weight_stationary and per_replica % mesh.size("tp"):
        unit = n_data * cfg.accum_steps * mesh.size("tp")
        raise ValueError(
            f"models.train: --weight-stationary cuts each replica's {per_replica} examples per micro-batch "
            f"({split}) over tp={mesh.size('tp')}, which does not divide them; use a --batch-size that is a "
            f"multiple of {unit}, or drop --weight-stationary."
        )
    if pipe is not None and per_replica % pipe[1]:
        m = pipe[1]
        ok = [k for k in range(1, per_replica + 1) if per_replica % k == 0 and k >= mesh.size("pp")]
        raise ValueError(
            f"models.train: --microbatches={m} does not divide the {per_replica} examples each data-parallel replica "
            f"runs per step ({split}); use --microbatches from {ok} or a --batch-size that is a multiple of "
            f"{n_data * cfg.accum_steps * m}."
        )
    if cfg.eval_size is None:
        return n_data, max(n_data, _EVAL_DEFAULT // n_data * n_data)
    if cfg.eval_size % n_data:
        raise ValueError(
            f"models.train: --eval-size={cfg.eval_size} is not divisible by the {label} {n_data}; use a multiple "
            f"of {n_data} (e.g. {n_data * max(1, cfg.eval_size // n_data)})."
        )
    return n_data, cfg.eval_size


def _saved_run_config(cfg: Config, given: Collection[str]) -> Config:
    """``--resume`` from the command line: the flags not ``given`` come from the run's latest checkpoint."""
    folder = OutFolder.read(cfg.out)
    if not folder.steps:
        return cfg  # nothing to read: OutFolder.check says why there is nothing to resume
    checkpointer = Checkpointer(folder.checkpoints)
    for line in checkpointer.removed:  # a step whose deletion was interrupted (process 0 removes it)
        report(f"models.train: {line}", True)
    try:
        meta = checkpointer.restore_meta()
    finally:
        checkpointer.close()
    resumed = resume_config(meta.get("config", {}), cfg, frozenset(given), folder.checkpoints, meta.get("flags"))
    check_config(resumed)
    return resumed


def run(cfg: Config, *, on_step: Callable[[int, TrainState], None] | None = None,
        given: Collection[str] | None = None) -> dict:
    """Train as ``cfg`` says; returns the summary also written to ``metrics.json``.

    ``on_step(step, state)`` is called after each step (a hook for tests and
    tools). A ``KeyboardInterrupt`` (Ctrl-C, or raised by the hook) saves a
    checkpoint of the last finished step before it propagates, so ``--resume``
    continues exactly where the run stopped.

    ``given``: with ``cfg.resume``, the names of the fields the user set (the command line's flags); the
    run's other settings come from its checkpoint, and a given one that differs from it is refused. None
    (the default): every field of ``cfg`` is the user's, and must match the saved run.
    """
    check_config(cfg)
    _maybe_init_distributed()
    if cfg.resume and given is not None:
        cfg = _saved_run_config(cfg, given)
    choice = None
    if cfg.mesh == AUTO:  # the pick becomes the run's explicit layout flags
        OutFolder.read(cfg.out).check(cfg)  # refuse before the ranking's minute of work
        cfg, choice = choose_layout(cfg, jax.process_index() == 0)
        check_config(cfg)
    mesh = build_mesh(cfg.mesh, cfg.devices)
    n_data, eval_size = _check_batch_sizes(cfg, mesh)
    check_fits(cfg, mesh, device_memory(mesh))
    OutFolder.read(cfg.out).check(cfg)  # refuse before the lock creates --out; checked again under the lock
    lead = jax.process_index() == 0
    lock = RunLock(cfg.out).acquire() if lead else None
    try:
        return _run_locked(cfg, mesh, n_data, eval_size, lead, on_step, choice)
    except jax.errors.JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):  # XLA's status code for an allocation that failed
            raise
        size = "--seq-len"
        raise ValueError(
            f"models.train: the run does not fit in device memory (XLA: {str(e).splitlines()[0][:200]}); the "
            f"checkpoints saved so far are kept. Use a smaller --batch-size (or more --accum-steps), {size} or "
            "model, or a mesh that shards the state (--mesh fsdp=N)."
        ) from e
    finally:
        if lock is not None:
            lock.release()


def _run_locked(cfg: Config, mesh: DeviceMesh, n_data: int, eval_size: int, lead: bool,
                on_step: Callable | None, choice: Choice | None = None) -> dict:
    folder = OutFolder.read(cfg.out)
    folder.check(cfg)
    if cfg.overwrite and lead:
        folder.clear()
    task = make_task(cfg)
    lay = layout(cfg)
    progs = programs(cfg, mesh)
    mesh_sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    mesh_text = ",".join(f"{k}={v}" for k, v in mesh_sizes.items())

    state = progs.init(jax.random.key(cfg.seed), task.batch(cfg.seed, 0, 2, lay)["inputs"])
    history: list[dict] = []
    checkpointer = Checkpointer(folder.checkpoints, save_every=cfg.save_every)
    for line in checkpointer.removed:
        report(f"models.train: {line}", lead)
    log = None
    try:
        if cfg.resume:
            # The config first: a checkpoint of another model would fail to restore with a shape error that
            # blames the (good) checkpoint.
            check_resume_config(checkpointer.restore_meta().get("config", {}), cfg, folder.checkpoints)
            state, meta = restore_job_state(checkpointer, state, progs.plan, mesh, progs.optimizer, progs.layout)
            history = list(meta.get("history", []))
        start = int(jax.device_get(state.step))
        if cfg.resume and start >= cfg.steps:
            report(f"models.train: the run in {folder.out!r} is finished (step {start} of --steps {cfg.steps}); "
                   "nothing to do. Its results are in metrics.json and loss.png there; to train more, start a new "
                   "run (another --out, or --overwrite).", lead)
            done = _finished_summary(folder.out, start)
            if done is not None:
                return done
        elif cfg.resume:
            report(f"models.train: resumed from step {start} (of {cfg.steps}) in {folder.checkpoints!r}", lead)
        n_params = (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(progs.logical, state.params)))
                    if progs.plan is None or progs.pipelined
                    else sum(int(np.prod(e.shape)) for e in progs.plan.entries))  # a sharded state is padded
        memory = memory_report(state, progs.plan)
        if start == 0:  # before the bar starts: a line written under a live bar is glued to it
            report(f"models.train: {cfg.model} ({n_params:,} parameters) on {task.name}, mesh {mesh_text} "
                   f"({jax.device_count()} {jax.devices()[0].platform} device(s), {jax.process_count()} "
                   f"process(es)), batch {cfg.batch_size}, {cfg.steps} steps, "
                   f"{memory['state_bytes_per_device']:,} state bytes per device", lead)
        bar = None
        if cfg.progress and lead and start < cfg.steps:
            bar = progress_bar(total=cfg.steps, initial=start,
                               desc=f"{cfg.model} {mesh_text} {memory['state_bytes_per_device'] / 2**20:.2f}MiB/device")
        log = MetricLog(start=start, batch_size=cfg.batch_size, history=history, bar=bar,
                        stop_nonfinite=not cfg.skip_nonfinite)

        def interrupted(step: int) -> None:
            report(f"models.train: interrupted after step {step}; checkpoint saved under {folder.checkpoints}; "
                   "continue with --resume.", lead)

        t_start = time.perf_counter()
        try:
            state = train_loop(
                state, start=start, steps=cfg.steps, log_every=cfg.log_every, train_step=progs.train_step,
                next_batch=lambda s: place_batch(task.batch(cfg.seed, s, cfg.batch_size, lay), mesh,
                                                 progs.batch_placements),
                log=log, checkpointer=checkpointer,
                meta=lambda: {"config": run_config(cfg), "flags": job_flags(cfg), "history": history,
                              "layout": layout_meta(progs.checkpoint_plan)},
                on_step=on_step, interrupted=interrupted, checkpoint=progs.checkpoint)
        except NonFiniteError as e:
            raise _nonfinite(e, cfg, checkpointer) from None
        wall = time.perf_counter() - t_start
        eval_batch = place_batch(task.batch(cfg.seed, 0, eval_size, lay, stream=1), mesh, progs.batch_placements)
        evaluation = {k: float(v) for k, v in jax.device_get(progs.eval_step(progs.logical(state.params), eval_batch)).items()}
        if cfg.text is not None:  # every context window of a text is one "sequence": the share right means nothing
            evaluation.pop("sequence_accuracy", None)
        step_batch = place_batch(task.batch(cfg.seed, 0, cfg.batch_size, lay), mesh, progs.batch_placements)
        pipe = chosen = None
        if progs.pipelined:
            collectives, pipe = pipeline_report(progs, state, step_batch, accum_steps=cfg.accum_steps)
        elif choice is not None:  # one compile of the step for its collectives and its memory
            compiled = progs.train_step.lower(state, step_batch).compile()
            collectives = {k: {"count": v["count"], "bytes": v["bytes"]}
                           for k, v in hlo_executed_collectives(compiled.as_text()).items() if v["count"]}
            chosen = layout_report(choice, log.step_s, log.timed_windows, compiled)
            report(layout_line(chosen), lead)
        else:
            collectives = collectives_report(progs.train_step, state, step_batch)
        checkpointer.wait()
    finally:
        checkpointer.close()

    summary = {
        "config": dataclasses.asdict(cfg),
        "task": task.name,
        "mesh": mesh_sizes,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "processes": jax.process_count(),
        "parameters": n_params,
        "steps": cfg.steps,
        "steps_run": max(0, cfg.steps - start),  # by this invocation (a resume runs the rest)
        "resumed_from": start if cfg.resume else None,
        "wall_time_s": wall,
        "samples_per_s": log.samples_per_s,
        "eval_examples": eval_size,
        "final": {"train_loss": history[-1]["loss"] if history else None,
                  "train_accuracy": history[-1]["accuracy"] if history else None,
                  **{f"eval_{k}": v for k, v in evaluation.items()}},
        "memory": memory,
        "collectives": collectives,
        **({"pipeline": pipe} if pipe is not None else {}),
        **({"layout": chosen} if chosen is not None else {}),
        "history": history,
        "checkpoints": checkpointer.all_steps(),
        "nonfinite_steps": [h["step"] for h in history if h.get("nonfinite")],  # skipped (--skip-nonfinite)
    }
    if lead:
        write_outputs(cfg.out, summary, f"{cfg.model} on {task.name}, {mesh_text}, batch {cfg.batch_size}")
    return summary


def _nonfinite(e: NonFiniteError, cfg: Config, checkpointer: Checkpointer) -> NonFiniteError:
    """The job's stop at a non-finite step: the step, the last good checkpoint and how to go on from it."""
    last = checkpointer.latest_step()
    out = os.path.abspath(cfg.out)
    if last is not None:
        where = (f"The last good checkpoint is step {last} in {checkpointer.directory!r}; continue from it, skipping "
                 f"the update of such steps, with: python -m models.train --out {out} --resume --skip-nonfinite")
    else:
        where = (f"No checkpoint was saved before it (--save-every {cfg.save_every}); start again with --overwrite "
                 "and --skip-nonfinite (such steps' updates skipped)")
    return NonFiniteError(f"{e}; the run stopped there and saved nothing from step {e.step} on. {where} (or "
                          "start a new run with a lower --lr or --clip-norm).", step=e.step, loss=e.loss,
                          grad_norm=e.grad_norm)


def _finished_summary(out: str, step: int) -> dict | None:
    """What a resume of a finished run returns: the run's own ``metrics.json`` (None if it has none: then the
    resume evaluates and writes it, running no step)."""
    try:
        with open(os.path.join(out, "metrics.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return {**summary, "steps_run": 0, "resumed_from": step, "nothing_to_do": True}


def restore_state(out: str, *, mesh: DeviceMesh | None = None, step: int | None = None) -> tuple[TrainState, dict]:
    """The train state saved by a run under ``out`` (default: its latest step), laid out on ``mesh`` (default:
    every device on ``dp``) as the job lays a run out there, and the run's saved meta (``config``, ``history``).

    The mesh need not be the one the run trained on (saved on 8 devices, restored on 4 or 2; a pipelined
    run's checkpoint holds the model's own tree, which restores onto any mesh). A mesh with a ``pp`` dim gives
    the pipeline's stacked state, with the run's saved ``--schedule``, ``--microbatches`` and
    ``--stages-per-rank`` when it was pipelined over the same pp size (else the job's defaults).
    """
    ckpt_dir = os.path.join(os.path.abspath(out), "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"restore_state: no checkpoint folder {ckpt_dir!r}; give the --out folder of a run.")
    mesh = mesh if mesh is not None else build_mesh(None)
    checkpointer = Checkpointer(ckpt_dir)
    try:
        meta = checkpointer.restore_meta(step)
        known = {f.name for f in dataclasses.fields(Config)}
        cfg = Config(**{k: v for k, v in meta.get("config", {}).items() if k in known})
        check_config(cfg)
        if "pp" in mesh.mesh_dim_names:  # the pipeline's flags, checked against the mesh as the job checks them
            spec = ",".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape))
            cfg = dataclasses.replace(cfg, mesh=spec, sequence_parallel=False, weight_stationary=False,
                                      reshard_after_forward=None, activation_checkpointing=None,
                                      **_pipeline_flags(meta, mesh))
            try:
                check_config(cfg)
            except ValueError as e:
                raise ValueError(f"restore_state: mesh={spec!r} cannot pipeline the run saved in {ckpt_dir!r} ({e}); "
                                 "restore it onto a mesh the job could train it on.") from e
        _, seq_len, _ = task_dims(cfg)
        progs = programs(cfg, mesh)
        target = jax.eval_shape(progs.init, jax.random.key(0), jax.ShapeDtypeStruct((2, seq_len), jnp.int32))
        if progs.plan is None:
            target = abstract_like(target, progs.state_sharding)
        return restore_job_state(checkpointer, target, progs.plan, mesh, progs.optimizer, progs.layout, step)
    finally:
        checkpointer.close()


def _pipeline_flags(meta: dict, mesh: DeviceMesh) -> dict:
    """The saved run's pipeline flags for a restore onto ``mesh``: kept when both pipeline over one pp size."""
    flags = meta.get("flags") or {}
    if dict(parse_mesh(flags.get("mesh")) or ()).get("pp") != mesh.size("pp"):
        return {}
    return {k: flags[k] for k in ("schedule", "microbatches", "stages_per_rank") if flags.get(k) is not None}
