"""A layout as data (``Layout``) and applying it through the contract (``apply_layout``).

A ``Layout`` names the mesh (``pp`` x ``dp`` x ``fsdp`` x ``tp`` devices), the FSDP options (the units,
``reshard_after_forward``), the tensor-parallel plan (with or without sequence parallelism, or
weight-stationary), the pipeline (``pp > 1``: the schedule, its micro-batches and chunks per rank; the
stages are the repeated blocks ``units[0]``, and FSDP under a pipeline keeps a rank's stages gathered
through the schedule, ``reshard_after_forward=False``), the activation-checkpointing policy of the blocks
``units`` (``activation_checkpointing``: one of ``POLICIES``, named ``ac=``; not under a pipeline,
whose backward pass recomputes its stages already), the gradient-accumulation steps and the mixed precision
(``mixed_precision="bfloat16"``, named ``mp=bf16``: ``fully_shard``'s ``MixedPrecisionPolicy`` gathering and
computing in it, gradients reduced in float32, the state float32; FSDP layouts only).

``weight_stationary=True`` (named ``ws``): the ``tp`` devices form a data axis whose weights never move
(``spmd.parallel.styles._weight_stationary``): each styled kernel stays cut over ``tp``, the activations between
the layers are cut on the batch, and each layer all-gathers its input over the batch and reduce-scatters
its output back, so ``dp=1,tp=8 ws`` is what GSPMD runs on 8 devices at a few sequences per device (its
``tp_plan`` is ``weight_stationary_plan`` of the sequence-parallel plan). The batch then splits over
``dp x fsdp x tp``. ``apply_layout(model, devices, layout)`` builds it the way a user would:
``init_device_mesh`` / ``parallelize_module(model, mesh["tp"], plan)`` /
``fully_shard(model, mesh=mesh["dp", "fsdp"], units=...)`` / ``pipeline(model, mesh["pp"], units=units[0],
num_microbatches=, schedule=, stages_per_rank=)`` / ``activation_checkpointing(model, units=, policy=)``,
and returns ``(model, mesh)``; then ``init_train_state(model, optimizer, ..., mesh=mesh)`` and
``make_train_step(model, loss_fn, optimizer, accum_steps=layout.accum_steps, mesh=mesh)`` (``mesh=`` is what a
model with neither transform, DDP, needs; the others accept it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spmd._mesh import DeviceMesh
from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.pipelining._pipeline import pipeline
from spmd.parallel.styles._remat import POLICIES
from spmd.parallel.styles._transforms import activation_checkpointing
from spmd.parallel.pipelining._schedules import CHUNKED, SCHEDULES
from spmd.parallel.styles._transforms import MixedPrecisionPolicy, fully_shard, param_module, parallelize_module
from spmd.parallel.styles._weight_stationary import _activation_cuts as _cuts
from spmd.parallel.styles._weight_stationary import is_batch_cut, weight_stationary_plan

__all__ = ["Layout", "apply_layout", "layout_mesh", "infer_units", "devices_of", "tp_plan_for", "factorizations"]


@dataclass(frozen=True)
class Layout:
    """One candidate layout (see the module doc). ``tp_plan``: the ``parallelize_module`` plan as
    ``(fqn glob, style)`` pairs, present when ``tp > 1`` (with ``weight_stationary``: one cutting the
    activations on the batch, ``weight_stationary_plan(sequence_parallel_plan)``)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    accum_steps: int = 1
    units: tuple[str, ...] = ()
    tp_plan: tuple | None = None
    weight_stationary: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    activation_checkpointing: str | None = None
    mixed_precision: str | None = None
    cp: int = 1
    ep: int = 1
    ep_plan: tuple | None = None
    note: str | None = field(default=None, compare=False)  # what the candidate's maker chose not to cut, and why

    def __post_init__(self):
        for arg in ("dp", "fsdp", "tp", "accum_steps", "pp", "microbatches", "stages_per_rank", "cp", "ep"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout: {arg}={v!r} must be an int >= 1.")
        if self.tp > 1 and not self.tp_plan:
            raise ValueError(f"Layout: tp={self.tp} needs tp_plan=, the parallelize_module plan of the model "
                             "(e.g. tuple({'layers_*.mlp.up_proj': ColwiseParallel(), ...}.items())).")
        if not isinstance(self.weight_stationary, bool):
            raise TypeError(f"Layout: weight_stationary={self.weight_stationary!r} must be a bool.")
        if self.weight_stationary and (self.tp < 2 or self.sequence_parallel):
            raise ValueError(f"Layout: weight_stationary=True with tp={self.tp}, sequence_parallel="
                             f"{self.sequence_parallel}: the weight-stationary layout cuts the weights over tp >= 2 "
                             "devices and the activations on the batch (not the sequence); give tp >= 2 and "
                             "sequence_parallel=False.")
        if self.weight_stationary and not is_batch_cut(self.tp_plan):
            raise ValueError("Layout: weight_stationary=True needs a tp_plan that cuts the activations on the batch "
                             "(dim 0) between the layers; this one does not: give "
                             "tuple(weight_stationary_plan(sequence_parallel_plan).items()).")
        if self.fsdp > 1 and not isinstance(self.units, tuple):
            raise TypeError(f"Layout: units={self.units!r} must be a tuple of module fqn globs.")
        if self.ep > 1 and not self.ep_plan:
            raise ValueError(f"Layout: ep={self.ep} needs ep_plan=, the parallelize_module plan of the experts "
                             "(e.g. (('layers_*.mlp.experts', ExpertParallel()),)).")
        if self.pp > 1:
            self._check_pipeline()
        if self.activation_checkpointing is not None:
            self._check_checkpointing()
        if self.mixed_precision is not None:
            self._check_mixed_precision()

    def _check_mixed_precision(self) -> None:
        mp = self.mixed_precision
        try:
            ok = isinstance(mp, str) and jnp.issubdtype(jnp.dtype(mp), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"Layout: mixed_precision={mp!r} must be a floating dtype's name ('bfloat16') or None.")
        if self.fsdp < 2:
            raise ValueError(f"Layout: mixed_precision={mp!r} with fsdp={self.fsdp}: the compute dtype is "
                             "fully_shard's MixedPrecisionPolicy (its units gather and compute in it); give fsdp >= 2.")

    def _check_pipeline(self) -> None:
        if not (isinstance(self.units, tuple) and len(self.units) == 1 and isinstance(self.units[0], str)):
            raise ValueError(f"Layout: pp={self.pp} with units={self.units!r}: the pipeline's stages are one glob of "
                             "repeated blocks; give units=('layers_*',) (infer_units(params) finds it).")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout: schedule={self.schedule!r} is not offered; use one of {', '.join(SCHEDULES)}.")
        if self.stages_per_rank > 1 and self.schedule not in CHUNKED:
            raise ValueError(f"Layout: stages_per_rank={self.stages_per_rank} needs schedule 'interleaved' or "
                             f"'looped_bfs' (got {self.schedule!r}).")
        if self.weight_stationary or self.reshard_after_forward and self.fsdp > 1:
            raise ValueError(f"Layout: pp={self.pp} with weight_stationary={self.weight_stationary}, "
                             f"reshard_after_forward={self.reshard_after_forward}: a pipeline keeps its stages "
                             "gathered through the schedule and cuts the activations on no batch; give "
                             "reshard_after_forward=False and weight_stationary=False.")

    def _check_checkpointing(self) -> None:
        ac = self.activation_checkpointing
        if ac not in POLICIES:
            raise ValueError(f"Layout: activation_checkpointing={ac!r} is not a policy; use None or one of "
                             + ", ".join(repr(p) for p in POLICIES) + ".")
        if self.pp > 1:
            raise ValueError(f"Layout: pp={self.pp} with activation_checkpointing={ac!r}: a pipeline's backward "
                             "pass already recomputes each stage from its stashed input; give "
                             "activation_checkpointing=None.")
        if not (isinstance(self.units, tuple) and self.units and all(isinstance(u, str) for u in self.units)):
            raise ValueError(f"Layout: activation_checkpointing={ac!r} with units={self.units!r}: name the modules "
                             "to recompute, e.g. units=('layers_*',) (infer_units(params) finds the repeated blocks).")

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.ep * self.cp * self.tp

    @property
    def n_data(self) -> int:
        """The ways the batch's rows are split: ``dp x fsdp x ep`` (ep's ranks take their own rows)."""
        return self.dp * self.fsdp * self.ep

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's ``(name, size)`` dims: those above 1 (``pp, dp, fsdp, ep, cp, tp``, row-major), ``dp`` kept
        when it is the only data dim."""
        dims = [(n, s) for n, s in (("pp", self.pp), ("dp", self.dp), ("fsdp", self.fsdp), ("ep", self.ep),
                                    ("cp", self.cp), ("tp", self.tp)) if s > 1]
        if not any(n in ("dp", "fsdp", "ep") for n, _ in dims):
            dims.insert(1 if self.pp > 1 else 0, ("dp", self.dp))
        return tuple(dims)

    @property
    def name(self) -> str:
        """``"dp=2,fsdp=4 regather"``, ``"fsdp=2,tp=4 sp keep"``, ``"dp=1,tp=8 ws"``, ``"dp=8 accum=2"``,
        ``"pp=2,dp=4 1f1b M=8"``, ``"pp=4,dp=2 interleaved v=2 M=8"``, ``"fsdp=8 keep ac=full"``."""
        mesh = ",".join(f"{n}={s}" for n, s in self.mesh_dims if not (self.pp > 1 and n == "dp" and s == 1))
        parts = [mesh]
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else "")
                         + f" M={self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.weight_stationary:
            parts.append("ws")
        if self.fsdp > 1 and self.pp == 1:
            parts.append("regather" if self.reshard_after_forward else "keep")
        if self.activation_checkpointing:
            parts.append(f"ac={self.activation_checkpointing}")
        if self.mixed_precision:
            parts.append("mp=" + {"bfloat16": "bf16", "float16": "fp16"}.get(self.mixed_precision,
                                                                            self.mixed_precision))
        if self.accum_steps > 1:
            parts.append(f"accum={self.accum_steps}")
        return " ".join(parts)

    def __str__(self) -> str:
        return self.name


def factorizations(n: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, fsdp, tp)`` whose product is ``n``."""
    return [(n // (tp * fsdp), fsdp, tp) for tp in range(1, n + 1) for fsdp in range(1, n // tp + 1)
            if n % (tp * fsdp) == 0]


def devices_of(mesh_or_devices: Any, where: str) -> list:
    """The devices a layout runs on: ``None`` (every device), an int (the first n), a mesh shape tuple
    (the first ``prod``), a sequence of devices, or a ``DeviceMesh`` / ``jax.sharding.Mesh``."""
    if mesh_or_devices is None:
        return list(jax.devices())
    if isinstance(mesh_or_devices, DeviceMesh):
        return list(mesh_or_devices.jax_mesh.devices.ravel())
    if isinstance(mesh_or_devices, jax.sharding.Mesh):
        return list(mesh_or_devices.devices.ravel())
    if (isinstance(mesh_or_devices, int) and not isinstance(mesh_or_devices, bool)) or (
            isinstance(mesh_or_devices, tuple) and mesh_or_devices and all(isinstance(s, int) for s in mesh_or_devices)):
        n = mesh_or_devices if isinstance(mesh_or_devices, int) else math.prod(mesh_or_devices)
        have = jax.devices()
        if n < 1 or n > len(have):
            raise ValueError(f"{where}: mesh_shape_or_devices={mesh_or_devices!r} asks for {n} devices but "
                             f"{len(have)} exist; give at most {len(have)}.")
        return list(have[:n])
    if isinstance(mesh_or_devices, (list, tuple)) and mesh_or_devices and all(
            isinstance(d, jax.Device) for d in mesh_or_devices):
        return list(mesh_or_devices)
    raise TypeError(f"{where}: mesh_shape_or_devices={mesh_or_devices!r} must be a device count (8), a mesh shape "
                    "((2, 4): its product), a list of jax devices or a DeviceMesh.")


def layout_mesh(devices: Sequence, layout: Layout, where: str = "apply_layout") -> DeviceMesh:
    """The ``DeviceMesh`` of ``layout`` over ``devices`` (row-major), named ``pp`` / ``dp`` / ``fsdp`` / ``ep`` /
    ``cp`` / ``tp``."""
    if len(devices) != layout.size:
        raise ValueError(f"{where}: layout {layout.name!r} needs pp x dp x fsdp x ep x cp x tp = {layout.size} "
                         f"devices, but "
                         f"{len(devices)} were given; give {layout.size} devices or a layout for {len(devices)}.")
    names, shape = zip(*layout.mesh_dims)
    return DeviceMesh.from_jax(jax.sharding.Mesh(np.array(devices).reshape(shape), names))


def apply_layout(model: Any, mesh_or_devices: Any, layout: Layout) -> tuple[Any, DeviceMesh]:
    """``(the model laid out by layout, its mesh)`` through the contract (see the module doc)."""
    where = "apply_layout"
    if not isinstance(layout, Layout):
        raise TypeError(f"{where}: layout={layout!r} must be a Layout (auto_layout(...).best.layout).")
    mesh = layout_mesh(devices_of(mesh_or_devices, where), layout, where)
    out = model
    if layout.ep > 1:  # the experts cut over ep first, as models.train lays them out (ExpertParallel)
        out = parallelize_module(out, mesh["ep"], dict(layout.ep_plan))
    if layout.tp > 1:
        out = parallelize_module(out, mesh["tp"], dict(layout.tp_plan))
    if layout.fsdp > 1:
        sub = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        mp = None if layout.mixed_precision is None else MixedPrecisionPolicy(
            param_dtype=jnp.dtype(layout.mixed_precision), reduce_dtype=jnp.float32)  # torch's and torchtitan's: reduce in f32
        out = fully_shard(out, mesh=sub, units=list(layout.units), reshard_after_forward=layout.reshard_after_forward,
                          mp_policy=mp)
    if layout.pp > 1:
        out = pipeline(out, mesh["pp"], units=layout.units[0], num_microbatches=layout.microbatches,
                       schedule=layout.schedule, stages_per_rank=layout.stages_per_rank)
    if layout.activation_checkpointing:
        out = activation_checkpointing(out, units=list(layout.units), policy=layout.activation_checkpointing)
    return out, mesh


def infer_units(params: Any) -> tuple[str, ...]:
    """``fully_shard`` units of a model nobody told us about: its repeated blocks, the first module level
    whose names end in an index (``layers_0``, ``block_3``, ``transformer.h.0``, ``model.layers.1``) -> one
    glob with ``*`` for the index (``layers_*``); ``()`` (the whole model one unit) when none repeats."""
    modules = {param_module(path_str(kp))[0] for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    best: dict[str, set] = {}
    for m in modules:
        comps = m.split(".") if m else []
        for i, c in enumerate(comps):
            hit = re.fullmatch(r"(.*?_?)(\d+)", c)
            if hit:
                glob = ".".join(comps[:i] + [hit[1] + "*"])
                best.setdefault(glob, set()).add(c)
                break
    globs = [g for g, members in best.items() if len(members) >= 2]
    if not globs:
        return ()
    depth = min(g.count(".") for g in globs)
    return tuple(sorted(g for g in globs if g.count(".") == depth))


def tp_plan_for(plan: Any, sequence_parallel: bool, tp: int, where: str = "auto_layout", *,
                weight_stationary: bool = False) -> tuple | None:
    """The ``(glob, style)`` pairs of the tensor-parallel plan for ``tp`` devices, or None where ``plan``
    has none (a dict is a plan without sequence parallelism; a callable ``plan(sequence_parallel=,
    tp_size=)`` returns a dict or None). ``weight_stationary``: ``weight_stationary_plan`` of the
    sequence-parallel plan (None where there is none, or it cuts nothing on the sequence)."""
    if weight_stationary:
        got = tp_plan_for(plan, True, tp, where)
        if got is None or not any(d == 1 for _, s in got for d in _cuts(s)):
            return None
        return tuple(weight_stationary_plan(dict(got)).items())
    if plan is None:
        return None
    if isinstance(plan, Mapping):
        got = None if sequence_parallel else plan
    elif callable(plan):
        got = plan(sequence_parallel=sequence_parallel, tp_size=tp)
    else:
        raise TypeError(f"{where}: plan={plan!r} must be a parallelize_module plan (dict of fqn glob -> style) or "
                        "a callable plan(sequence_parallel=, tp_size=) -> dict or None.")
    if got is None:
        return None
    if not isinstance(got, Mapping) or not got:
        raise TypeError(f"{where}: plan(sequence_parallel={sequence_parallel}, tp_size={tp}) returned {got!r}; "
                        "return a dict of module fqn glob -> style, or None where it has no plan.")
    return tuple(got.items())
