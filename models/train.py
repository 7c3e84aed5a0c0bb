"""The training job: data-parallel training of a flax model on all visible devices.

    python -m models.train                       # transformer sorting digits, 8 CPU fake devices
    python -m models.train --model mlp --steps 300
    python -m models.train --text README.md --steps 200 --out runs/text
    python -m models.train --resume              # continue runs/default from its last checkpoint

With no ``XLA_FLAGS`` set (and no multi-process launcher), the job asks JAX
for 8 CPU fake devices before JAX starts. Under ``spmdrun`` (``WORLD_SIZE`` >
1) it joins the process group first; every process runs the same program and
process 0 writes the progress bar, the plot and the metrics.

Outputs under ``--out`` (default ``runs/default``): ``checkpoints/<step>/``
(orbax), ``metrics.json`` (config, per-step history, final evaluation, timing)
and ``loss.png``.
"""

from __future__ import annotations

import os
import sys

# 8 CPU fake devices by default, unless JAX already started, a launcher runs several processes, or
# spmdrun --devices-per-proc chose the count.
if "jax" not in sys.modules and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 and not os.environ.get(
        "SPMD_DEVICES_PER_PROC"):
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models._checkpoint import Checkpointer, CheckpointError, abstract_like  # noqa: E402
from models._data import DigitTask, TextTask  # noqa: E402
from models._ddp import TrainState, init_train_state, make_train_step  # noqa: E402
from models._mlp import MLP  # noqa: E402
from models._transformer import Transformer  # noqa: E402
from placements import ReduceOp, Replicate, Shard  # noqa: E402
from spmd import DeviceMesh, all_reduce, init_device_mesh, spmd  # noqa: E402

__all__ = ["Config", "run", "main", "parse_args", "build_mesh", "restore_state"]

MODELS = ("transformer", "mlp")
# What the config must keep across a resume for the result to be the same run.
_RUN_KEYS = ("model", "task", "text", "seed", "batch_size", "accum_steps", "length", "context", "layers", "d_model",
             "heads", "hidden", "lr", "warmup", "steps")


@dataclass(frozen=True)
class Config:
    """Everything that defines a run (the CLI flags)."""

    mesh: str | None = None  # "dp=8"; None: every device
    steps: int = 600
    batch_size: int = 128
    accum_steps: int = 1
    model: str = "transformer"
    text: str | None = None
    out: str = "runs/default"
    resume: bool = False
    overwrite: bool = False
    save_every: int = 200
    seed: int = 0
    lr: float = 3e-3
    warmup: int = 50
    task: str = "sort"  # the built-in task: "sort" or "reverse" digits
    length: int = 8  # digits per example (built-in task)
    context: int = 64  # bytes of context (--text)
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    hidden: int = 256  # MLP width (two hidden layers)
    log_every: int = 10
    eval_size: int = 512
    progress: bool = True


# --- validation -----------------------------------------------------------------------------
def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"models.train: --{name.replace('_', '-')}={value!r} must be an int >= 1.")


def _check_config(cfg: Config) -> None:
    for name in ("steps", "batch_size", "accum_steps", "save_every", "length", "context", "layers", "d_model",
                 "heads", "hidden", "log_every", "eval_size"):
        _positive(name, getattr(cfg, name))
    if cfg.task not in DigitTask.OPS:
        raise ValueError(f"models.train: --task={cfg.task!r} is unknown; use one of {DigitTask.OPS}.")
    if cfg.model not in MODELS:
        raise ValueError(f"models.train: --model={cfg.model!r} is unknown; use one of {MODELS}.")
    if cfg.d_model % cfg.heads:
        raise ValueError(
            f"models.train: --d-model={cfg.d_model} is not divisible by --heads={cfg.heads}; pick heads dividing d_model."
        )
    if not cfg.lr > 0:
        raise ValueError(f"models.train: --lr={cfg.lr!r} must be > 0.")
    if cfg.warmup < 0:
        raise ValueError(f"models.train: --warmup={cfg.warmup!r} must be >= 0.")
    if cfg.resume and cfg.overwrite:
        raise ValueError("models.train: --resume and --overwrite contradict each other; give one of them.")
    if cfg.text is not None and not os.path.isfile(cfg.text):
        raise FileNotFoundError(
            f"models.train: --text={cfg.text!r} does not exist or is not a file; give the path of a text file "
            "(e.g. --text README.md), or leave --text out to train on the built-in digit task."
        )


def parse_mesh(spec: str | None) -> int | None:
    """The dp size from ``"dp=8"`` (None: every device)."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise TypeError(f"models.train: --mesh={spec!r} must be a string such as 'dp=8'.")
    dp = None
    for part in spec.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name:
            raise ValueError(f"models.train: --mesh={spec!r} must look like 'dp=8' (name=size).")
        if name != "dp":
            raise ValueError(
                f"models.train: --mesh={spec!r} names the mesh dim {name!r}, which this job does not know; it is "
                "data-parallel only: use --mesh dp=N."
            )
        try:
            dp = int(size)
        except ValueError:
            raise ValueError(f"models.train: --mesh={spec!r} gives dp size {size!r}, not an int; use e.g. --mesh dp=8.") from None
        if dp < 1:
            raise ValueError(f"models.train: --mesh={spec!r} gives dp size {dp}; it must be >= 1.")
    return dp


def build_mesh(spec: str | None) -> DeviceMesh:
    """The 1-D ``("dp",)`` mesh of the job: ``--mesh dp=N`` or every device."""
    n_dev = jax.device_count()
    dp = parse_mesh(spec)
    if dp is None:
        dp = n_dev
    if dp > n_dev:
        hint = ""
        if jax.devices()[0].platform == "cpu":
            hint = f", or set XLA_FLAGS=--xla_force_host_platform_device_count={dp} before starting"
        raise ValueError(
            f"models.train: --mesh={spec!r} needs {dp} devices but only {n_dev} {jax.devices()[0].platform} "
            f"device(s) are visible; use --mesh dp=N with N <= {n_dev}{hint}."
        )
    return init_device_mesh(jax.devices()[0].platform, (dp,), mesh_dim_names=("dp",))


# --- model, loss, data ------------------------------------------------------------------------
def make_task(cfg: Config):
    return TextTask(cfg.text, cfg.context) if cfg.text is not None else DigitTask(cfg.task, cfg.length)


def _task_dims(cfg: Config) -> tuple[int, int, int]:
    """(vocab size, input positions, target positions) of the task, without reading any file."""
    layout = _layout(cfg)
    if cfg.text is not None:  # TextTask's dims, without opening cfg.text
        return 256, cfg.context, (cfg.context if layout == "lm" else 1)
    task = make_task(cfg)
    return task.vocab_size, task.seq_len(layout), task.out_len(layout)


def make_model(cfg: Config):
    vocab, seq_len, out_len = _task_dims(cfg)
    if cfg.model == "mlp":
        return MLP(vocab, out_len, (cfg.hidden, cfg.hidden))
    return Transformer(vocab, seq_len, cfg.layers, cfg.d_model, cfg.heads)


def _layout(cfg: Config) -> str:
    return "window" if cfg.model == "mlp" else "lm"


def cross_entropy(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    """Masked mean next-token loss and accuracy (every example has the same number of targets)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch["mask"]
    total = jnp.sum(mask)
    acc = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * mask) / total
    return jnp.sum(nll * mask) / total, {"accuracy": acc}


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def global_batch(batch: dict, mesh: DeviceMesh) -> dict:
    """The host batch as global arrays sharded on dp (each process supplies its own devices' rows)."""
    sharding = NamedSharding(mesh.jax_mesh, P("dp"))
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}


def make_eval_step(model, cfg: Config, mesh: DeviceMesh) -> Callable:
    """Held-out accuracy, data-parallel too: greedy generation for the digit task."""
    rep, shard = [Replicate()], [Shard(0)]

    def local(params, batch):
        if cfg.text is None and cfg.model == "transformer":
            n = cfg.length
            buf = batch["inputs"].at[:, n + 1:].set(0)  # keep the digits and SEP; generate the rest

            def gen(i, carry):
                buf, preds = carry
                logits = model.apply({"params": params}, buf)
                tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, n + i, axis=1, keepdims=False), -1)
                preds = preds.at[:, i].set(tok.astype(preds.dtype))
                buf = jnp.where(jnp.arange(buf.shape[1]) == n + 1 + i, tok[:, None].astype(buf.dtype), buf)
                return buf, preds

            preds = jnp.zeros_like(batch["targets"][:, :n])  # device-varying, like the loop's results
            _, preds = jax.lax.fori_loop(0, n, gen, (buf, preds))
            right = preds == batch["targets"][:, n:]
        else:
            logits = model.apply({"params": params}, batch["inputs"])
            right = (jnp.argmax(logits, -1) == batch["targets"]) | (batch["mask"] == 0)
        token_acc = jnp.mean(right.astype(jnp.float32))
        seq_acc = jnp.mean(jnp.all(right, axis=1).astype(jnp.float32))
        return {k: all_reduce(v, ReduceOp.AVG, group="dp") for k, v in
                {"token_accuracy": token_acc, "sequence_accuracy": seq_acc}.items()}

    return spmd(local, mesh, in_placements=(rep, shard), out_placements=rep)


# --- the run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Programs:
    model: Any
    optimizer: optax.GradientTransformation
    init: Callable  # (key, sample inputs) -> replicated TrainState
    train_step: Callable
    eval_step: Callable


def _program_key(cfg: Config) -> Config:
    """The config with only what decides the compiled programs (not the seed, the file or the paths)."""
    return dataclasses.replace(cfg, mesh=None, text=None if cfg.text is None else "", out="", resume=False,
                               overwrite=False, save_every=1, seed=0, log_every=1, eval_size=1, progress=False)


@functools.lru_cache(maxsize=8)
def _programs(key: Config, mesh: DeviceMesh) -> _Programs:
    """The jitted programs of a run, shared by runs in one process that would compile the same ones."""
    model = make_model(key)
    optimizer = make_optimizer(key)
    replicated = NamedSharding(mesh.jax_mesh, P())
    init = jax.jit(lambda rng, x: init_train_state(model.init(rng, x)["params"], optimizer), out_shardings=replicated)
    train_step = make_train_step(lambda p, b: cross_entropy(model.apply({"params": p}, b["inputs"]), b),
                                 optimizer, mesh, accum_steps=key.accum_steps)
    return _Programs(model, optimizer, init, train_step, make_eval_step(model, key, mesh))


def _maybe_init_distributed() -> None:
    """Join the process group when started by a launcher (spmdrun / torchrun variables)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    import spmd.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group()


def _run_config(cfg: Config) -> dict:
    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in _RUN_KEYS}


def _check_resume_config(saved: dict, cfg: Config, where: str) -> None:
    now = _run_config(cfg)
    diff = {k: (saved.get(k), now[k]) for k in _RUN_KEYS if saved.get(k) != now[k]}
    if diff:
        listed = ", ".join(f"--{k.replace('_', '-')}: saved {a!r}, given {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"models.train: --resume from {where!r} with a different run config ({listed}); resume with the "
            "saved values, or start a new run in another --out."
        )


def _plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(steps, [h["loss"] for h in history], lw=1)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("train loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [h["accuracy"] for h in history], lw=1, color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train accuracy (target tokens)")
    ax2.set_ylim(0, 1.02)
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: Config, *, on_step: Callable[[int, TrainState], None] | None = None) -> dict:
    """Train as ``cfg`` says; returns the summary also written to ``metrics.json``.

    ``on_step(step, state)`` is called after each step (a hook for tests and
    tools). A ``KeyboardInterrupt`` (Ctrl-C, or raised by the hook) saves a
    checkpoint of the last finished step before it propagates, so ``--resume``
    continues exactly where the run stopped.
    """
    _check_config(cfg)
    _maybe_init_distributed()
    mesh = build_mesh(cfg.mesh)
    n_dp = mesh.size("dp")
    if cfg.batch_size % (n_dp * cfg.accum_steps):
        raise ValueError(
            f"models.train: --batch-size={cfg.batch_size} is not divisible by the dp size {n_dp}"
            + (f" times --accum-steps={cfg.accum_steps}" if cfg.accum_steps > 1 else "")
            + f"; use a multiple of {n_dp * cfg.accum_steps} (e.g. {n_dp * cfg.accum_steps * max(1, cfg.batch_size // (n_dp * cfg.accum_steps))})."
        )
    lead = jax.process_index() == 0
    task = make_task(cfg)
    layout = _layout(cfg)
    programs = _programs(_program_key(cfg), mesh)

    ckpt_dir = os.path.join(os.path.abspath(cfg.out), "checkpoints")
    if not cfg.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        if not cfg.overwrite:
            raise ValueError(
                f"models.train: --out={cfg.out!r} already holds checkpoints ({ckpt_dir}); pass --resume to continue "
                "that run, --overwrite to replace it, or choose another --out."
            )
        if lead:
            shutil.rmtree(ckpt_dir)
    if cfg.resume and not (os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir)):
        raise CheckpointError(
            f"models.train: --resume found no checkpoint under {ckpt_dir!r}; start the run without --resume, or "
            "point --out at the folder of the run to resume."
        )

    state = programs.init(jax.random.key(cfg.seed), task.batch(cfg.seed, 0, 2, layout)["inputs"])
    history: list[dict] = []
    checkpointer = Checkpointer(ckpt_dir, save_every=cfg.save_every)
    try:
        if cfg.resume:
            # The config first: a checkpoint of another model would fail to restore with a shape error that
            # blames the (good) checkpoint.
            _check_resume_config(checkpointer.restore_meta().get("config", {}), cfg, ckpt_dir)
            state, meta = checkpointer.restore(state)
            history = list(meta.get("history", []))
        start = int(jax.device_get(state.step))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))

        def meta_now() -> dict:
            return {"config": _run_config(cfg), "history": history}

        train_step = programs.train_step
        bar = None
        if cfg.progress and lead:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.model} dp={n_dp}", unit="step", dynamic_ncols=True)
        if lead and start == 0:
            print(f"models.train: {cfg.model} ({n_params:,} parameters) on {task.name}, mesh dp={n_dp} "
                  f"({jax.device_count()} {jax.devices()[0].platform} device(s), {jax.process_count()} process(es)), "
                  f"batch {cfg.batch_size}, {cfg.steps} steps", file=sys.stderr)
        pending: list[tuple[int, dict]] = []
        t_start = time.perf_counter()
        t_window, n_window, samples_per_s = t_start, 0, float("nan")
        timed_steps, timed_time = 0, 0.0

        def flush() -> None:
            nonlocal t_window, n_window, samples_per_s, timed_steps, timed_time
            if not pending:
                return
            got = jax.device_get([m for _, m in pending])
            for (s, _), m in zip(pending, got):
                history.append({"step": s, **{k: float(v) for k, v in m.items()}})
            now = time.perf_counter()
            if n_window and pending[0][0] > start + 1:  # the first step compiles: not counted
                samples_per_s = n_window * cfg.batch_size / (now - t_window)
                timed_steps += n_window
                timed_time += now - t_window
            t_window, n_window = now, 0
            pending.clear()
            if bar is not None:
                last = history[-1]
                bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['accuracy']:.3f}",
                                samples_s=f"{samples_per_s:,.0f}", refresh=False)

        step = start
        try:
            while step < cfg.steps:
                batch = global_batch(task.batch(cfg.seed, step, cfg.batch_size, layout), mesh)
                state, metrics = train_step(state, batch)
                step += 1
                pending.append((step, metrics))
                n_window += 1
                if step == start + 1 or step % cfg.log_every == 0 or step == cfg.steps:
                    flush()
                if bar is not None:
                    bar.update(1)
                if step % cfg.save_every == 0 or step == cfg.steps:
                    flush()
                    checkpointer.save(step, state, meta_now(), force=step == cfg.steps)
                if on_step is not None:
                    on_step(step, state)
        except KeyboardInterrupt:
            flush()
            checkpointer.save(step, state, meta_now(), force=True)
            checkpointer.wait()
            if bar is not None:
                bar.close()
            if lead:
                print(f"models.train: interrupted after step {step}; checkpoint saved under {ckpt_dir}; continue "
                      "with --resume.", file=sys.stderr)
            raise
        flush()
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - t_start

        eval_batch = task.batch(cfg.seed, 0, max(n_dp, cfg.eval_size // n_dp * n_dp), layout, stream=1)
        evaluation = {k: float(v) for k, v in
                      jax.device_get(programs.eval_step(state.params, global_batch(eval_batch, mesh))).items()}
        checkpointer.wait()
    finally:
        checkpointer.close()

    summary = {
        "config": dataclasses.asdict(cfg),
        "task": task.name,
        "mesh": {"dp": n_dp},
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "processes": jax.process_count(),
        "parameters": n_params,
        "steps": cfg.steps,
        "resumed_from": start if cfg.resume else None,
        "wall_time_s": wall,
        "samples_per_s": (timed_steps * cfg.batch_size / timed_time) if timed_time else None,
        "final": {"train_loss": history[-1]["loss"] if history else None,
                  "train_accuracy": history[-1]["accuracy"] if history else None,
                  **{f"eval_{k}": v for k, v in evaluation.items()}},
        "history": history,
        "checkpoints": checkpointer.all_steps(),
    }
    if lead:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if history:
            _plot(history, os.path.join(cfg.out, "loss.png"),
                  f"{cfg.model} on {task.name}, dp={n_dp}, batch {cfg.batch_size}")
    return summary


def restore_state(out: str, *, mesh: DeviceMesh | None = None, step: int | None = None) -> tuple[TrainState, dict]:
    """The train state saved by a run under ``out`` (default: its latest step), replicated on ``mesh``
    (default: every device), and the run's saved meta (``config``, ``history``).

    The mesh need not be the one the run trained on (saved on 8 devices,
    restored on 4 or 2).
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
        _check_config(cfg)
        _, seq_len, _ = _task_dims(cfg)
        target = jax.eval_shape(_programs(_program_key(cfg), mesh).init, jax.random.key(0),
                                jax.ShapeDtypeStruct((2, seq_len), jnp.int32))
        return checkpointer.restore(abstract_like(target, NamedSharding(mesh.jax_mesh, P())), step)
    finally:
        checkpointer.close()


# --- CLI ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m models.train",
        description="Data-parallel training (DDP on JAX): every device holds the parameters, the batch is split "
                    "over the dp mesh dim, gradients are averaged.",
    )
    p.add_argument("--mesh", default=None, help="the mesh, e.g. dp=8 (default: every visible device)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"global batch (default {d.batch_size})")
    p.add_argument("--accum-steps", type=int, default=d.accum_steps,
                   help="micro-batches per step, one gradient all-reduce per step (default 1)")
    p.add_argument("--model", choices=MODELS, default=d.model, help=f"default {d.model}")
    p.add_argument("--text", default=None, metavar="FILE", help="byte-level language model on this text file "
                                                                 "(default: the built-in digit task)")
    p.add_argument("--out", default=d.out, metavar="DIR", help=f"outputs and checkpoints (default {d.out})")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoints already in --out")
    p.add_argument("--save-every", type=int, default=d.save_every, help=f"checkpoint every K steps (default {d.save_every})")
    p.add_argument("--seed", type=int, default=d.seed, help="parameter init and data order (default 0)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"warmup steps (default {d.warmup})")
    p.add_argument("--task", choices=DigitTask.OPS, default=d.task,
                   help=f"the built-in task: sort or reverse random digits (default {d.task})")
    p.add_argument("--length", type=int, default=d.length, help=f"digits per example (default {d.length})")
    p.add_argument("--context", type=int, default=d.context, help=f"bytes of context with --text (default {d.context})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"transformer layers (default {d.layers})")
    p.add_argument("--d-model", type=int, default=d.d_model, help=f"transformer width (default {d.d_model})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"MLP width (default {d.hidden})")
    p.add_argument("--log-every", type=int, default=d.log_every, help=f"steps between metric reads (default {d.log_every})")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a = p.parse_args(argv)
    return Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config) if hasattr(a, f.name)})


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        summary = run(cfg)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if jax.process_index() == 0:
        f = summary["final"]
        acc = f.get("eval_sequence_accuracy")
        print(
            f"models.train: {summary['steps']} steps in {summary['wall_time_s']:.1f} s "
            f"({summary['samples_per_s'] or float('nan'):,.0f} samples/s); train loss {f['train_loss']:.4f}, "
            f"held-out token accuracy {f['eval_token_accuracy']:.4f}"
            + (f", sequence accuracy {acc:.4f}" if acc is not None else "")
            + f"; outputs in {os.path.abspath(cfg.out)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
