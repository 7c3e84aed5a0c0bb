"""The command line: ``python -m models.train`` and the ``spmd-train`` console script.

This module imports no JAX at import time: ``main`` first gives a single-process run 8 CPU fake devices
(when nothing else chose the device count), then imports the job. That is the only place the job touches
``XLA_FLAGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from models._data import DigitTask
from models.train._config import AUTO, CHECKPOINTING, HARDWARE, MESH_DIMS, MODELS, SCHEDULES, Config, parse_bytes

__all__ = ["parse_args", "main", "default_cpu_devices", "summary_line"]

CPU_DEVICES = 8


def default_cpu_devices(environ=os.environ, modules=sys.modules) -> bool:
    """Ask JAX for ``CPU_DEVICES`` CPU fake devices, unless JAX already started, a launcher runs several
    processes, ``spmdrun --devices-per-proc`` chose the count, or ``XLA_FLAGS`` already sets it.
    True if it set ``XLA_FLAGS``."""
    if "jax" in modules or int(environ.get("WORLD_SIZE", "1") or 1) > 1 or environ.get("SPMD_DEVICES_PER_PROC"):
        return False
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={CPU_DEVICES}".strip()
    return True


def _parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m models.train",
        description="Train a flax model on a device mesh: data parallel (dp: DDP), fully sharded (fsdp: FSDP / "
                    "ZeRO-3) and tensor parallel (tp: Megatron, optionally sequence parallel), alone or combined "
                    "(e.g. --mesh dp=2,fsdp=2,tp=2), and pipeline parallel (pp: the blocks in stages, --schedule, "
                    "--microbatches; e.g. --mesh pp=2,fsdp=4). --resume continues a run with its saved flags.",
    )
    p.add_argument("--mesh", default=None, help=f"the mesh, e.g. dp=8; dims: {', '.join(MESH_DIMS)} (default: every "
                                               f"visible device on dp); '{AUTO}': spmd.parallel.auto_layout picks the "
                                               "layout by predicted step time, prints its top 5 and why, and records "
                                               "predicted vs measured in metrics.json")
    p.add_argument("--memory-budget", type=_budget, default=None, metavar="BYTES",
                   help="with --mesh auto: the bytes per device the picked layout must fit, e.g. 2GiB or 512MB "
                        "(default with --hardware: that hardware's memory)")
    p.add_argument("--hardware", choices=HARDWARE, default=None,
                   help="with --mesh auto: plan for this hardware's published figures (its links inside and across "
                        "nodes, matmul peak, memory bandwidth and size) instead of this machine's calibration; the "
                        "visible devices stand in for it")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"global batch (default {d.batch_size})")
    p.add_argument("--accum-steps", type=int, default=d.accum_steps,
                   help="micro-batches per step, one gradient all-reduce per step (default 1)")
    p.add_argument("--model", choices=MODELS, default=d.model, help=f"default {d.model}")
    p.add_argument("--text", default=None, metavar="FILE", help="byte-level language model on this text file "
                                                                 "(default: the built-in digit task)")
    p.add_argument("--out", default=d.out, metavar="DIR", help=f"outputs and checkpoints (default {d.out})")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with the flags it was started with (a "
                        "flag given again must have the same value)")
    p.add_argument("--overwrite", action="store_true", help="replace the run (checkpoints, outputs) in --out")
    p.add_argument("--save-every", type=int, default=d.save_every, help=f"checkpoint every K steps (default {d.save_every})")
    p.add_argument("--seed", type=int, default=d.seed, help="parameter init and data order, in [0, 2**63) (default 0)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"warmup steps (default {d.warmup})")
    p.add_argument("--lr-floor", type=float, default=d.lr_floor,
                   help=f"final learning rate of the cosine decay, as a fraction of --lr (default {d.lr_floor})")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm,
                   help=f"clip gradients to this global norm (default {d.clip_norm})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay (default {d.weight_decay})")
    p.add_argument("--task", choices=DigitTask.OPS, default=d.task,
                   help=f"the built-in task: sort or reverse random digits (default {d.task})")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per example, the model's sequence: the digit task's N / 2 digits and their answer "
                        f"(the mlp reads N digits), or N bytes of context with --text (default {2 * d.length}; "
                        f"{d.context} with --text)")
    # the task's own sizes, which --seq-len sets: kept for command lines and runs that name them
    p.add_argument("--length", type=int, default=d.length, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=d.context, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=d.layers, help=f"transformer layers (default {d.layers})")
    p.add_argument("--d-model", type=int, default=d.d_model, help=f"transformer width (default {d.d_model})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"MLP width (default {d.hidden})")
    p.add_argument("--moe-every", type=int, default=d.moe_every,
                   help=f"--model moe: experts in every Nth block (default {d.moe_every}; a pp mesh dim needs 1)")
    p.add_argument("--scan-layers", action="store_true",
                   help="--model llama or moe: the blocks as one nn.scan stack, parameters stacked by layer (moe: "
                        "--moe-every 1)")
    p.add_argument("--log-every", type=int, default=d.log_every, help=f"steps between metric reads (default {d.log_every})")
    p.add_argument("--eval-size", type=int, default=None,
                   help="held-out examples for the final evaluation, a multiple of the dp size (default: 512 "
                        "rounded down to one)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with a tp mesh dim: layer norms and activations between blocks cut on the sequence over tp")
    p.add_argument("--weight-stationary", action="store_true",
                   help="with a tp mesh dim: the weights stay cut over tp and the activations between the layers are "
                        "cut on the batch (gathered around each layer), the layout GSPMD runs at small batch")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="with an fsdp mesh dim: gather each unit again for its backward pass (default: yes for the "
                        "transformer, no for the mlp); --no-reshard-after-forward keeps the gathered units")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING, default=None,
                   help="recompute each block's forward pass in its backward pass instead of keeping its "
                        "activations: full keeps only each block's input, dots its matmul outputs too (default: "
                        "keep every activation; not with a pp mesh dim)")
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help=f"with a pp mesh dim: the pipeline schedule, one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="with a pp mesh dim: micro-batches per step, dividing each replica's batch (default: the pp "
                        "size)")
    p.add_argument("--stages-per-rank", type=int, default=d.stages_per_rank, metavar="V",
                   help="with --schedule interleaved or looped_bfs: pipeline stages per pp rank (default 1)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="a step whose loss or gradient norm is not finite keeps the previous parameters and optimizer "
                        "state (its update skipped, counted in metrics.json) instead of stopping the run there")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="train on N of the visible devices (default: all; a --mesh must use exactly that many)")
    return p


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("models.train: ")) from None


def parse_args(argv: list[str] | None = None) -> Config:
    """The ``Config`` of a command line (argparse exits with its usage message on a malformed one)."""
    return _parse(argv)[0]


def _parse(argv: list[str] | None) -> tuple[Config, frozenset[str]]:
    """The ``Config`` and the names of the fields the command line gave (``--resume`` takes the others from the
    run's checkpoint)."""
    parser = _parser()
    args = sys.argv[1:] if argv is None else argv
    for flag, value in zip(args, args[1:]):
        if flag == "--memory-budget" and value.startswith("-") and value[1:2].isdigit():
            try:  # argparse takes '-1GiB' for an option and says only "expected one argument"
                _budget(value)
            except argparse.ArgumentTypeError as e:
                parser.error(f"argument --memory-budget: {e}")
    a = parser.parse_args(argv)
    given = _parser()
    for action in given._actions:
        action.default = argparse.SUPPRESS  # a second parse that keeps only what was typed
    typed = vars(given.parse_args(argv))
    if a.seq_len is not None:
        _seq_len(parser, a, typed)
    names = [f.name for f in dataclasses.fields(Config) if hasattr(a, f.name)]
    return Config(**{n: getattr(a, n) for n in names}), frozenset(n for n in names if n in typed)


def _seq_len(parser: argparse.ArgumentParser, a: argparse.Namespace, typed: dict) -> None:
    """``--seq-len N`` as the task's size: ``--context N`` with ``--text``, else the digit task's ``--length``
    (``N / 2`` digits, each followed by its answer, for a sequence model; ``N`` for the mlp's window)."""
    n = a.seq_len
    if n < 1:
        parser.error(f"argument --seq-len: {n!r} must be an int >= 1")
    lm = a.model != "mlp"
    own = "context" if a.text is not None else "length"
    value = n if a.text is not None or not lm else n // 2
    if "length" in typed or "context" in typed:
        parser.error(f"argument --seq-len: give the sequence length once (--seq-len {n}, not with --{own})")
    if a.text is None and lm and n % 2:
        parser.error(f"argument --seq-len: {n!r} is odd; the digit task's sequence is its digits followed by their "
                     f"answer, 2 x --length tokens: use an even --seq-len (e.g. {n + 1})")
    setattr(a, own, value)
    typed[own] = value


def summary_line(summary: dict, out: str) -> str:
    """The job's last line: what this invocation ran (not the run's total), its throughput when measured, and
    the held-out metrics the task has."""
    f, n = summary["final"], summary.get("steps_run", summary["steps"])
    if n:
        rate = summary["samples_per_s"]
        done = (f"{n} step{'s' if n != 1 else ''}" + (f" (steps {summary['resumed_from'] + 1}-{summary['steps']})"
                                if summary.get("resumed_from") else "")
                + f" in {summary['wall_time_s']:.1f} s" + (f" ({rate:,.0f} samples/s)" if rate else ""))
    else:
        done = f"nothing to train (the run is finished at step {summary['steps']})"
    parts = []
    if f.get("train_loss") is not None:
        parts.append(f"train loss {f['train_loss']:.4f}")
    if f.get("eval_token_accuracy") is not None:
        parts.append(f"held-out token accuracy {f['eval_token_accuracy']:.4f}")
    if f.get("eval_sequence_accuracy") is not None:
        parts.append(f"sequence accuracy {f['eval_sequence_accuracy']:.4f}")
    skipped = summary.get("nonfinite_steps") or []
    if skipped:
        parts.append(f"{len(skipped)} non-finite step{'s' if len(skipped) != 1 else ''} skipped (step "
                     + ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "") + ")")
    return f"models.train: {done}; " + ", ".join(parts) + f"; outputs in {os.path.abspath(out)}"


def main(argv: list[str] | None = None) -> int:
    """Run the job from the command line; the exit code (0, 2 for a refused input, 130 on Ctrl-C)."""
    cfg, given = _parse(argv)
    default_cpu_devices()
    # JAX and the job load only here, after default_cpu_devices() had its chance to set XLA_FLAGS.
    import jax

    from models._checkpoint import CheckpointError
    from models.train._loop import NonFiniteError
    from models.train._outdir import RunLockedError
    from models.train._run import run

    try:
        summary = run(cfg, given=given)
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, RunLockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if jax.process_index() == 0 and not summary.get("nothing_to_do"):
        print(summary_line(summary, cfg.out), file=sys.stderr)
    return 0
