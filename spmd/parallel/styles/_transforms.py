"""torch's module transforms: ``parallelize_module``, ``fully_shard`` and activation checkpointing, on any flax
model, unchanged.

Each returns a ``ParallelModule``: the user's model (every attribute and call forwards to it), the root
mesh its layouts run over, and the layouts as data: the tensor-parallel plan (``{fqn glob: style}`` on one
mesh dim), the FSDP spec (the shard and replicate dims, the units, ``reshard_after_forward``, the
mixed-precision policy) and the activation-checkpointing spec (the units, the policy). Each spec names the
style its modules run under (``TPSpec.style_for``; ``FSDPSpec.unit_style``: a ``FullyShardUnit``;
``RematSpec.style``: an ``ActivationCheckpoint``), and the hooks dispatch every one alike. Nothing runs
until ``init_train_state`` / ``make_train_step``; ``plan(params)`` gives the ``ParamPlan`` the layouts make
of the model's parameters, printable and costed.

Module paths are torch's fully qualified names, dot-joined, read off the parameter tree (linen's
``layers_0.self_attn.q_proj``, Hugging Face's ``transformer.h.0.mlp.c_fc``, nnx's ``layers.0.linear``);
a plan key or unit is such a name with ``*`` globs, each ``*`` within one name component.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from placements import Placement, Replicate, Shard
from spmd._mesh import DeviceMesh
from spmd.parallel.plan._checks import check_tp_plan, params_hint
from spmd.parallel.plan._param_plan import ROOT, ParamPlan, path_str, plan_params
from spmd.parallel.plan._rules import Rule
from spmd.parallel.styles._fully_shard import FullyShardUnit
from spmd.parallel.styles._remat import POLICIES, ActivationCheckpoint, offload_refusal
from spmd.parallel.styles._styles import ParallelStyle

__all__ = ["Wrapped", "ParallelModule", "MixedPrecisionPolicy", "parallelize_module", "fully_shard",
           "activation_checkpointing", "TPSpec", "FSDPSpec", "RematSpec", "param_module", "glob_regex", "CP_DIM",
           "EP_DIM"]

from spmd.parallel.styles._styles import CP_DIM  # noqa: E402  (the sequence's mesh dim; defined with the styles)
EP_DIM = "ep"  # the mesh dim of expert parallelism: a data dim whose styles cut experts (spmd.parallel.styles._experts)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch FSDP2's policy: gather and compute in ``param_dtype``, reduce gradients in ``reduce_dtype``.

    The state (float32 master weights, optimizer moments) stays in the parameters' own dtype on the shards.
    ``None`` keeps the parameters' dtype. ``cast_forward_inputs`` casts a unit's floating inputs to
    ``param_dtype`` (torch's default); ``output_dtype`` casts the model's floating outputs.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for arg in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, arg)
            if v is None:
                continue
            try:
                dt = np.dtype(v)
            except TypeError:
                raise TypeError(f"MixedPrecisionPolicy: {arg}={v!r} is not a dtype; use e.g. jnp.bfloat16.") from None
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"MixedPrecisionPolicy: {arg}={v!r} is not a floating dtype; parameters and gradients "
                                 "are floats: use jnp.bfloat16, jnp.float16 or jnp.float32.")
            object.__setattr__(self, arg, dt)
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy: cast_forward_inputs={self.cast_forward_inputs!r} must be a bool.")


@dataclass(frozen=True)
class TPSpec:
    """``parallelize_module``'s layout: ``(fqn glob, style)`` pairs on mesh dim ``mesh_dim``; a module matches at
    most one glob (``build_plan`` refuses two)."""

    mesh_dim: str
    plan: tuple[tuple[str, ParallelStyle], ...]

    def style_for(self, fqn: str) -> tuple[str, ParallelStyle] | None:
        for key, style in self.plan:
            if re.fullmatch(glob_regex(key, "."), fqn):
                return key, style
        return None


@dataclass(frozen=True)
class FSDPSpec:
    """``fully_shard``'s layout: parameters cut over ``shard_dim``, replicated over ``replicate_dims`` (HSDP)."""

    shard_dim: str
    replicate_dims: tuple[str, ...]
    units: tuple[str, ...]
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy | None

    @property
    def unit_style(self) -> FullyShardUnit:
        """The style every unit (and the root) runs under: its placements over ``shard_dim``, its gathers."""
        return FullyShardUnit(self.reshard_after_forward, self.mp_policy)


@dataclass(frozen=True)
class RematSpec:
    """``activation_checkpointing``'s layout: the units (module fqn globs) and the policy they run under."""

    units: tuple[str, ...]
    policy: str

    @property
    def style(self) -> ActivationCheckpoint:
        return ActivationCheckpoint(self.policy)

    def matches(self, fqn: str) -> bool:
        return any(re.fullmatch(glob_regex(u, "."), fqn) for u in self.units)


METHODS = ("attend",)  # module methods a plan key may style: "embed.attend", a tied output projection


def glob_regex(glob: str, sep: str) -> str:
    """``layers_*.mlp`` -> a regex over ``sep``-joined paths, each ``*`` within one component."""
    atoms = re.split(r"[./]", glob)
    return re.escape(sep).join(re.escape(a).replace(r"\*", f"[^{re.escape(sep)}]*") for a in atoms)


def param_module(path: str) -> tuple[str, str]:
    """``"layers_0/mlp/up_proj/kernel"`` -> ``("layers_0.mlp.up_proj", "kernel")`` (nnx's trailing ``value``
    dropped)."""
    comps = path.split("/")
    if len(comps) >= 2 and comps[-1] == "value":
        comps = comps[:-1]
    return ".".join(comps[:-1]), comps[-1]


def _mesh_of(mesh: Any, where: str, arg: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: {arg}={mesh!r} must be a spmd.DeviceMesh (e.g. mesh['tp'] of "
                        "init_device_mesh('cpu', (2, 2, 2), mesh_dim_names=('dp', 'fsdp', 'tp'))).")
    return mesh


class Wrapped:
    """A user's model wrapped with its layouts, immutable: attribute access and calls forward to ``module``."""

    _verb = "parallelizing"  # what the model's owner does before wrapping it (the immutability error says)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "module"), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; set {name!r} on the model before {self._verb} it.")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ParallelModule(Wrapped):
    """The user's model with its layouts (what ``parallelize_module`` / ``fully_shard`` return).

    Attribute access and calls forward to the model, so ``model.apply``, ``model.init`` and a Hugging Face
    model's ``model(input_ids, params=...)`` work as before; the layouts apply inside the train step.
    """

    def __init__(self, module: Any, mesh: DeviceMesh | None, tp: TPSpec | None = None, fsdp: FSDPSpec | None = None,
                 remat: Any = None, ep: TPSpec | None = None):  # mesh None: activation_checkpointing alone (DDP
        # over the step's mesh=); ep: the styles of parallelize_module on the ep dim (experts cut, tokens all-to-all)
        for name, value in (("module", module), ("mesh", mesh), ("tp", tp), ("fsdp", fsdp), ("remat", remat),
                            ("ep", ep)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_plans", {})  # treedef -> the plan init_train_state laid them out by
        object.__setattr__(self, "_params_seen", [])  # the model's parameter trees (path: shape, dtype) seen so far

    def __repr__(self) -> str:
        parts = [type(self.module).__name__]
        if self.tp:
            parts.append(f"tp on {self.tp.mesh_dim!r}: {len(self.tp.plan)} styles")
        if self.fsdp:
            parts.append(f"fsdp on {self.fsdp.shard_dim!r}" + (f", replicate on {self.fsdp.replicate_dims}"
                                                                if self.fsdp.replicate_dims else "")
                         + f", units {list(self.fsdp.units)}")
        if self.ep:
            parts.append(f"ep on {self.ep.mesh_dim!r}: {len(self.ep.plan)} styles")
        if self.remat:
            parts.append(f"activation checkpointing {list(self.remat.units)} ({self.remat.policy})")
        mesh = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape)) if self.mesh else "of make_train_step's mesh="
        return f"ParallelModule({'; '.join(parts)}; mesh {mesh})"

    # --- the layout as data -------------------------------------------------------------------
    @property
    def data_dims(self) -> tuple[str, ...]:
        """The mesh dims the batch is split over: every dim but the tensor-parallel one and ``cp`` (which cuts the
        sequence, in global view as tp does), in mesh order."""
        tp = self.tp.mesh_dim if self.tp else None
        return tuple(n for n in self.mesh.mesh_dim_names if n not in (tp, CP_DIM))

    @property
    def cp(self) -> str | None:
        """The mesh dim cutting the batch's sequence (``"cp"``), or None."""
        return CP_DIM if CP_DIM in self.mesh.mesh_dim_names else None

    def plan(self, params: Any, *example_inputs: Any) -> ParamPlan:
        """The ``ParamPlan`` of ``params`` (arrays or shapes) under these layouts; ``example_inputs``: what
        the model is applied to, for a model whose blocks run under ``nn.scan`` (their stacked axis)."""
        if self.mesh is None:
            raise TypeError("ParallelModule.plan: the model has no mesh (activation_checkpointing alone); the "
                            "step's mesh= lays it out: init_train_state(model, optimizer, mesh=mesh, params=params)"
                            ".plan.")
        return build_plan(self, params, stacked_of(self.module, params, example_inputs),
                          out_cut_of(self, params, example_inputs))


def stacked_of(module: Any, params: Any, example_inputs: Sequence[Any], batch_stats: Any = None) -> dict | None:
    """The parameters a linen ``module`` applied to ``example_inputs`` sees stacked by ``nn.scan`` (none given:
    ``None``), or an nnx ``module`` called on them by ``nnx.scan``; ``batch_stats``: the model's statistics
    collection, updated in the trace."""
    from spmd.parallel.styles._nnx import is_nnx, nnx_trace_seen
    from spmd.parallel.plan._scan import find_stacked, trace_seen

    if not example_inputs:
        return None
    if is_nnx(module):
        return find_stacked(nnx_trace_seen(module, params, lambda m, xs: m(*xs), tuple(example_inputs)), params)
    if _is_hf(module):  # a Hugging Face Flax model: its linen module called with params=
        return find_stacked(trace_seen(lambda p: module(*example_inputs, params=p), params)[1], params)
    if batch_stats is None:
        return find_stacked(trace_seen(lambda p: module.apply({"params": p}, *example_inputs), params)[1], params)
    return find_stacked(trace_seen(lambda p: module.apply({"params": p, "batch_stats": batch_stats}, *example_inputs,
                                                          mutable=["batch_stats"]), params)[1], params)


def _is_hf(module: Any) -> bool:
    import flax.linen as nn

    return not isinstance(module, nn.Module) and isinstance(getattr(module, "module", None), nn.Module)


def out_cut_of(model: Any, params: Any, example_inputs: Sequence[Any], batch_stats: Any = None) -> tuple | None:
    """Under ``fully_shard``: the kernels (2-D, or stacked by a scan) to cut on their output dim, read off the
    backward pass of the model applied to ``example_inputs`` (``spmd.parallel.step._grad_layout.output_cut``,
    an abstract trace); None where not read (no fsdp, no inputs, a linen model with ``batch_stats``). An nnx
    model is called on them as a merged copy with ``params`` (its own ``nnx.BatchStat`` values updated there)."""
    from spmd.parallel.styles._nnx import is_nnx
    # imports nothing of the library (see _unwrap's note on the protocol module)
    from spmd.parallel.step._grad_layout import output_cut

    module = model.module if isinstance(model, ParallelModule) else model
    if not isinstance(model, ParallelModule) or model.fsdp is None or not example_inputs:
        return None
    if is_nnx(module):
        from flax import nnx

        graphdef, _, rest = nnx.split(module, nnx.Param, ...)
        forward = lambda p: nnx.merge(graphdef, p, rest, copy=True)(*example_inputs)  # noqa: E731
    elif _is_hf(module):
        forward = lambda p: module(*example_inputs, params=p)  # noqa: E731
    elif batch_stats is None and hasattr(module, "apply"):
        forward = lambda p: module.apply({"params": p}, *example_inputs)  # noqa: E731
    else:
        return None
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return output_cut(forward, params, paths)


def ep_of(module: Any) -> TPSpec | None:
    """The plan on the ep dim of a ``ParallelModule`` (None for any other model)."""
    return module.ep if isinstance(module, ParallelModule) else None


def _unwrap(module: Any, where: str) -> tuple[Any, DeviceMesh | None, TPSpec | None, FSDPSpec | None, Any]:
    if isinstance(module, ParallelModule):
        return module.module, module.mesh, module.tp, module.fsdp, module.remat
    # a layout with a step of its own (a pipeline). The protocol's module imports nothing of the library, so
    # importing it here (the step's package is built on this one) adds no cycle; at call time it is loaded.
    from spmd.parallel.step._protocol import OwnsTrainStep

    if isinstance(module, OwnsTrainStep):
        raise ValueError(f"{where}: model={module!r} owns its train step (an OwnsTrainStep, as a pipelined model "
                         f"is); apply {where} to the plain model first, then lay that out, e.g. pipeline it: "
                         f"pipeline({where}(model, ...), mesh['pp'], ...).")
    return module, None, None, None, None


def _same_root(have: DeviceMesh | None, mesh: DeviceMesh, where: str, arg: str) -> DeviceMesh:
    root = mesh.root_mesh
    if have is not None and have != root:
        raise ValueError(
            f"{where}: {arg}={mesh!r} is cut from the mesh {root!r}, but the model was already laid out on {have!r}; "
            "cut every sub-mesh from one mesh: mesh = init_device_mesh(...), then mesh['tp'] and mesh['dp', 'fsdp'].")
    return root


def parallelize_module(module: Any, device_mesh: DeviceMesh, parallelize_plan: Mapping[str, ParallelStyle]
                       ) -> ParallelModule:
    """torch's ``parallelize_module``: ``{module fqn glob: style}`` on the 1-D ``device_mesh`` (``mesh["tp"]``).

    The model's code is unchanged; each styled submodule's parameters are cut over the mesh dim and its
    activations laid out as the style says (see ``spmd.parallel.styles._styles``).
    """
    where = "parallelize_module"
    inner, have, tp, fsdp, remat = _unwrap(module, where)
    ep = ep_of(module)
    mesh = _mesh_of(device_mesh, where, "device_mesh")
    if mesh.ndim != 1:
        raise ValueError(f"{where}: device_mesh={mesh!r} must be 1-D, the tensor-parallel dim (mesh['tp']).")
    on_ep = mesh.mesh_dim_names[0] == EP_DIM
    if on_ep and ep is not None:
        raise ValueError(f"{where}: the model already has a plan on {EP_DIM!r}; give one plan with every style.")
    if tp is not None and not on_ep:
        raise ValueError(f"{where}: the model is already tensor-parallel on {tp.mesh_dim!r}; give one plan with "
                         "every style.")
    if not isinstance(parallelize_plan, Mapping) or not parallelize_plan:
        raise TypeError(f"{where}: parallelize_plan={parallelize_plan!r} must be a non-empty dict of module fqn "
                        "(with * globs) -> style, e.g. {'layers_*.mlp.up_proj': ColwiseParallel()}.")
    items = []
    for key, style in parallelize_plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{where}: parallelize_plan key {key!r} must be a module fqn such as 'layers_*.mlp.up_proj'.")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"{where}: parallelize_plan[{key!r}]={style!r} must be a ParallelStyle: a built-in "
                            "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...), "
                            "PrepareModuleOutput(...)) or an instance of your own subclass of ParallelStyle.")
        items.append((key.replace("/", "."), style))
    root = _same_root(have, mesh, where, "device_mesh")
    name = mesh.mesh_dim_names[0]
    if fsdp is not None and name in (fsdp.shard_dim, *fsdp.replicate_dims):
        raise ValueError(f"{where}: mesh dim {name!r} already shards or replicates the model under fully_shard; "
                         "use another mesh dim for tensor parallelism.")
    if on_ep:  # expert parallelism: a data dim whose styled modules run on their experts' tokens (linen or nnx)
        return ParallelModule(inner, root, tp, fsdp, remat, ep=TPSpec(name, tuple(items)))
    return ParallelModule(inner, root, TPSpec(name, tuple(items)), fsdp, remat, ep=ep)


def fully_shard(module: Any, *, mesh: DeviceMesh | None = None, units: Sequence[str] = (),
                reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None) -> ParallelModule:
    """torch FSDP2's ``fully_shard``: parameters, gradients and optimizer state cut over ``mesh``.

    ``mesh``: 1-D (the shard dim) or 2-D ``(replicate, shard)``: HSDP, as torch's. ``units``: module fqn
    globs (``"layers_*"``, ``"transformer.h.*"``): each matching submodule gathers its parameters right
    before it runs and frees them after; the rest of the model is the root unit, gathered once per step.
    ``reshard_after_forward=True`` gathers each unit again for its backward pass (one unit's parameters
    alive at a time); ``False`` keeps the forward pass's. ``mp_policy``: a ``MixedPrecisionPolicy``.
    """
    where = "fully_shard"
    inner, have, tp, fsdp, remat = _unwrap(module, where)
    if fsdp is not None:
        raise ValueError(f"{where}: the model is already fully sharded (units {list(fsdp.units)}); call fully_shard "
                         "once with every unit.")
    if mesh is None:
        raise TypeError(f"{where}: give mesh=, the data-parallel dims to shard over (mesh['fsdp'], or "
                        "mesh['dp', 'fsdp'] for HSDP).")
    mesh = _mesh_of(mesh, where, "mesh")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{where}: mesh={mesh!r} must be 1-D (shard) or 2-D (replicate, shard), as torch's.")
    if isinstance(units, str) or not all(isinstance(u, str) and u for u in units):
        raise TypeError(f"{where}: units={units!r} must be a list of module fqn globs, e.g. ['layers_*'].")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"{where}: reshard_after_forward={reshard_after_forward!r} must be a bool.")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}: mp_policy={mp_policy!r} must be a MixedPrecisionPolicy or None.")
    root = _same_root(have, mesh, where, "mesh")
    names = mesh.mesh_dim_names
    if CP_DIM in names:
        raise ValueError(f"{where}: mesh dim {CP_DIM!r} cuts the batch's sequence, its parameters whole over it; shard "
                         "over the data dims (mesh['dp', 'fsdp']).")
    if tp is not None and tp.mesh_dim in names:
        raise ValueError(f"{where}: mesh dim {tp.mesh_dim!r} is the tensor-parallel dim; shard over the data dims "
                         "(mesh['dp', 'fsdp']).")
    spec = FSDPSpec(names[-1], tuple(names[:-1]), tuple(u.replace("/", ".") for u in units), reshard_after_forward,
                    mp_policy)
    return ParallelModule(inner, root, tp, spec, remat, ep=ep_of(module))


def activation_checkpointing(module: Any, *, units: Sequence[str] = ("layers_*",), policy: str = "full"
                             ) -> ParallelModule:
    """torch's ``apply_activation_checkpointing``: each submodule matching ``units`` recomputes its forward
    pass in the backward pass instead of keeping its activations (``spmd.parallel.styles._remat``).

    ``units``: module fqn globs (``["layers_*"]``, ``["block_*"]``, ``["transformer.h.*"]``), as
    ``fully_shard``'s. ``policy``: one of ``POLICIES`` (``spmd.parallel.styles._remat``): ``"full"`` (keep only
    each unit's inputs), ``"dots"`` (its matmul outputs too), torchtitan's ``"selective"`` op AC, MaxText's
    ``"minimal"``, ``"save_dot_except_mlp"``, ``"save_dot_except_mlpwi"``, ``"save_qkv_proj"`` and ``"offload"``
    (refused on CPU). Composes in any order with ``parallelize_module`` and ``fully_shard``; on a plain model
    it trains data-parallel over ``make_train_step``'s ``mesh=`` (DDP). The results of the tensor-parallel
    collectives are always kept, so a step communicates what it does without checkpointing.
    """
    where = "activation_checkpointing"
    inner, mesh, tp, fsdp, remat = _unwrap(module, where)
    if remat is not None:
        raise ValueError(f"{where}: the model already checkpoints activations (units {list(remat.units)}, policy "
                         f"{remat.policy!r}); call {where} once with every unit.")
    if not isinstance(policy, str):
        raise TypeError(f"{where}: policy={policy!r} must be a string: "
                        + "; ".join(f"{k!r} ({v})" for k, v in POLICIES.items()) + ".")
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy={policy!r} is not a policy; use "
                         + " or ".join(f"{k!r} ({v})" for k, v in POLICIES.items()) + ".")
    why = offload_refusal(_devices_of(mesh)) if policy == "offload" else None
    if why:
        raise ValueError(f"{where}: policy='offload' cannot run here: {why}; use 'minimal' (the same matmul "
                         "outputs kept on the device) or 'full'.")
    if isinstance(units, str) or not all(isinstance(u, str) and u for u in units):
        raise TypeError(f"{where}: units={units!r} must be a list of module fqn globs, e.g. ['layers_*'] or "
                        "['transformer.h.*'].")
    if not units:
        raise ValueError(f"{where}: units=[] checkpoints nothing; name the modules to recompute, e.g. ['layers_*'].")
    return ParallelModule(inner, mesh, tp, fsdp, remat=RematSpec(tuple(u.replace("/", ".") for u in units), policy),
                          ep=ep_of(module))


def _devices_of(mesh: Any) -> list | None:
    """A mesh's devices (a ``DeviceMesh``'s or a ``jax.sharding.Mesh``'s), None without one."""
    m = getattr(mesh, "jax_mesh", mesh)
    return None if m is None else list(m.devices.ravel())


def as_parallel(model: Any, mesh: DeviceMesh | None, where: str) -> ParallelModule:
    """A model with neither transform, on ``mesh``: DDP over every mesh dim; a transformed one as it is."""
    if isinstance(model, ParallelModule) and model.mesh is None and mesh is not None:  # activation_checkpointing
        pm = ParallelModule(model.module, _mesh_of(mesh, where, "mesh").root_mesh, remat=model.remat)
        object.__setattr__(pm, "_plans", model._plans)  # unshard_params(model, params) finds their plan
        object.__setattr__(pm, "_params_seen", model._params_seen)
        return pm
    if isinstance(model, ParallelModule) and model.mesh is not None:
        if mesh is not None and mesh.root_mesh != model.mesh:
            raise ValueError(f"{where}: mesh={mesh!r} is not the mesh the model was laid out on ({model.mesh!r}); "
                             "leave mesh= out for a transformed model.")
        return model
    if mesh is None:
        raise TypeError(f"{where}: the model has no layout (neither parallelize_module nor fully_shard"
                        + (", only activation_checkpointing" if isinstance(model, ParallelModule) else "")
                        + "); give mesh= to train it data-parallel over every dim of that mesh.")
    return ParallelModule(model, _mesh_of(mesh, where, "mesh").root_mesh)


# --- the plan -----------------------------------------------------------------------------------------
def _modules(paths: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        comps = param_module(p)[0].split(".") if param_module(p)[0] else []
        for i in range(1, len(comps) + 1):
            m = ".".join(comps[:i])
            if m not in out:
                out.append(m)
    return out


def _no_match(where: str, arg: str, key: str, modules: list[str], params: Any = None) -> ValueError:
    hint = params_hint(params) if params is not None else ""
    if hint:  # the tree is not a model's parameters: that, not the name, is what to fix
        return ValueError(f"init_train_state: {where}'s {arg} {key!r} matches no module of params=, and{hint}")
    shown = ", ".join(modules[:40]) + (" ..." if len(modules) > 40 else "")
    return ValueError(f"{where}: {arg} {key!r} matches no module of the model; its modules are: {shown}. "
                      "Fix the name (globs: 'layers_*.mlp.up_proj', 'transformer.h.*').")


def tp_placements(tp: TPSpec, params: Any, stacked: Mapping[str, tuple[str, int]] | None = None
                  ) -> dict[str, Placement]:
    """The placement over ``tp`` of each parameter a style of ``tp``'s plan places (``path_str`` path ->
    ``Shard`` / ``Replicate``, by the style's ``param_placements``; a tied head alone, linen's ``Embed.attend``,
    places the table as its kernel transposed). ``stacked``: the parameters ``nn.scan`` stacks (``{path: (scan
    module, axis)}``), each styled as the block sees it (one layer): its cut one dim past the layer axis where
    it falls at or after that axis, which is never cut. Parameters no style places are left out."""
    stacked = dict(stacked or {})
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [path_str(kp) for kp, _ in leaves]
    tp_of: dict[str, Placement] = {}
    own: dict[str, dict[str, tuple]] = {}
    for (kp, x), path in zip(leaves, paths):
        fqn, name = param_module(path)
        own.setdefault(fqn, {})[name] = _layer_shape(np.shape(x), stacked.get(path))
    for (kp, x), path in zip(leaves, paths):
        fqn, name = param_module(path)
        hit = tp.style_for(fqn)
        if hit is not None:
            p = _placements(hit[1], fqn, own[fqn])[name]
        elif name == "embedding" and (tied := tp.style_for(fqn + ".attend")) is not None:
            # a tied head alone (linen ``Embed.attend``): the table (vocab, features) is its kernel transposed
            shape = own[fqn][name]
            k = _placements(tied[1], fqn + ".attend", {"kernel": shape[::-1]})["kernel"]
            p = Shard(len(shape) - 1 - k.dim) if isinstance(k, Shard) else k
        else:
            continue
        if isinstance(p, Shard):
            d, axis = p.dim % len(own[fqn][name]), stacked[path][1] if path in stacked else None
            p = Shard(d + 1 if axis is not None and d >= axis else d)
        tp_of[path] = p
    return tp_of


def build_plan(model: ParallelModule, params: Any, stacked: Mapping[str, tuple[str, int]] | None = None,
               out_cut: Sequence[str] | None = None) -> ParamPlan:
    """Every parameter's placements under the model's layouts (see the module doc). ``stacked``: the
    parameters ``nn.scan`` stacks, ``{path: (scan module, axis)}`` (``spmd.parallel.plan._scan``): never cut.
    ``out_cut``: the parameters whose gradient is a dot's output transposed (:func:`out_cut_of`), 2-D or
    stacked ``[L, in, out]`` (any layer axis); fsdp cuts each on its output dim (the last one past the layer
    axis) where the default would cut its input dim, the output dim is free of tp and fsdp divides it (or not
    the input dim either)."""
    where = "init_train_state"
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError(f"{where}: params={params!r} holds no arrays; pass the model's parameter pytree.")
    paths = [path_str(kp) for kp, _ in leaves]
    modules = _modules(paths)
    stacked = dict(stacked or {})
    tp, fsdp, mesh = model.tp, model.fsdp, model.mesh
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    if tp:
        for key, _ in tp.plan:
            head, _, method = key.rpartition(".")
            on = [key] + ([head] if method in METHODS else [])  # "embed.attend": a method of module "embed"
            if not any(re.fullmatch(glob_regex(k, "."), m) for k in on for m in modules):
                raise _no_match("parallelize_module", "plan key", key, modules, params)
        shapes = {param_module(p): _layer_shape(np.shape(x), stacked.get(p)) for p, (_, x) in zip(paths, leaves)}
        check_tp_plan(tp.plan, modules, shapes, lambda k: glob_regex(k, "."))
    unit_res = []
    if fsdp:
        for u in fsdp.units:
            if not any(re.fullmatch(glob_regex(u, "."), m) for m in modules):
                raise _no_match("fully_shard", "unit", u, modules, params)
            unit_res.append(glob_regex(u, "/"))
    for u in model.remat.units if model.remat else ():
        if not any(re.fullmatch(glob_regex(u, "."), m) for m in modules):
            raise _no_match("activation_checkpointing", "unit", u, modules)
    tp_of: dict[str, Placement] = {path: Replicate() for path in paths}
    if tp:  # each styled module's own parameters, placed by its style
        tp_of.update(tp_placements(tp, params, stacked))
    ep_of_path: dict[str, Placement] = {}
    if model.ep:  # each expert-parallel module's own parameters, placed over ep by its style
        # (under nn.scan as the block sees them, one layer: the cut one dim past the stacked layer axis, as tp's)
        ep = model.ep
        own_ep: dict[str, dict[str, tuple]] = {}
        for (kp, x), path in zip(leaves, paths):
            fqn, name = param_module(path)
            own_ep.setdefault(fqn, {})[name] = tuple(int(d) for d in _layer_shape(np.shape(x), stacked.get(path)))
        for key, _ in ep.plan:
            if not any(re.fullmatch(glob_regex(key, "."), m) for m in modules):
                raise _no_match("parallelize_module", "plan key", key, modules, params)
        for (kp, x), path in zip(leaves, paths):
            fqn, name = param_module(path)
            hit = ep.style_for(fqn)
            if hit is None:
                continue
            p = _placements(hit[1], fqn, own_ep[fqn])[name]
            shape = own_ep[fqn][name]
            if isinstance(p, Shard) and shape[p.dim % len(shape)] % sizes[ep.mesh_dim]:
                raise ValueError(
                    f"parallelize_module: {hit[1]!r} on {fqn!r} cuts dim {p.dim} of {path!r} (shape {shape}) over "
                    f"{ep.mesh_dim}={sizes[ep.mesh_dim]}, which does not divide it; use an ep size dividing "
                    f"{shape[p.dim % len(shape)]} (each rank holds the same number of experts).")
            if isinstance(p, Shard):
                d, axis = p.dim % len(shape), stacked[path][1] if path in stacked else None
                p = Shard(d + 1 if axis is not None and d >= axis else d)
            ep_of_path[path] = p
    rules = []
    n_tp = sizes.get(tp.mesh_dim, 1) if tp else 1
    for (kp, x), path in zip(leaves, paths):
        shape = tuple(int(d) for d in np.shape(x))
        pl: dict[str, Placement] = {}  # tp's cut, ep's, the fsdp unit's; every other mesh dim Replicate
        t = tp_of[path]
        if tp:
            if isinstance(t, Shard) and shape[t.dim] % n_tp:
                fqn, _ = param_module(path)
                raise ValueError(
                    f"parallelize_module: {tp.style_for(fqn)[1]!r} on {fqn!r} cuts dim {t.dim} of {path!r} "
                    f"(shape {shape}, size {shape[t.dim]}) over {tp.mesh_dim}={n_tp}, which does not divide it; a "
                    f"tensor-parallel cut must be even (the model reads global shapes): use a tp size dividing "
                    f"{shape[t.dim]}, another dim=, or leave the module out of the plan."
                    + ("" if stacked else " A module under nn.scan / nnx.scan is cut as its block sees it once the "
                       "plan knows the layer axis: give init_train_state the example inputs the model is called on."))
            pl[tp.mesh_dim] = t
        if path in ep_of_path:
            pl[model.ep.mesh_dim] = ep_of_path[path]
        if fsdp:  # the unit's style cuts it; off a dim that tp or nn.scan holds, onto the first one free
            fqn, name = param_module(path)
            p = fsdp.unit_style.param_placements(fqn, {name: shape})[name]
            taken = {q.dim % len(shape) for q in pl.values() if isinstance(q, Shard)} | {
                stacked[path][1] if path in stacked else None}
            if isinstance(p, Shard) and p.dim % len(shape) in taken:
                p = next((Shard(d) for d in range(len(shape)) if d not in taken), Replicate())
            n = sizes[fsdp.shard_dim]
            # a kernel [in, out] (one layer's: dims past a scan's layer axis) on its output dim where the default
            # cut its input dim, tp leaves the output dim free and fsdp divides it (or not the input dim either)
            layer = [d for d in range(len(shape)) if path not in stacked or d != stacked[path][1]]
            if (out_cut and path in out_cut and len(layer) == 2 and isinstance(p, Shard)
                    and p.dim % len(shape) == layer[0] and layer[1] not in taken
                    and (shape[layer[1]] % n == 0 or shape[layer[0]] % n)):
                p = Shard(layer[1])
            pl[fsdp.shard_dim] = p
        rules.append(Rule(re.escape(path), pl, name=_rule_name(model, path)))
    plan = plan_params(params, sizes, rules, fsdp=fsdp.shard_dim if fsdp else "", units=tuple(unit_res),
                       keep=(ROOT,) if (fsdp is None or fsdp.reshard_after_forward) else (".*",), stacked=stacked)
    return plan if out_cut is None else dataclasses.replace(plan, out_cut=tuple(sorted(out_cut)))


def _layer_shape(shape: Sequence[int], stacked: tuple[str, int] | None) -> tuple[int, ...]:
    """A parameter's shape as its module sees it: without the layer axis ``nn.scan`` stacks it on."""
    shape = tuple(int(d) for d in shape)
    return shape if stacked is None else shape[:stacked[1]] + shape[stacked[1] + 1:]


def _placements(style: ParallelStyle, fqn: str, params: dict) -> dict:
    """``style.param_placements`` checked: one ``Shard(d)`` (d in range) or ``Replicate()`` per parameter."""
    got = style.param_placements(fqn, dict(params))
    if not isinstance(got, Mapping) or set(got) != set(params):
        raise TypeError(f"parallelize_module: {style!r}.param_placements({fqn!r}, ...) returned {got!r}; return a dict "
                        f"with one placement for each of the module's parameters {sorted(params)}.")
    for name, p in got.items():
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(f"parallelize_module: {style!r}.param_placements({fqn!r}, ...)[{name!r}]={p!r} must be "
                            "Shard(d) or Replicate() (a parameter's placement over tp).")
        if isinstance(p, Shard) and not -len(params[name]) <= p.dim < len(params[name]):
            raise ValueError(f"parallelize_module: {style!r}.param_placements({fqn!r}, ...)[{name!r}]={p!r} is out "
                             f"of range for the parameter of shape {params[name]}; use a dim in "
                             f"[{-len(params[name])}, {len(params[name]) - 1}].")
    return got


def _rule_name(model: ParallelModule, path: str) -> str:
    fqn, _ = param_module(path)
    hit = model.tp.style_for(fqn) if model.tp else None
    parts = [f"{type(hit[1]).__name__}({hit[0]!r})"] if hit else []
    ep = model.ep.style_for(fqn) if model.ep else None
    if ep:
        parts.append(f"{type(ep[1]).__name__}({ep[0]!r})")
    if model.fsdp:
        parts.append("fully_shard")
    return " + ".join(parts) or "replicate"
