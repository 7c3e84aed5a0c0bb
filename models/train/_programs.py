"""What a run computes with: the mesh, the task, the model, the loss, the optimizer, the batch layout and
the jitted programs (init, train step, eval step), built once per (config, mesh).

Every ``--mesh`` layout goes through ``spmd.parallel``'s contract: the plain model laid out by
``models._plans.layout_model`` (``parallelize_module`` for ``tp``, ``fully_shard`` for ``fsdp``, neither for
``dp``: DDP), then, with a ``pp`` dim, ``pipeline`` over the blocks (``--schedule``, ``--microbatches``), or
with ``--activation-checkpointing``, ``activation_checkpointing`` on the model's repeated blocks (its
``fully_shard`` units, ``models._plans.shard_units``: the units ``--mesh auto`` gives its layouts),
``init_train_state``, and one ``make_train_step`` on the job's plain 1-device loss (``make_loss_fn``), donating
the state (``donate=True``: the step updates it in place, as torch's optimizer does).

The batch layout is stated once: ``Programs.batch_placements`` (``Shard(0)`` over every data-parallel mesh
dim of ``DATA_DIMS``, ``Replicate`` on the others). ``place_batch`` lays a host batch out by it as DTensors,
which the train step and the eval step take as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from models._data import DigitTask, TextTask
from models._ddp import batch_placements
from models._llama import Llama, LlamaConfig
from models._mlp import MLP
from models._moe import MoE, MoEConfig
from models._fsdp_run import checkpoint_state, logical_params
from models._plans import layout_model, shard_units
from models._transformer import Transformer
from models.train._config import DATA_DIMS, STATE_DIMS, Config, parse_mesh, pipeline_settings
from models.train._eval import make_eval_step
from spmd import DeviceMesh, distribute_tensor, init_device_mesh
from spmd.parallel import (ParallelModule, PipelineModule, activation_checkpointing, init_train_state, make_train_step,
                           pipeline, unshard_params)

__all__ = ["build_mesh", "data_dims", "check_fits", "device_memory", "make_task", "layout", "task_dims", "make_model", "cross_entropy",
           "make_loss_fn",
           "make_optimizer", "Programs", "programs", "place_batch"]


def build_mesh(spec: str | None, devices: int | None = None) -> DeviceMesh:
    """The job's mesh: ``--mesh dp=2,fsdp=4`` (dims in that order) or every device on ``dp``.

    The mesh uses every visible device, or exactly ``devices`` (``--devices``) of them: a mesh of fewer devices
    than that is refused, naming both counts, rather than training on part of the machine unsaid."""
    n_dev = jax.device_count()
    platform = jax.devices()[0].platform
    if devices is not None and devices > n_dev:
        raise ValueError(f"models.train: --devices={devices} but only {n_dev} {platform} device(s) are visible; use "
                         f"--devices N with N <= {n_dev}, or leave --devices out to use them all.")
    n_use = n_dev if devices is None else devices
    dims = parse_mesh(spec) or (("dp", n_use),)
    need = math.prod(n for _, n in dims)
    if need > n_dev:
        hint = f", or set XLA_FLAGS=--xla_force_host_platform_device_count={need} before starting" if platform == "cpu" else ""
        fix = (f"--mesh {dims[0][0]}=N with N <= {n_dev}" if len(dims) == 1 else
               f"--mesh sizes whose product is <= {n_dev}")
        raise ValueError(
            f"models.train: --mesh={spec!r} needs {need} devices but only {n_dev} {platform} device(s) are "
            f"visible; use {fix}{hint}."
        )
    if need != n_use:
        whole = (",".join(f"{k}={v * (n_use // need) if i == 0 else v}" for i, (k, v) in enumerate(dims))
                 if n_use % need == 0 else None)
        of = (f"--devices={devices}" if devices is not None else f"{n_dev} {platform} device(s) are visible")
        raise ValueError(
            f"models.train: --mesh={spec!r} uses {need} devices but {of}; give a mesh of {n_use} devices"
            + (f" (e.g. --mesh {whole})" if whole else "")
            + (f", or --devices {need} to train on {need} of them." if devices is None else f", or --devices {need}.")
        )
    return init_device_mesh(platform, tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))


def data_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh dims the batch is split over."""
    return tuple(n for n in mesh.mesh_dim_names if n in DATA_DIMS)


def device_memory(mesh: DeviceMesh) -> int | None:
    """Bytes one of this process's devices in ``mesh`` can hold: the accelerator's limit, or the host's memory
    shared by this process's CPU devices in the mesh; None if JAX does not say."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    stats = local[0].memory_stats() if hasattr(local[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if local[0].platform == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(local)
    return None


def _step_floor_bytes(cfg: Config, n_data: int, n_state: int) -> int:
    """A lower bound on one device's memory for a train step: the parameters, their gradients and AdamW's
    two moments (4 copies, split ``n_state`` ways when the state is sharded, plus the largest parameter and
    its gradient whole; shapes from an abstract init, nothing allocated), the float32 logits of the
    device's micro-batch and, for the transformer, the attention scores every layer keeps for the backward
    pass (batch x heads x T x T; ``--activation-checkpointing full``: one layer's, recomputed in turn, where
    ``dots`` keeps every layer's, a matmul's output)."""
    vocab, seq_len, out_len = task_dims(cfg)
    shapes = jax.eval_shape(make_model(cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, seq_len), jnp.int32))
    micro = max(1, cfg.batch_size // (n_data * cfg.accum_steps))
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)]
    floor = 4 * sum(sizes) // n_state
    if n_state > 1:  # a sharded parameter is gathered whole to be used, and its gradient is whole before it is reduced
        floor += 2 * max(sizes)
    floor += micro * out_len * vocab * 4
    if cfg.model == "transformer":
        kept = 1 if cfg.activation_checkpointing == "full" else cfg.layers
        floor += kept * micro * cfg.heads * seq_len * seq_len * 4
    return floor


def check_fits(cfg: Config, mesh: DeviceMesh, memory: int | None) -> None:
    """Refuse a run whose train step cannot fit in ``memory`` bytes per device (before anything is compiled)."""
    n_data = math.prod(mesh.size(d) for d in data_dims(mesh))
    need = _step_floor_bytes(cfg, n_data, math.prod(mesh.size(d) for d in mesh.mesh_dim_names if d in STATE_DIMS))
    if memory is None or need <= memory:
        return
    _, seq_len, _ = task_dims(cfg)
    size = f"--seq-len={seq_len}"
    gib = 2**30
    recompute = (cfg.model == "transformer" and cfg.activation_checkpointing != "full"
                 and "pp" not in mesh.mesh_dim_names)
    raise ValueError(
        f"models.train: {size} (tokens per example) needs at least {need / gib:,.1f} GiB per device for "
        f"one train step (parameters, gradients, optimizer state and the logits"
        f"{' and attention scores' if cfg.model == 'transformer' else ''} of "
        f"{cfg.batch_size // (n_data * cfg.accum_steps)} examples per device), more than the {memory / gib:,.1f} "
        f"GiB a device has; use a smaller {size.split('=')[0]}, --batch-size"
        f"{', --layers or --d-model' if cfg.model == 'transformer' else ' or --hidden'}, or more --accum-steps"
        f"{' (or --activation-checkpointing full)' if recompute else ''}."
    )


def make_task(cfg: Config):
    return TextTask(cfg.text, cfg.context) if cfg.text is not None else DigitTask(cfg.task, cfg.length)


def layout(cfg: Config) -> str:
    """The data layout the model reads (``_data.LAYOUTS``)."""
    return "window" if cfg.model == "mlp" else "lm"


def task_dims(cfg: Config) -> tuple[int, int, int]:
    """(vocab size, input positions, target positions) of the task, without reading any file."""
    lay = layout(cfg)
    if cfg.text is not None:  # TextTask's dims, without opening cfg.text
        return 256, cfg.context, (cfg.context if lay == "lm" else 1)
    task = make_task(cfg)
    return task.vocab_size, task.seq_len(lay), task.out_len(lay)


def make_model(cfg: Config):
    vocab, seq_len, out_len = task_dims(cfg)
    if cfg.model == "mlp":
        return MLP(vocab, out_len, (cfg.hidden, cfg.hidden))
    if cfg.model in ("llama", "moe"):  # attention through jax.nn.dot_product_attention; all heads their own KV
        sizes = dict(vocab_size=vocab, hidden_size=cfg.d_model, intermediate_size=4 * cfg.d_model,
                     num_layers=cfg.layers, num_heads=cfg.heads, num_kv_heads=cfg.heads, attn_implementation="sdpa",
                     scan_layers=cfg.scan_layers)
        return Llama(LlamaConfig(**sizes)) if cfg.model == "llama" else MoE(MoEConfig(**sizes,
                                                                                     moe_every=cfg.moe_every))
    return Transformer(vocab, seq_len, cfg.layers, cfg.d_model, cfg.heads)


def cross_entropy(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    """Masked mean next-token loss and accuracy (every example has the same number of targets)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch["mask"]
    total = jnp.sum(mask)
    acc = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * mask) / total
    return jnp.sum(nll * mask) / total, {"accuracy": acc}


def make_loss_fn(model: Any) -> Callable:
    """The job's loss as a user writes it on one device: ``loss_fn(params, batch) -> (loss, {"accuracy"})``."""

    def loss_fn(params: Any, batch: dict):
        return cross_entropy(model.apply({"params": params}, batch["inputs"]), batch)

    return loss_fn


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW (``--weight-decay``) on a warmup-cosine schedule from 0 to ``--lr`` down to ``lr * --lr-floor``,
    after clipping the gradient to ``--clip-norm``."""
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  cfg.lr * cfg.lr_floor)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), optax.adamw(schedule, weight_decay=cfg.weight_decay))


@dataclass(frozen=True)
class Programs:
    """The jitted programs of a run on one mesh, and the layouts they agree on."""

    model: Any  # the plain model (what evaluation applies)
    optimizer: optax.GradientTransformation
    batch_placements: tuple  # the batch's placements on the mesh (the one statement of the data layout)
    state_sharding: Any  # the train state's sharding (a pytree of NamedSharding like the state)
    init: Callable  # (key, sample inputs) -> the step-0 TrainState, laid out by the plan
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> {"token_accuracy", "sequence_accuracy"}
    plan: Any = None  # the state's spmd.parallel.ParamPlan (every layout has one; DDP: all Replicate)
    layout: Any = None  # the model as laid out (spmd.parallel.ParallelModule / PipelineModule, or the plain model)
    logical: Callable | None = None  # the state's params -> the model's parameter tree (pipeline: unstacked)
    checkpoint: Callable | None = None  # the state -> what a checkpoint holds (pipeline: the model's own tree)
    checkpoint_plan: Any = None  # the plan of what a checkpoint holds (its meta's "layout")

    @property
    def pipelined(self) -> bool:
        return isinstance(self.layout, PipelineModule)


def program_key(cfg: Config) -> Config:
    """The config with only what decides the compiled programs (not the seed, the file or the paths)."""
    return dataclasses.replace(cfg, mesh=None, text=None if cfg.text is None else "", out="", resume=False,
                               overwrite=False, save_every=1, seed=0, log_every=1, eval_size=None, progress=False,
                               memory_budget=None, hardware=None, devices=None)


def programs(cfg: Config, mesh: DeviceMesh) -> Programs:
    """The programs of ``cfg`` on ``mesh`` (shared by runs in one process that compile the same ones)."""
    return _programs(program_key(cfg), mesh)


@functools.lru_cache(maxsize=8)
def _programs(key: Config, mesh: DeviceMesh) -> Programs:
    model = make_model(key)
    optimizer = make_optimizer(key)
    dims = data_dims(mesh)
    placements = tuple(batch_placements(mesh, dims))
    eval_step = make_eval_step(model, mesh, dims, digits=key.length if key.text is None and key.model == "transformer"
                               else None)
    spec = ",".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape))
    pipe = pipeline_settings(dataclasses.replace(key, mesh=spec))  # (schedule, M, v) with a pp dim, else None
    laid = layout_model(model, mesh, sequence_parallel=key.sequence_parallel, weight_stationary=key.weight_stationary,
                        reshard_after_forward=key.reshard_after_forward)
    if pipe is not None:
        schedule, m, v = pipe
        laid = pipeline(laid, mesh["pp"], units=shard_units(model)[0], num_microbatches=m,
                        schedule=schedule, stages_per_rank=v)
    if key.activation_checkpointing is not None:  # never with pp (check_config)
        laid = activation_checkpointing(laid, units=shard_units(model), policy=key.activation_checkpointing)
    # DDP: the model has no layout (at most activation checkpointing, which has no mesh), the step a mesh
    laid_out = isinstance(laid, PipelineModule) or isinstance(laid, ParallelModule) and laid.mesh is not None
    plain = None if laid_out else mesh

    def init(rng, x):
        return init_train_state(laid, optimizer, rng, x, mesh=plain)

    # donate: the step writes the new state into the old one's buffers (torch's in-place update; what
    # auto_layout's plan counts), the loop never reading a state it has passed to the step (train_loop). The
    # job's check_finite is "skip" or off, never True (which donation refuses: it hands the old state back).
    train_step = make_train_step(laid, make_loss_fn(model), optimizer, accum_steps=key.accum_steps, mesh=plain,
                                 check_finite="skip" if key.skip_nonfinite else False, donate=True)
    abstract = jax.eval_shape(init, jax.random.key(0), jax.ShapeDtypeStruct((2, task_dims(key)[1]), jnp.int32))
    sharding = jax.tree.map(lambda x: x.sharding, abstract)
    if pipe is not None:
        def logical(params):
            return unshard_params(laid, params)
    else:
        def logical(params):
            return logical_params(params, abstract.plan, mesh)

    def checkpoint(state):
        return checkpoint_state(state, laid, optimizer)

    saved_plan = jax.eval_shape(checkpoint, abstract).plan
    return Programs(model, optimizer, placements, sharding, init, train_step, eval_step, abstract.plan, laid, logical,
                    checkpoint, saved_plan)


def place_batch(batch: dict, mesh: DeviceMesh, placements) -> dict:
    """The host batch (the same on every process) as DTensors laid out by ``placements``; each process
    supplies only its own devices' blocks."""
    return {k: distribute_tensor(v, mesh, list(placements)) for k, v in batch.items()}
