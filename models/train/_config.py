"""The run's configuration: one frozen value, its checks, and the mesh spec (pure Python, no JAX).

Every hyper-parameter is a named field with a CLI flag (``--lr-floor`` for the
cosine schedule's final fraction of ``--lr``, ``--clip-norm``,
``--weight-decay``, ``--eval-size``), so a run is fully described by its
``Config``, which ``metrics.json`` records.

Mesh dims: ``MESH_DIMS`` names the dims the job knows and ``DATA_DIMS`` the
ones the batch is split over (a new parallelism adds its dim to both tables
where it is data-parallel, e.g. FSDP's ``fsdp``).

Pipeline parallelism: a ``pp`` mesh dim splits the transformer's blocks into stages
(``spmd.parallel.pipeline``); ``--schedule`` (default ``1f1b``), ``--microbatches`` (default the pp size) and
``--stages-per-rank`` (interleaved only) say how, and are refused without a ``pp`` dim.

``--mesh auto``: ``spmd.parallel.auto_layout`` picks the layout (``models.train._auto``), which the job turns
into the explicit flags of that layout (``--mesh``, ``--sequence-parallel``, ``--weight-stationary``,
``--no-reshard-after-forward``, ``--activation-checkpointing``, ``--accum-steps``) before anything else runs;
``--memory-budget`` bounds the per-device memory of the pick (``auto`` only).

Activation checkpointing: ``--activation-checkpointing full`` (or ``dots``) recomputes each block's forward pass
in its backward pass (``spmd.parallel.activation_checkpointing`` on the model's repeated blocks, after the
layout's transforms); refused with a ``pp`` dim, whose backward pass already recomputes each stage.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from models._data import DigitTask

__all__ = ["Config", "MODELS", "MESH_DIMS", "SCHEDULES", "CHECKPOINTING", "HARDWARE", "AUTO", "pipeline_settings",
           "DATA_DIMS", "STATE_DIMS", "check_config", "parse_mesh", "parse_bytes", "run_config", "check_resume_config",
           "resume_config", "job_flags"]

MODELS = ("transformer", "mlp", "llama", "moe")  # llama, moe: attention through jax.nn.dot_product_attention (cp: a ring)
# The mesh dims the job knows (name -> what it does), in mesh order.
MESH_DIMS = {"dp": "data parallel: the batch is split over it, the state replicated",
             "fsdp": "fully sharded data parallel: the batch is split over it, parameters, gradients and "
                     "optimizer state sharded (spmd.parallel.fully_shard)",
             "tp": "tensor parallel (Megatron): heads, MLP width and vocabulary cut, the batch replicated over it "
                   "(spmd.parallel.parallelize_module; --sequence-parallel also cuts the sequence between blocks)",
             "pp": "pipeline parallel: the transformer's blocks split into stages, the batch into --microbatches "
                   "run by --schedule (spmd.parallel.pipeline)",
             "cp": "context parallel: the sequence cut over it, attention across the cut (ring attention for --model "
                   "llama or moe; the transformer's own attention on the sequence gathered over cp)",
             "ep": "expert parallel: the batch split over it, the MoE experts cut over it, tokens sent to their "
                   "experts with all-to-alls (spmd.parallel.ExpertParallel; --model moe)"}
# The pipeline schedules (spmd.parallel's, named here without importing JAX).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")
# The activation-checkpointing policies (spmd.parallel's POLICIES, named here without importing JAX).
CHECKPOINTING = ("full", "dots", "selective", "minimal", "save_dot_except_mlp", "save_dot_except_mlpwi",
                 "save_qkv_proj", "offload")
# spmd.parallel.HARDWARE's built-ins, named here so that the command line imports no JAX (a test keeps them equal)
HARDWARE = ("a100-80g", "h100", "h200", "tpu-v5p")
# The dims the batch is split over (Shard(0) on each of them).
DATA_DIMS = ("dp", "fsdp", "ep")
# The dims the train state (parameters, gradients, optimizer state) is sharded over.
STATE_DIMS = ("fsdp", "tp", "pp")
AUTO = "auto"  # --mesh auto: spmd.parallel.auto_layout picks the layout
_MAX_SEED = 2**63 - 1  # jax.random.key takes an int64


@dataclass(frozen=True)
class Config:
    """Everything that defines a run (the CLI flags)."""

    mesh: str | None = None  # "dp=8"; None: every device on dp; "auto": auto_layout picks
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
    lr: float = 3e-3  # peak learning rate
    warmup: int = 50  # linear warmup steps, then cosine decay
    lr_floor: float = 0.05  # the cosine schedule ends at lr * lr_floor
    clip_norm: float = 1.0  # gradients clipped to this global norm
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    task: str = "sort"  # the built-in task: "sort" or "reverse" digits
    length: int = 8  # digits per example (built-in task)
    context: int = 64  # bytes of context (--text)
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    hidden: int = 256  # MLP width (two hidden layers)
    moe_every: int = 2  # --model moe: every moe_every-th block holds the experts (1: every block; pp needs 1)
    scan_layers: bool = False  # --model llama or moe: the blocks as one nn.scan stack (moe: --moe-every 1)
    sequence_parallel: bool = False  # with a tp mesh dim: activations between blocks cut on the sequence
    weight_stationary: bool = False  # with a tp mesh dim: weights stay cut, activations cut on the batch
    reshard_after_forward: bool | None = None  # with an fsdp mesh dim; None: the model's default (models._plans)
    activation_checkpointing: str | None = None  # "full" / "dots": the blocks recompute their forward pass; not with pp
    memory_budget: int | None = None  # with --mesh auto: bytes per device the pick must fit
    hardware: str | None = None  # with --mesh auto: plan for this spmd.parallel.HARDWARE built-in, not this machine
    schedule: str | None = None  # with a pp mesh dim: the pipeline schedule; None: 1f1b
    microbatches: int | None = None  # with a pp mesh dim: micro-batches per step and replica; None: the pp size
    stages_per_rank: int = 1  # with --schedule interleaved: pipeline stages per pp rank
    log_every: int = 10
    eval_size: int | None = None  # held-out examples; None: 512 rounded down to a multiple of the data size
    progress: bool = True
    skip_nonfinite: bool = False  # a step with a non-finite loss or grad norm: its update skipped (else: stop)
    devices: int | None = None  # train on this many of the visible devices; None: all (the mesh must use them all)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"models.train: {_flag(name)}={value!r} must be an int >= 1.")


def _real(name: str, value: Any, lo: float, *, lo_open: bool, hi: float = math.inf) -> None:
    """A finite number in ``(lo, hi]`` (``lo_open``) or ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"models.train: {_flag(name)}={value!r} must be a number.")
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        lo_text = f"> {lo}" if lo_open else f">= {lo}"
        hi_text = "" if hi == math.inf else f" and <= {hi}"
        raise ValueError(f"models.train: {_flag(name)}={value!r} must be a finite number {lo_text}{hi_text}.")


def check_config(cfg: Config) -> None:
    """Every check that needs no device and no file but ``--text``; raises before any work."""
    if not isinstance(cfg, Config):
        raise TypeError(f"models.train: cfg={cfg!r} must be a models.train.Config.")
    for name in ("steps", "batch_size", "accum_steps", "save_every", "length", "context", "layers", "d_model",
                 "heads", "hidden", "moe_every", "log_every"):
        _positive(name, getattr(cfg, name))
    if cfg.eval_size is not None:
        _positive("eval_size", cfg.eval_size)
    if cfg.devices is not None:
        _positive("devices", cfg.devices)
    if cfg.skip_nonfinite not in (True, False):
        raise TypeError(f"models.train: --skip-nonfinite={cfg.skip_nonfinite!r} must be a bool.")
    if cfg.scan_layers not in (True, False):
        raise TypeError(f"models.train: --scan-layers={cfg.scan_layers!r} must be a bool.")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed <= _MAX_SEED:
        raise ValueError(f"models.train: --seed={cfg.seed!r} must be an int in [0, 2**63 - 1]; e.g. --seed 0.")
    if cfg.task not in DigitTask.OPS:
        raise ValueError(f"models.train: --task={cfg.task!r} is unknown; use one of {DigitTask.OPS}.")
    if cfg.model not in MODELS:
        raise ValueError(f"models.train: --model={cfg.model!r} is unknown; use one of {MODELS}.")
    if cfg.d_model % cfg.heads:
        raise ValueError(
            f"models.train: --d-model={cfg.d_model} is not divisible by --heads={cfg.heads}; pick heads dividing d_model."
        )
    dims = dict(parse_mesh(cfg.mesh) or ()) if cfg.mesh not in (None, AUTO) else {}
    if "cp" in dims and cfg.model == "mlp":
        raise ValueError(f"models.train: --mesh={cfg.mesh!r} cuts the sequence over cp, the positions a sequence "
                         "model's attention mixes; --model mlp reads a flat window of digits: use --model transformer, "
                         "llama or moe.")
    if "ep" in dims and cfg.model != "moe":
        raise ValueError(f"models.train: --mesh={cfg.mesh!r} cuts experts over ep; --model {cfg.model} has none: use "
                         "--model moe.")
    if cfg.scan_layers and cfg.model not in ("llama", "moe"):
        raise ValueError(f"models.train: --scan-layers stacks a decoder's blocks in one nn.scan; --model {cfg.model} "
                         "has no such form: use --model llama or moe, or drop --scan-layers.")
    if cfg.scan_layers and cfg.model == "moe" and cfg.moe_every != 1:
        raise ValueError(f"models.train: --scan-layers stacks blocks of one shape, but --model moe with "
                         f"--moe-every={cfg.moe_every} has experts in one block of every {cfg.moe_every}: give "
                         "--moe-every 1 (experts in every block), or drop --scan-layers.")
    _real("lr", cfg.lr, 0.0, lo_open=True)
    _real("lr_floor", cfg.lr_floor, 0.0, lo_open=False, hi=1.0)
    _real("clip_norm", cfg.clip_norm, 0.0, lo_open=True)
    _real("weight_decay", cfg.weight_decay, 0.0, lo_open=False)
    if isinstance(cfg.warmup, bool) or not isinstance(cfg.warmup, int) or cfg.warmup < 0:
        raise ValueError(f"models.train: --warmup={cfg.warmup!r} must be an int >= 0.")
    if cfg.resume and cfg.overwrite:
        raise ValueError("models.train: --resume and --overwrite contradict each other; give one of them.")
    if cfg.text is not None and not os.path.isfile(cfg.text):
        raise FileNotFoundError(
            f"models.train: --text={cfg.text!r} does not exist or is not a file; give the path of a text file "
            "(e.g. --text README.md), or leave --text out to train on the built-in digit task."
        )
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(
            f"models.train: --out={cfg.out!r} is a file, not a folder; give a folder for the run's outputs "
            "(it is created if missing)."
        )
    if cfg.mesh == AUTO:
        if cfg.devices is not None:
            raise ValueError(f"models.train: --devices={cfg.devices} with --mesh auto, which weighs the layouts of "
                             "every visible device; drop --devices, or give the mesh yourself (e.g. --mesh dp=4 "
                             "--devices 4).")
        _check_auto(cfg)
        return
    if cfg.memory_budget is not None:
        raise ValueError(f"models.train: --memory-budget={cfg.memory_budget!r} bounds the layout --mesh auto picks, "
                         f"but --mesh={cfg.mesh!r} is explicit; use --mesh auto or drop --memory-budget.")
    if cfg.hardware is not None:
        raise ValueError(f"models.train: --hardware={cfg.hardware!r} is the hardware --mesh auto plans for, but "
                         f"--mesh={cfg.mesh!r} is explicit; use --mesh auto or drop --hardware.")
    dims = dict(parse_mesh(cfg.mesh) or ())
    _check_pipeline(cfg, dims)
    _check_layout_flags(cfg, dims)
    _check_checkpointing(cfg, dims)


def _check_layout_flags(cfg: Config, dims: dict) -> None:
    """--sequence-parallel / --weight-stationary need a tp dim; --[no-]reshard-after-forward an fsdp dim."""
    for name, on in (("sequence_parallel", cfg.sequence_parallel), ("weight_stationary", cfg.weight_stationary)):
        if on and dims.get("tp", 1) < 2:
            what = "the sequence" if name == "sequence_parallel" else "the weights (the activations on the batch)"
            raise ValueError(f"models.train: {_flag(name)} cuts {what} over the tp mesh dim, but --mesh={cfg.mesh!r} "
                             "has no tp dim of size >= 2; add one (e.g. --mesh dp=2,tp=4) or drop the flag.")
    if cfg.sequence_parallel and cfg.weight_stationary:
        raise ValueError("models.train: --sequence-parallel and --weight-stationary cut the activations on the "
                         "sequence and on the batch; give one of them.")
    if cfg.reshard_after_forward is not None and cfg.reshard_after_forward not in (True, False):
        raise TypeError(f"models.train: --reshard-after-forward={cfg.reshard_after_forward!r} must be a bool or None.")
    if cfg.reshard_after_forward is not None and dims.get("fsdp", 1) < 2:
        flag = "--reshard-after-forward" if cfg.reshard_after_forward else "--no-reshard-after-forward"
        raise ValueError(f"models.train: {flag} says when fully_shard gathers the units again, but --mesh="
                         f"{cfg.mesh!r} has no fsdp dim of size >= 2; add one (e.g. --mesh fsdp=8) or drop the flag.")


def _check_checkpointing(cfg: Config, dims: dict) -> None:
    """--activation-checkpointing: a known policy, and no pp dim (a pipeline already recomputes its stages)."""
    ac = cfg.activation_checkpointing
    if ac is None:
        return
    if ac not in CHECKPOINTING:
        raise ValueError(f"models.train: --activation-checkpointing={ac!r} is not a policy; use one of "
                         f"{', '.join(CHECKPOINTING)}, or leave the flag out to keep every activation.")
    if "pp" in dims:
        raise ValueError(f"models.train: --activation-checkpointing={ac!r} with --mesh={cfg.mesh!r}: a pipeline's "
                         "backward pass already recomputes each stage from its stashed input; drop "
                         "--activation-checkpointing, or use a mesh without pp (e.g. --mesh fsdp=8).")


def _check_auto(cfg: Config) -> None:
    """``--mesh auto`` picks the mesh and the layout flags itself, the pipeline's among them."""
    if cfg.memory_budget is not None and (isinstance(cfg.memory_budget, bool) or not isinstance(cfg.memory_budget, int)
                                          or cfg.memory_budget < 1):
        raise ValueError(f"models.train: --memory-budget={cfg.memory_budget!r} must be a number of bytes >= 1 "
                         "(e.g. --memory-budget 2GiB).")
    for name, value in (("sequence_parallel", cfg.sequence_parallel or None),
                        ("weight_stationary", cfg.weight_stationary or None),
                        ("reshard_after_forward", cfg.reshard_after_forward),
                        ("activation_checkpointing", cfg.activation_checkpointing), ("schedule", cfg.schedule),
                        ("microbatches", cfg.microbatches),
                        ("stages_per_rank", cfg.stages_per_rank if cfg.stages_per_rank != 1 else None)):
        if value is not None:
            raise ValueError(f"models.train: {_flag(name)}={value!r} fixes part of the layout, which --mesh auto "
                             f"chooses itself (the pipeline's schedule too); drop {_flag(name)}, or give "
                             "the layout yourself with an explicit --mesh (e.g. --mesh dp=2,tp=4).")


def pipeline_settings(cfg: Config) -> tuple[str, int, int] | None:
    """``(schedule, micro-batches, stages per rank)`` of a run with a ``pp`` mesh dim (defaults filled in);
    None without one."""
    pp = None if cfg.mesh == AUTO else dict(parse_mesh(cfg.mesh) or ()).get("pp")
    if pp is None:
        return None
    return cfg.schedule or "1f1b", cfg.microbatches or pp, cfg.stages_per_rank


def _check_pipeline(cfg: Config, dims: dict) -> None:
    """The pipeline flags: only with a ``pp`` mesh dim, and a schedule that can run on it."""
    pp = dims.get("pp")
    if cfg.microbatches is not None:
        _positive("microbatches", cfg.microbatches)
    _positive("stages_per_rank", cfg.stages_per_rank)
    if pp is None:
        for name, value in (("schedule", cfg.schedule), ("microbatches", cfg.microbatches),
                            ("stages_per_rank", cfg.stages_per_rank if cfg.stages_per_rank != 1 else None)):
            if value is not None:
                raise ValueError(f"models.train: {_flag(name)}={value!r} runs a pipeline over the pp mesh dim, but "
                                 f"--mesh={cfg.mesh!r} has no pp dim; add one (e.g. --mesh pp=2,fsdp=4) or drop "
                                 f"{_flag(name)}.")
        return
    if cfg.schedule is not None and cfg.schedule not in SCHEDULES:
        raise ValueError(f"models.train: --schedule={cfg.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}.")
    schedule, m, v = pipeline_settings(cfg)
    if cfg.model == "moe" and cfg.moe_every != 1:
        raise ValueError(f"models.train: --mesh={cfg.mesh!r} pipelines the model's blocks over pp, but --model moe "
                         f"with --moe-every={cfg.moe_every} has blocks of two shapes (experts in one block of every "
                         f"{cfg.moe_every}); pipeline stages stack blocks of one shape: give --moe-every 1 (experts "
                         "in every block), or a mesh without pp.")
    if cfg.model not in ("transformer", "moe"):
        raise ValueError(f"models.train: --mesh={cfg.mesh!r} pipelines the transformer's blocks over pp, but --model="
                         f"{cfg.model!r} has none of one shape; use --model transformer (or moe with --moe-every 1), "
                         "or a mesh without pp.")
    if v != 1 and schedule not in ("interleaved", "looped_bfs"):
        raise ValueError(f"models.train: --stages-per-rank={v} needs --schedule interleaved or looped_bfs (got "
                         f"{schedule!r}); leave --stages-per-rank out or use one of those.")
    if schedule != "gpipe" and m < pp:
        raise ValueError(f"models.train: --microbatches={m} is below pp={pp}; --schedule {schedule} needs at least "
                         f"one micro-batch per stage: use --microbatches >= {pp}.")
    if schedule == "interleaved" and m % pp:
        raise ValueError(f"models.train: --microbatches={m} is not a multiple of pp={pp}; --schedule interleaved "
                         f"runs micro-batches in groups of pp: use --microbatches {pp * -(-m // pp)}.")
    if cfg.layers < pp * v:
        raise ValueError(f"models.train: --layers={cfg.layers} is fewer than the {pp * v} pipeline stages (pp={pp} x "
                         f"--stages-per-rank={v}); use --layers >= {pp * v} or fewer stages.")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000000"`` as a number of bytes (``--memory-budget``)."""
    s = str(text).strip().replace(" ", "").replace("_", "")
    num = s.rstrip("bBkKmMgGtTiI")
    unit = s[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value * _UNITS[unit] < 1:
        raise ValueError(f"models.train: --memory-budget={text!r} is not a size in bytes; give a positive number "
                         "with an optional unit B, KB, MB, GB, KiB, MiB, GiB (e.g. --memory-budget 2GiB).")
    return int(value * _UNITS[unit])


def parse_mesh(spec: str | None) -> tuple[tuple[str, int], ...] | None:
    """``"dp=2,fsdp=4"`` as ``(("dp", 2), ("fsdp", 4))`` (None: every device on ``dp``).

    Each dim must be one of ``MESH_DIMS`` and appear once; sizes are ints >= 1.
    """
    if spec is None:
        return None
    if spec == AUTO:
        raise ValueError("models.train: --mesh auto is resolved by models.train._auto.choose_layout before the "
                         "mesh is built; give an explicit mesh such as 'dp=8' here.")
    if not isinstance(spec, str):
        raise TypeError(f"models.train: --mesh={spec!r} must be a string such as 'dp=8'.")
    dims: dict[str, int] = {}
    for part in spec.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name:
            raise ValueError(f"models.train: --mesh={spec!r} must look like 'dp=8' (name=size).")
        if name not in MESH_DIMS:
            raise ValueError(
                f"models.train: --mesh={spec!r} names the mesh dim {name!r}, which this job does not know; use "
                f"the dims {tuple(MESH_DIMS)} (e.g. --mesh dp=N)."
            )
        if name in dims:
            raise ValueError(
                f"models.train: --mesh={spec!r} gives the mesh dim {name!r} twice; name each dim once "
                f"(e.g. --mesh {name}={size})."
            )
        try:
            n = int(size)
        except ValueError:
            raise ValueError(
                f"models.train: --mesh={spec!r} gives {name} size {size!r}, not an int; use e.g. --mesh {name}=8."
            ) from None
        if n < 1:
            raise ValueError(f"models.train: --mesh={spec!r} gives {name} size {n}; it must be >= 1.")
        dims[name] = n
    return tuple(dims.items())


# What the config must keep across a resume for the result to be the same run.
_RUN_KEYS = ("model", "task", "text", "seed", "batch_size", "accum_steps", "length", "context", "layers", "d_model",
             "heads", "hidden", "moe_every", "scan_layers", "lr", "warmup", "lr_floor", "clip_norm", "weight_decay",
             "steps")


# What a checkpoint also records for --resume to reuse when the flag is left out, but which a resume may change
# (a run continues on another mesh, saving or logging more often).
_JOB_KEYS = ("mesh", "sequence_parallel", "weight_stationary", "reshard_after_forward", "activation_checkpointing",
             "save_every", "log_every", "eval_size", "schedule", "microbatches", "stages_per_rank", "skip_nonfinite",
             "devices")
# The layout's flags go with the mesh dim they need: a resume given a --mesh without it (or --mesh auto, which
# picks them itself) drops the saved ones.
_MESH_KEYS = {"schedule": "pp", "microbatches": "pp", "stages_per_rank": "pp", "sequence_parallel": "tp",
              "weight_stationary": "tp", "reshard_after_forward": "fsdp"}
# ... and those refused beside a mesh dim: a resume given a --mesh with it (or --mesh auto) drops the saved ones.
_NOT_WITH_KEYS = {"activation_checkpointing": "pp"}


def job_flags(cfg: Config) -> dict:
    """The settings a checkpoint records besides ``run_config``: a resume takes them when not given."""
    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in _JOB_KEYS}


def run_config(cfg: Config) -> dict:
    """The part of ``cfg`` a checkpoint records and a resume must match."""
    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in _RUN_KEYS}


def check_resume_config(saved: dict, cfg: Config, where: str) -> None:
    """Refuse a resume whose run config differs from the saved one (a key the save lacks takes its default)."""
    now = run_config(cfg)
    defaults = run_config(Config())
    diff = {k: (saved.get(k, defaults[k]), now[k]) for k in _RUN_KEYS if saved.get(k, defaults[k]) != now[k]}
    if diff:
        listed = ", ".join(f"{_flag(k)}: saved {a!r}, given {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"models.train: --resume from {where!r} with a different run config ({listed}); resume with the "
            "saved values, or start a new run in another --out."
        )


def resume_config(saved: dict, cfg: Config, given: frozenset[str] | set[str], where: str,
                  flags: dict | None = None) -> Config:
    """The config of a ``--resume`` from the command line: the run's saved values for the flags left out, the
    command line's for the rest; a run flag ``given`` whose value differs from the saved one is refused, naming
    both. A key the save lacks takes its default. ``flags``: the saved ``job_flags`` (``--mesh``,
    ``--save-every``, ...), taken when left out and free to change when given."""
    defaults = run_config(Config())
    was = {k: saved.get(k, defaults[k]) for k in _RUN_KEYS}
    diff = {k: (was[k], getattr(cfg, k)) for k in _RUN_KEYS if k in given and was[k] != getattr(cfg, k)}
    if diff:
        listed = ", ".join(f"{_flag(k)} {b!r} where the run was saved with {_flag(k)} {a!r}"
                           for k, (a, b) in diff.items())
        raise ValueError(
            f"models.train: --resume continues the run in {where!r} with its saved flags, but the command line gives "
            f"{listed}; leave {' and '.join(_flag(k) for k in diff)} out to continue that run, or start a new run "
            "in another --out."
        )
    dims = {} if cfg.mesh == AUTO else dict(parse_mesh(cfg.mesh) or ())

    def dropped(k: str) -> bool:  # a saved layout flag the given --mesh cannot take (or its --devices)
        return "mesh" in given and (k == "devices" or k in _MESH_KEYS and _MESH_KEYS[k] not in dims
                                    or k in _NOT_WITH_KEYS and (cfg.mesh == AUTO or _NOT_WITH_KEYS[k] in dims))

    job = {k: v for k, v in (flags or {}).items() if k in _JOB_KEYS and k not in given and not dropped(k)}
    return dataclasses.replace(cfg, **{k: was[k] for k in _RUN_KEYS if k not in given}, **job)
