"""The hooks that apply the layouts to a model whose code is unchanged: around its submodules' calls.

The train step runs the user's ``loss_fn`` in one ``shard_map`` region that is *manual* over the data mesh
dims (``dp``, ``fsdp``: each device holds its batch rows and its parameter shards, and every collective
is ours, written out) and *automatic* (global view, GSPMD) over the tensor-parallel dim. The hooks
intercept every submodule call (linen: ``nn.intercept_methods``; nnx: the merged module's submodules are
wrapped in place) and:

- **FSDP unit**: gather the unit's parameters right before it runs (``gather_unit``: one all-gather per
  buffer over the shard dim, in a nested region manual over every dim, so XLA never sees a collective on
  a tp-sharded operand, which it would first gather over tp), run the unit on them, and, with
  ``reshard_after_forward``, wrap that in ``jax.checkpoint`` (matmul outputs saved, gathered parameters
  not: the backward pass gathers again). ``jax.grad`` of the all-gather is one reduce-scatter per buffer.
- **tensor-parallel style**: put the style's layouts on the module's inputs and outputs as sharding
  constraints over ``tp`` (``ColwiseParallel``'s input ``Replicate``, output ``Shard(-1)``;
  ``RowwiseParallel``'s output ``Replicate`` or ``Shard(1)``, ...). Activations keep their global shapes,
  so attention that reshapes by its global head count runs as written; GSPMD inserts exactly the
  all-reduce / all-gather / reduce-scatter each layout change needs.

Why this split: in global view over the data dims XLA reduces a gradient with an all-reduce and a slice
(twice the bytes of FSDP's reduce-scatter) and we could not prove the bound; in local view over ``tp`` the
model would see local head counts (torch users patch ``n_heads`` by hand). Manual where the collectives
are the algorithm's, global where the model's own shapes must stay.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from placements import Replicate, Shard
from spmd.parallel._param_plan import ROOT, ParamPlan, PlanEntry, path_str
from spmd.parallel._shard import gather_unit
from spmd.parallel._styles import KNOWN_EMBED, KNOWN_LINEAR, ColwiseParallel, RowwiseParallel, _kernel_dim
from spmd.parallel._transforms import ParallelModule

__all__ = ["Hooks", "COLWISE_MARK"]

COLWISE_MARK = "spmd.colwise|"  # checkpoint_name prefix on column-parallel outputs (the head-cut check reads it)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def _split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """The array leaves of ``tree`` and a function putting (new) arrays back among the other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [i for i, x in enumerate(leaves) if _is_array(x)]

    def rebuild(arrays: list) -> Any:
        out = list(leaves)
        for i, a in zip(where, arrays):
            out[i] = a
        return jax.tree_util.tree_unflatten(treedef, out)

    return [leaves[i] for i in where], rebuild


class Hooks:
    """The layouts of one ``ParallelModule`` and ``ParamPlan`` inside the train step's region (one trace)."""

    def __init__(self, model: ParallelModule, plan: ParamPlan, *, gather_units: bool = True):
        self.model, self.plan = model, plan
        self.tp = model.tp.mesh_dim if model.tp else None
        self.n_tp = model.mesh.size(self.tp) if self.tp else 1
        fsdp = model.fsdp
        self.fsdp = fsdp.shard_dim if fsdp else None
        self.fi = plan.mesh_dim_names.index(self.fsdp) if fsdp else None
        self.ti = plan.mesh_dim_names.index(self.tp) if self.tp else None
        self.regather = bool(fsdp and fsdp.reshard_after_forward)
        self.mp = fsdp.mp_policy if fsdp else None
        self.gather_units = gather_units and fsdp is not None
        self.units = set(plan.units) - {ROOT}
        self.prefix: tuple[str, ...] = ()
        self.active: set[str] = set()
        self.types: dict[str, str] = {}

    # --- layouts over tp ----------------------------------------------------------------------------
    def constrain(self, x: Any, layout: Any) -> Any:
        """``x`` laid out as ``layout`` (``Shard(d)`` / ``Replicate()``) over tp: a sharding constraint."""
        if self.tp is None or layout is None or not _is_array(x) or not hasattr(x, "ndim"):
            return x
        spec: list = [None] * x.ndim
        if isinstance(layout, Shard):
            if not -x.ndim <= layout.dim < x.ndim:
                return x
            spec[layout.dim % x.ndim] = self.tp
        return jax.lax.with_sharding_constraint(x, P(*spec))

    def tp_spec(self, e: PlanEntry, ndim: int) -> P:
        spec: list = [None] * ndim
        if self.ti is not None and isinstance(e.placements[self.ti], Shard):
            spec[e.placements[self.ti].dim] = self.tp
        return P(*spec)

    def island(self, fn: Callable, entries: Sequence[PlanEntry], leaves: Sequence[Any]):
        """``fn(*leaves)`` in a region manual over tp too (each leaf's tp block), or as it is without tp."""
        if self.tp is None:
            return fn(*leaves)
        specs = tuple(self.tp_spec(e, np.ndim(x)) for e, x in zip(entries, leaves))
        return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=specs,
                             axis_names={self.tp}, check_vma=False)(*leaves)

    # --- FSDP gathers -------------------------------------------------------------------------------
    def gather(self, leaves: Sequence[Any], entries: Sequence[PlanEntry]) -> list:
        """The full parameters of ``entries`` from this device's padded blocks (cast to ``param_dtype``)."""
        pd = self.mp.param_dtype if self.mp else None
        if self.fsdp is None:
            return [x.astype(pd) if pd is not None and jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
        cut = [i for i, e in enumerate(entries) if e.shard_dim(self.fi) is not None]
        out = list(leaves)
        if pd is not None:
            out = [x.astype(pd) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in out]
        if not cut:
            return out
        ents = [entries[i] for i in cut]

        def gather_in(*ls):
            return tuple(gather_unit(list(ls), ents, self.fsdp, self.fi))

        if pd is None:
            got = self.island(gather_in, ents, [out[i] for i in cut])
        else:
            got = self._gather_mixed(gather_in, ents, [leaves[i] for i in cut])
        for i, y in zip(cut, got):
            out[i] = y
        return out

    def _gather_mixed(self, gather_in: Callable, ents: list, stored: list) -> tuple:
        """Gather in ``param_dtype``; the gradients reduce-scattered in ``reduce_dtype``, then stored dtype."""
        pd, rd = self.mp.param_dtype, self.mp.reduce_dtype
        dtypes = [x.dtype for x in stored]

        def cast(xs, dt):
            return [x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]

        @jax.custom_vjp
        def gathered(*xs):
            return self.island(gather_in, ents, cast(xs, pd))

        def fwd(*xs):
            return gathered(*xs), None

        def bwd(_, cts):
            dt = rd or pd
            cts = cast(cts, dt)
            prims = [jax.ShapeDtypeStruct(x.shape, dt if jnp.issubdtype(d, jnp.floating) else d)
                     for x, d in zip(stored, dtypes)]
            (gs) = jax.linear_transpose(lambda *xs: self.island(gather_in, ents, list(xs)), *prims)(tuple(cts))
            return tuple(g.astype(d) for g, d in zip(gs, dtypes))

        gathered.defvjp(fwd, bwd)
        return gathered(*stored)

    def cast_inputs(self, tree: Any) -> Any:
        if not (self.mp and self.mp.param_dtype is not None and self.mp.cast_forward_inputs):
            return tree
        pd = self.mp.param_dtype
        return jax.tree.map(lambda x: x.astype(pd) if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
                            tree)

    # --- the module call --------------------------------------------------------------------------
    def around(self, fqn: str, typ: str, call: Callable, args: tuple, kwargs: dict, kernel_shape=None) -> Any:
        """A tensor-parallel style's layouts around ``call(*args, **kwargs)`` of module ``fqn``."""
        hit = self.model.tp.style_for(fqn) if self.model.tp else None
        if hit is None:
            return call(*args, **kwargs)
        style = hit[1]
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            self.check_type(fqn, typ, style, kernel_shape)
        given, desired = style.input_layouts_for(typ)
        args = list(args)
        if given is not None or desired is not None:
            gs = given if isinstance(given, (tuple, list)) else (given,)
            ds = desired if isinstance(desired, (tuple, list)) else (desired,)
            for i, (g, d) in enumerate(zip(gs, ds)):
                if i < len(args):
                    args[i] = self.constrain(self.constrain(args[i], g), d) if g != d else self.constrain(args[i], g)
        kg, kd = style.kwarg_layouts()
        kwargs = dict(kwargs)
        for k in set(kg) | set(kd):
            if k in kwargs:
                kwargs[k] = self.constrain(self.constrain(kwargs[k], kg.get(k)), kd.get(k))
        y = call(*args, **kwargs)
        given, desired = style.output_layouts_for(typ)
        if isinstance(y, (tuple, list)) and isinstance(desired, (tuple, list)):
            gs = given if isinstance(given, (tuple, list)) else (given,) * len(desired)
            return type(y)(self.constrain(self.constrain(v, g), d) for v, g, d in zip(y, gs, desired))
        first = y[0] if isinstance(y, (tuple, list)) and y else y
        out = self.constrain(first, given) if given is not None else first
        out = self.constrain(out, desired)
        if isinstance(style, ColwiseParallel) and isinstance(desired, Shard) and desired.dim in (-1, np.ndim(out) - 1) \
                and _is_array(out) and typ not in KNOWN_EMBED:
            out = checkpoint_name(out, f"{COLWISE_MARK}{fqn}|{self.n_tp}")
        if isinstance(y, (tuple, list)) and y:
            return type(y)([out, *y[1:]])
        return out

    def check_type(self, fqn: str, typ: str, style: Any, kernel_shape) -> None:
        """A style on a module type it does not know, without ``dim=``: the error that names the fix."""
        name = type(style).__name__
        if typ in KNOWN_LINEAR + KNOWN_EMBED or style.dim is not None:
            return
        _kernel_dim(name, fqn, typ, tuple(kernel_shape or ()), None, 0)

    def call_unit(self, run: Callable, shards: list, arrays: list) -> Any:
        """``run(shards, arrays)``: a unit gathering its parameters and running. With
        ``reshard_after_forward``, the backward pass gathers them again: ``jax.checkpoint`` keeps the matmul
        outputs and drops the gathered parameters, and the shards it keeps get ``+ 0`` computed from the
        incoming cotangent, so the re-gather is a new all-gather of the backward pass (XLA:CPU drops
        optimization barriers before it merges equal ops, and would merge it with the forward pass's
        all-gather, holding the parameters all along, when the blocks are a Python loop)."""
        if not self.regather:
            return run(shards, arrays)
        ckpt = jax.checkpoint(run, policy=jax.checkpoint_policies.dots_saveable)

        @jax.custom_vjp
        def unit(shards, arrays):
            return ckpt(shards, arrays)

        def fwd(shards, arrays):
            return jax.vjp(ckpt, shards, arrays)

        kinds = {(tuple(np.shape(x)), jnp.dtype(x.dtype)) for x in shards}

        def bwd(res, ct):
            leaves, treedef = jax.tree_util.tree_flatten(res)
            first = next((c for c in jax.tree.leaves(ct) if jnp.issubdtype(c.dtype, jnp.floating) and c.size), None)
            if first is not None:
                c = first.reshape(-1)[0]
                zero = c - c  # 0, computed from the cotangent: the re-gather cannot run (or merge) before it
                leaves = [x + zero.astype(x.dtype) if (tuple(np.shape(x)), jnp.dtype(x.dtype)) in kinds else x
                          for x in leaves]
            return jax.tree_util.tree_unflatten(treedef, leaves)(ct)

        unit.defvjp(fwd, bwd)
        return unit(shards, arrays)

    # --- linen ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        import flax.linen as nn

        with nn.intercept_methods(self._linen):
            yield

    def _linen(self, next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "setup" or getattr(mod, "scope", None) is None:
            return next_fun(*args, **kwargs)
        path = self.prefix + tuple(str(p) for p in mod.scope.path)
        fqn, spath = ".".join(path), "/".join(path)
        typ = type(mod).__name__
        self.types.setdefault(fqn, typ)
        if self.gather_units and spath in self.units and spath not in self.active:
            return self._linen_unit(spath, path, mod, context.method_name, args, kwargs)
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        kernel = mod.variables.get("params", {}).get("kernel") if hasattr(mod.variables, "get") else None
        return self.around(fqn, typ, next_fun, args, kwargs, None if kernel is None else np.shape(kernel))

    def _linen_unit(self, spath: str, path: tuple, mod, method: str, args, kwargs):
        variables = mod.variables
        params = variables.get("params", {})
        others = {k: v for k, v in variables.items() if k != "params"}
        kp, treedef = jax.tree_util.tree_flatten_with_path(params)
        entries = [self.plan.entry(spath + "/" + path_str(k)) for k, _ in kp]
        shards = [x for _, x in kp]
        mine = [i for i, e in enumerate(entries) if e.unit == spath]
        arrays, rebuild = _split_arrays((args, kwargs))
        clone = mod.clone(parent=None)

        def run(shards, arrays):
            full = list(shards)
            for i, y in zip(mine, self.gather([shards[i] for i in mine], [entries[i] for i in mine])):
                full[i] = y
            a, k = self.cast_inputs(rebuild(list(arrays)))
            saved = self.prefix
            self.prefix = path
            self.active.add(spath)
            try:
                return clone.apply({"params": jax.tree_util.tree_unflatten(treedef, full), **others}, *a,
                                   method=method, **k)
            finally:
                self.prefix = saved
                self.active.discard(spath)

        return self.call_unit(run, shards, arrays)

    # --- nnx --------------------------------------------------------------------------------------
    def nnx_call(self, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict) -> Any:
        """A hooked nnx submodule's ``__call__`` (see ``spmd.parallel._nnx``)."""
        spath = fqn.replace(".", "/")
        typ = type(sub).__name__
        self.types.setdefault(fqn, typ)
        if self.gather_units and spath in self.units and spath not in self.active:
            return self._nnx_unit(spath, sub, orig, args, kwargs)
        kernel = getattr(sub, "kernel", None)
        shape = None if kernel is None else np.shape(getattr(kernel, "value", kernel))
        return self.around(fqn, typ, lambda *a, **k: orig(sub, *a, **k), args, kwargs, shape)

    def _nnx_unit(self, spath: str, sub: Any, orig: Callable, args, kwargs):
        from spmd.parallel._nnx import nnx_unit_params

        params = nnx_unit_params(sub)
        entries = [self.plan.entry(f"{spath}/{rel}/value") for rel, _ in params]
        mine = [i for i, e in enumerate(entries) if e.unit == spath]
        arrays, rebuild = _split_arrays((args, kwargs))

        def run(shards, arrays):
            full = list(shards)
            for i, y in zip(mine, self.gather([shards[i] for i in mine], [entries[i] for i in mine])):
                full[i] = y
            old = [v.value for _, v in params]
            for (_, v), x in zip(params, full):
                v.value = x
            self.active.add(spath)
            try:
                a, k = self.cast_inputs(rebuild(list(arrays)))
                return orig(sub, *a, **k)
            finally:
                for (_, v), x in zip(params, old):
                    v.value = x
                self.active.discard(spath)

        return self.call_unit(run, [v.value for _, v in params], arrays)
