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
from spmd.parallel._styles import (KNOWN_EMBED, KNOWN_LINEAR, ColwiseParallel, RowwiseParallel, SequenceParallel,
                                   _kernel_dim)
from spmd.parallel._transforms import ParallelModule

__all__ = ["Hooks", "COLWISE_MARK"]

COLWISE_MARK = "spmd.colwise|"  # checkpoint_name prefix on column-parallel outputs (the head-cut check reads it)
TP_COMM = "spmd.tp_comm"  # checkpoint_name of the tp collectives' results: a re-gathering unit keeps them
# (with the matmul outputs) and recomputes the rest, so its backward pass repeats no tp communication
_SAVED = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(TP_COMM))


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


def _reduce_forward(y: jax.Array, axis: str, n: int) -> jax.Array:
    """Megatron's ``g``: the row-parallel output's all-reduce, with no communication backward. The
    output's gradient is whole on every rank; ``shard_map`` (``check_vma=False``) hands the region
    ``1/n`` of a whole output's cotangent and ``psum``'s own transpose would all-reduce the pieces back:
    ``n x`` restores it locally."""

    @jax.custom_vjp
    def g(y):
        return jax.lax.psum(y, axis)

    g.defvjp(lambda y: (jax.lax.psum(y, axis), None), lambda _, ct: (ct * n,))
    return g(y)


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
        self.records: list[tuple] = []  # (module, style, input bytes, output bytes) of each styled call
        self.bypass = False

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
        for group in self.tp_groups([entries[i] for i in cut], cut):
            ents = [entries[i] for i in group]
            in_island = self.tp is not None and self.tp_cut(ents[0])

            def gather_in(*ls, ents=ents):
                return tuple(gather_unit(list(ls), ents, self.fsdp, self.fi))

            run = (lambda *ls, f=gather_in, ents=ents: self.island(f, ents, ls)) if in_island else gather_in
            got = run(*[out[i] for i in group]) if pd is None else self._gather_mixed(run, [leaves[i] for i in group])
            for i, y in zip(group, got):
                out[i] = y
        return out

    def tp_cut(self, e: PlanEntry) -> bool:
        return self.ti is not None and isinstance(e.placements[self.ti], Shard)

    def tp_groups(self, ents: Sequence[PlanEntry], idx: Sequence[int]) -> list[list[int]]:
        """``idx`` split into the leaves cut over tp and those whole over tp (in first-seen order): the cut
        ones gather in a region manual over tp too; the whole ones where they are (a region's transpose
        would all-reduce their gradients over tp once more)."""
        groups: dict[bool, list[int]] = {}
        for e, i in zip(ents, idx):
            groups.setdefault(self.tp_cut(e), []).append(i)
        return list(groups.values())

    def _gather_mixed(self, gather_in: Callable, stored: list) -> tuple:
        """Gather in ``param_dtype``; the gradients reduce-scattered in ``reduce_dtype``, then stored dtype."""
        pd, rd = self.mp.param_dtype, self.mp.reduce_dtype
        dtypes = [x.dtype for x in stored]

        def cast(xs, dt):
            return [x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]

        @jax.custom_vjp
        def gathered(*xs):
            return gather_in(*cast(xs, pd))

        def fwd(*xs):
            return gathered(*xs), None

        def bwd(_, cts):
            dt = rd or pd
            cts = cast(cts, dt)
            prims = [jax.ShapeDtypeStruct(x.shape, dt if jnp.issubdtype(d, jnp.floating) else d)
                     for x, d in zip(stored, dtypes)]
            gs = jax.linear_transpose(lambda *xs: gather_in(*xs), *prims)(tuple(cts))
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
    def around(self, fqn: str, typ: str, call: Callable, args: tuple, kwargs: dict, params=(), run_local=None) -> Any:
        """A tensor-parallel style's layouts around ``call(*args, **kwargs)`` of module ``fqn``.

        ``params``: the module's own ``(plan path, value)`` pairs; ``run_local(values, args, kwargs,
        zero_bias)``: the module's computation on this device's tp blocks of them."""
        hit = self.model.tp.style_for(fqn) if self.model.tp and not self.bypass else None
        if hit is None:
            return call(*args, **kwargs)
        style = hit[1]
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            self.check_type(fqn, typ, style, next((np.shape(v) for p, v in params if p.split("/")[-1] in (
                "kernel", "embedding") or p.endswith(("/kernel/value", "/embedding/value"))), ()))
        if isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)) and args and _is_array(args[0]):
            return self._island_call(fqn, typ, style, params, run_local, args, kwargs)
        return self._constrained(style, typ, call, args, kwargs)

    def _constrained(self, style, typ, call, args, kwargs):
        given, desired = style.input_layouts_for(typ)
        args = list(args)
        if given is not None or desired is not None:
            gs = given if isinstance(given, (tuple, list)) else (given,)
            ds = desired if isinstance(desired, (tuple, list)) else (desired,)
            for i, (g, d) in enumerate(zip(gs, ds)):
                if i < len(args):
                    args[i] = self.constrain(self.constrain(args[i], g), d)
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
        if isinstance(y, (tuple, list)) and y:
            return type(y)([self.constrain(self.constrain(y[0], given), desired), *y[1:]])
        return self.constrain(self.constrain(y, given), desired)

    def _layout_spec(self, layout, ndim: int) -> P:
        spec: list = [None] * ndim
        if isinstance(layout, Shard):
            spec[layout.dim % ndim] = self.tp
        return P(*spec)

    def _island_call(self, fqn, typ, style, params, run_local, args, kwargs):
        """The styled module on this device's tp blocks, in a region manual over tp: every tp collective
        of the style written out (Megatron's f and g; sequence parallelism's all-gather / reduce-scatter)."""
        tp = self.tp
        x, rest = args[0], tuple(args[1:])
        paths = [p for p, _ in params]
        ents = [self.plan.entry(p) for p in paths]
        vals = [v for _, v in params]
        names = [p[:-len("/value")].split("/")[-1] if p.endswith("/value") else p.split("/")[-1] for p in paths]
        given, desired = style.input_layouts_for(typ)
        _, out = style.output_layouts_for(typ)
        gather_seq = None
        if isinstance(style, ColwiseParallel):
            x_layout = given if isinstance(given, Shard) else Replicate()
            gather_seq = given.dim if isinstance(given, Shard) else None
        elif isinstance(style, RowwiseParallel):  # the input arrives cut as it says (default: the last dim)
            x_layout = Replicate() if typ in KNOWN_EMBED else given
        else:
            x_layout = given
        rowwise = isinstance(style, RowwiseParallel)
        bias_after = rowwise and "bias" in names
        bias_outside = bias_after and not isinstance(out, Shard)  # whole output: every rank's bias gradient is whole
        # a column-parallel output is cut where its kernel is: the kernel's output axes end the output's dims
        # (Dense (in, out): the last; DenseGeneral (D, 3, H, hd) cut on the heads (dim=2): the third from the end)
        kern = next((e for e, n in zip(ents, names) if n in ("kernel", "embedding")), None)
        col_back = (len(kern.shape) - kern.shard_dim(self.ti) if kern is not None and self.ti is not None
                    and kern.shard_dim(self.ti) is not None and typ in KNOWN_LINEAR else 1)  # others: the last
        x_bytes = int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize  # x is global over tp here

        def body(vals, x):
            if gather_seq is not None:
                x = checkpoint_name(jax.lax.all_gather(x, tp, axis=gather_seq % x.ndim, tiled=True), TP_COMM)
            y = run_local(list(vals), (x, *rest), kwargs, bias_after)
            if rowwise:
                if isinstance(out, Shard):
                    y = jax.lax.psum_scatter(y, tp, scatter_dimension=out.dim % y.ndim, tiled=True)
                else:
                    y = _reduce_forward(y, tp, self.n_tp)
                y = checkpoint_name(y, TP_COMM)
                if bias_after and not bias_outside:
                    y = y + vals[names.index("bias")].astype(y.dtype)
            elif isinstance(style, ColwiseParallel) and not isinstance(out, Shard):
                y = jax.lax.all_gather(y, tp, axis=y.ndim - col_back, tiled=True)
            return y

        local_vals = [jax.ShapeDtypeStruct(self._local_shape(e, np.shape(v)), v.dtype) for e, v in zip(ents, vals)]
        local_x = jax.ShapeDtypeStruct(self._local_layout_shape(x_layout, np.shape(x)), x.dtype)
        if rowwise and typ in KNOWN_EMBED:  # its lookup reads the tp rank: no shape to evaluate outside the region
            ndim = np.ndim(x) + 1
        else:
            ndim = len(jax.eval_shape(lambda v, x: run_local(list(v), (x, *rest), kwargs, bias_after), local_vals,
                                      local_x if gather_seq is None else jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                                      ).shape)
        out_layout = out if (rowwise or isinstance(style, SequenceParallel)) else (
            Shard(ndim - col_back) if isinstance(out, Shard) else Replicate())
        if isinstance(style, ColwiseParallel) and isinstance(out, Shard):
            out_layout = Shard(ndim - col_back)
        in_specs = (tuple(self.tp_spec(e, np.ndim(v)) for e, v in zip(ents, vals)), self._layout_spec(x_layout, x.ndim))
        y = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                          out_specs=self._layout_spec(out_layout, ndim), axis_names={tp}, check_vma=False)(tuple(vals), x)
        if bias_outside:
            y = y + vals[names.index("bias")].astype(y.dtype)
        summed = [int(np.prod(np.shape(v))) * jnp.dtype(v.dtype).itemsize for e, n, v in zip(ents, names, vals)
                  if e.shard_dim(self.ti) is None
                  and (isinstance(style, SequenceParallel) or (n == "bias" and bias_after and not bias_outside))]
        self.records.append({
            "module": fqn, "style": type(style).__name__, "type": typ, "in_layout": x_layout, "out_layout": out,
            "in_bytes": x_bytes, "out_bytes": int(np.prod(y.shape)) * jnp.dtype(y.dtype).itemsize,
            "input_grad": bool(jnp.issubdtype(x.dtype, jnp.inexact)), "summed_params": summed,
            "input_id": id(x)})  # modules reading one input (q, k, v) share its sequence all-gather (XLA merges them)
        if isinstance(style, ColwiseParallel) and isinstance(out, Shard) and typ not in KNOWN_EMBED:
            y = checkpoint_name(y, f"{COLWISE_MARK}{fqn}|{self.n_tp}")
        return y

    def _local_shape(self, e: PlanEntry, shape) -> tuple:
        shape = list(shape)
        if self.ti is not None and isinstance(e.placements[self.ti], Shard):
            shape[e.placements[self.ti].dim] //= self.n_tp
        return tuple(shape)

    def _local_layout_shape(self, layout, shape) -> tuple:
        shape = list(shape)
        if isinstance(layout, Shard):
            shape[layout.dim % len(shape)] //= self.n_tp
        return tuple(shape)

    @contextlib.contextmanager
    def bypassing(self):
        """Module calls pass straight through (a styled module's own code on its local blocks)."""
        saved, self.bypass = self.bypass, True
        try:
            yield
        finally:
            self.bypass = saved

    def check_type(self, fqn: str, typ: str, style: Any, kernel_shape) -> None:
        """A style on a module type it does not know, without ``dim=``: the error that names the fix."""
        name = type(style).__name__
        if typ in KNOWN_LINEAR + KNOWN_EMBED or style.dim is not None:
            return
        _kernel_dim(name, fqn, typ, tuple(kernel_shape or ()), None, 0)

    def call_unit(self, run: Callable, shards: list, arrays: list) -> Any:
        """``run(shards, arrays)``: a unit gathering its parameters and running. With
        ``reshard_after_forward``, the backward pass gathers them again: ``jax.checkpoint`` keeps the matmul
        outputs and the tp collectives' results and drops the gathered parameters, and the shards it keeps get ``+ 0`` computed from the
        incoming cotangent, so the re-gather is a new all-gather of the backward pass (XLA:CPU drops
        optimization barriers before it merges equal ops, and would merge it with the forward pass's
        all-gather, holding the parameters all along, when the blocks are a Python loop)."""
        if not self.regather:
            return run(shards, arrays)
        ckpt = jax.checkpoint(run, policy=_SAVED)

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
                # 0, computed from the cotangent, so the re-gather cannot run (or merge) before it. A sum, not an
                # element: the cotangent may be cut over tp (one element would be gathered; a sum is a scalar).
                zero = jnp.sum(first * 0)
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
        if self.bypass:
            return next_fun(*args, **kwargs)
        path = self.prefix + tuple(str(p) for p in mod.scope.path)
        fqn, spath = ".".join(path), "/".join(path)
        typ = type(mod).__name__
        self.types.setdefault(fqn, typ)
        if self.gather_units and spath in self.units and spath not in self.active:
            return self._linen_unit(spath, path, mod, context.method_name, args, kwargs)
        if context.method_name != "__call__" or self.model.tp is None or self.model.tp.style_for(fqn) is None:
            return next_fun(*args, **kwargs)
        own = mod.variables.get("params", {})
        kp, pdef = jax.tree_util.tree_flatten_with_path(own)
        params = [(spath + "/" + path_str(k), v) for k, v in kp]

        def run_local(vals, a, k, zero_bias):
            tree = jax.tree_util.tree_unflatten(pdef, vals)
            if zero_bias and "bias" in tree:
                tree = {**tree, "bias": jnp.zeros_like(tree["bias"])}
            style = self.model.tp.style_for(fqn)[1]
            if isinstance(style, RowwiseParallel) and typ in KNOWN_EMBED:
                return self._embed_rows(tree["embedding"], a[0], getattr(mod, "dtype", None))
            attrs = {}
            if isinstance(style, ColwiseParallel) and typ in ("Dense", "DenseGeneral", "Embed"):
                attrs["features"] = self._local_features(typ, mod, tree)
            elif isinstance(style, ColwiseParallel) and isinstance(getattr(mod, "features", None), int):
                attrs["features"] = mod.features // self.n_tp  # a module type of its own (FlaxConv1D): its width
            import flax.errors

            try:
                with self.bypassing():
                    return mod.clone(parent=None, **attrs).apply({"params": tree}, *a, **k)
            except flax.errors.ScopeParamShapeError as err:
                raise ValueError(
                    f"parallelize_module: {type(style).__name__} on {fqn!r} ({typ}): the module checks its "
                    f"parameter shapes against its own attributes, and its code does not run on its tp blocks "
                    f"({err}). Give it a 'features' attribute, use a known type ({', '.join(KNOWN_LINEAR)}), or "
                    "leave it out of the plan.") from None

        return self.around(fqn, typ, next_fun, args, kwargs, params, run_local)

    def _local_features(self, typ: str, mod, tree) -> Any:
        if typ == "Embed":
            return tree["embedding"].shape[-1]
        if typ == "Dense":
            return tree["kernel"].shape[-1]
        feats = mod.features if isinstance(mod.features, tuple) else (mod.features,)
        return tuple(tree["kernel"].shape[-len(feats):]) if isinstance(mod.features, tuple) else tree["kernel"].shape[-1]

    def _embed_rows(self, table, ids, dtype):
        """A vocabulary-parallel lookup on this device's rows: the rows it holds, zeros elsewhere (summed after)."""
        vc = table.shape[0]
        local = ids - jax.lax.axis_index(self.tp) * vc
        ok = (local >= 0) & (local < vc)
        e = jnp.take(table, jnp.clip(local, 0, vc - 1), axis=0)
        e = jnp.where(ok[..., None], e, jnp.zeros((), e.dtype))
        return e.astype(dtype) if dtype is not None else e

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
        call = lambda *a, **k: orig(sub, *a, **k)  # noqa: E731
        if self.bypass or self.model.tp is None or self.model.tp.style_for(fqn) is None:
            return call(*args, **kwargs)
        from spmd.parallel._nnx import nnx_unit_params

        own = [(rel, v) for rel, v in nnx_unit_params(sub) if "/" not in rel]
        params = [(f"{spath}/{rel}/value", v[...]) for rel, v in own]

        def run_local(vals, a, k, zero_bias):
            style = self.model.tp.style_for(fqn)[1]
            rels = [rel for rel, _ in own]
            if isinstance(style, RowwiseParallel) and typ in KNOWN_EMBED:
                return self._embed_rows(vals[rels.index("embedding")], a[0], getattr(sub, "dtype", None))
            from spmd.parallel._nnx import with_values

            local = with_values(sub, {rel: jnp.zeros_like(x) if zero_bias and rel == "bias" else x
                                      for rel, x in zip(rels, vals)})
            with self.bypassing():
                return orig(local, *a, **k)

        return self.around(fqn, typ, call, args, kwargs, params, run_local)

    def _nnx_unit(self, spath: str, sub: Any, orig: Callable, args, kwargs):
        from spmd.parallel._nnx import nnx_unit_params

        params = nnx_unit_params(sub)
        entries = [self.plan.entry(f"{spath}/{rel}/value") for rel, _ in params]
        mine = [i for i, e in enumerate(entries) if e.unit == spath]
        arrays, rebuild = _split_arrays((args, kwargs))

        from spmd.parallel._nnx import with_values

        def run(shards, arrays):
            full = list(shards)
            for i, y in zip(mine, self.gather([shards[i] for i in mine], [entries[i] for i in mine])):
                full[i] = y
            local = with_values(sub, {rel: x for (rel, _), x in zip(params, full)})
            self.active.add(spath)
            try:
                a, k = self.cast_inputs(rebuild(list(arrays)))
                return orig(local, *a, **k)
            finally:
                self.active.discard(spath)

        return self.call_unit(run, [v[...] for _, v in params], arrays)
