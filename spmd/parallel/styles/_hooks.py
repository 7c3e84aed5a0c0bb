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
  not: the backward pass gathers again), its gathers tied to its input so that they run when it runs
  (``_after``; the tie's zero summed on each device's block, no collective: ``_zero_from``).
  ``jax.grad`` of the all-gather is one reduce-scatter per buffer.
- **activation-checkpointing unit** (``spmd.parallel.styles._remat``): run the module's own apply under
  ``jax.checkpoint`` with the unit's policy (the tp collectives' results always kept). An FSDP unit too:
  re-gathering, its policy replaces the one above; keeping its gathers, only the apply after the gather is
  checkpointed, so the gathered parameters are the recomputation's inputs, never gathered again.
- **tensor-parallel style**: run the module on its tp blocks in a region manual over tp
  (``spmd.parallel.styles._tp_calls``), every tp collective of the style written out. Outside those regions the
  model runs in global view over tp, so attention that reshapes by its global head count runs as written.

Why this split: in global view XLA:CPU reduces a gradient with an all-reduce and a slice (twice the bytes
of FSDP's reduce-scatter), and turns a sequence-parallel reduce-scatter into the same; a collective over
the data dims on a tp-sharded operand makes XLA gather it over tp first; and in local view over tp the
model would see local head counts (torch users patch ``n_heads`` by hand). So: manual wherever a
collective is the algorithm's, global view where the model's own shapes must stay.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from placements import Shard
from spmd.parallel.plan._param_plan import ROOT, ParamPlan, PlanEntry, path_str
from spmd.parallel.plan._scan import unstacked
from spmd.parallel.plan._shard import gather_unit
from spmd.parallel.styles._experts import ep_call
from spmd.parallel.styles._styles import KNOWN_LINEAR
from spmd.parallel.styles._remat import RematCalls, checkpoint_policy, mutable_collections, put_back
from spmd.parallel.styles._tp_calls import COLWISE_MARK, TP_COMM, WHOLE_MARK, TPCalls, _is_array, split_arrays
from spmd.parallel.styles._transforms import METHODS, ParallelModule
from spmd.parallel.styles._weight_stationary import activation_cut_dim

__all__ = ["Hooks", "COLWISE_MARK", "WHOLE_MARK", "TP_COMM"]

_SAVED = checkpoint_policy("dots")  # a re-gathering unit's residuals: the matmul outputs and the tp results


class Hooks(TPCalls, RematCalls):
    """The layouts of one ``ParallelModule`` and ``ParamPlan`` inside the train step's region (one trace)."""

    def __init__(self, model: ParallelModule, plan: ParamPlan, *, gather_units: bool = True,
                 whole_heads: dict | None = None):
        self.model, self.plan = model, plan
        # the projections run whole over tp, by module: their head count (``spmd.parallel.step._heads``)
        self.whole_heads = dict(whole_heads or {})
        self.tp = model.tp.mesh_dim if model.tp else None
        # the dim the plan cuts the activations on over tp (sequence parallel, weight-stationary): the re-gather
        # ties' zeros are summed on each device's block there (``_zero_from``), not over tp
        self.act_cut = activation_cut_dim(model.tp)
        self.n_tp = model.mesh.size(self.tp) if self.tp else 1
        fsdp = model.fsdp
        self.fsdp = fsdp.shard_dim if fsdp else None
        self.fi = plan.mesh_dim_names.index(self.fsdp) if fsdp else None
        self.ti = plan.mesh_dim_names.index(self.tp) if self.tp else None
        self.regather = bool(fsdp and fsdp.reshard_after_forward)
        self.mp = fsdp.mp_policy if fsdp else None
        self.gather_units = gather_units and fsdp is not None
        self.units = set(plan.units) - {ROOT}
        self.remat = model.remat
        self.prefix: tuple[str, ...] = ()
        self.active: set[str] = set()
        self.in_remat: list[str] = []  # the checkpointed units being traced, outermost first
        self.records: list[tuple] = []  # (module, style, input bytes, output bytes) of each styled call
        self.ep_records: list[dict] = []  # the calls styled on the ep dim (spmd.parallel.styles._experts)
        self.bypass = False

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

    def entry_for(self, path: str, value: Any) -> PlanEntry:
        """The plan entry of ``path`` as a module sees ``value``: inside the scan that stacks it, one layer."""
        e = self.plan.entry(path)
        return unstacked(e) if e.stacked is not None and np.ndim(value) == len(e.shape) - 1 else e

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
    def call_unit(self, run: Callable, shards: list, arrays: list, policy: Callable | None = None) -> Any:
        """``run(shards, arrays)``: a unit gathering its parameters and running. With
        ``reshard_after_forward``, the backward pass gathers them again: ``jax.checkpoint`` keeps the matmul
        outputs and the tp collectives' results and drops the gathered parameters, and the shards it keeps get
        ``+ 0`` computed from the incoming cotangent (``_plus_zero``), so the re-gather is a new all-gather of
        the backward pass (XLA:CPU drops optimization barriers before it merges equal ops, and would merge it
        with the forward pass's all-gather, holding the parameters all along, when the blocks are a Python
        loop). Likewise the shards get ``+ 0`` computed from the unit's input in the forward pass (``_after``).
        ``policy``: an activation-checkpointing unit's, in place of the matmul outputs and tp results."""
        if not self.regather:
            return run(shards, arrays)
        shards = self._after(shards, arrays)
        ckpt = jax.checkpoint(run, policy=policy or _SAVED)

        @jax.custom_vjp
        def unit(shards, arrays):
            return ckpt(shards, arrays)

        def fwd(shards, arrays):
            return jax.vjp(ckpt, shards, arrays)

        kinds = {(tuple(np.shape(x)), jnp.dtype(x.dtype)) for x in shards}

        def bwd(res, ct):
            leaves, treedef = jax.tree_util.tree_flatten(res)  # the re-gather cannot run (or merge) before ct
            return jax.tree_util.tree_unflatten(treedef, _plus_zero(leaves, self._zero_from(ct), kinds))(ct)

        unit.defvjp(fwd, bwd)
        return unit(shards, arrays)

    def _after(self, shards: list, arrays: Sequence[Any]) -> list:
        """``shards`` plus a 0 computed from the unit's input (no gradient through it): the unit's all-gathers
        then cannot run before its input exists. Without it XLA schedules every unit's forward gather at the
        start of the step, and a re-gathering layout holds all the gathered parameters at once, as if it kept
        them."""
        return _plus_zero(shards, self._zero_from(jax.lax.stop_gradient(list(arrays))))

    def _zero_from(self, source: Any) -> Any:
        """A scalar 0 computed from ``source``'s first non-empty floating leaf (None: it has none), with no
        collective. A sum, not an element: the leaf may be cut over tp, and one element would be gathered.
        Where the plan cuts the activations on a dim over tp, the leaf is first narrowed to that dim (index 0
        elsewhere: on each device's own block) and summed in a region manual over tp, so each device sums its
        own part; a sum in global view would be an all-reduce over tp, one per unit and pass."""
        x = next((a for a in jax.tree.leaves(source) if jnp.issubdtype(a.dtype, jnp.floating) and a.size), None)
        if x is None:
            return None
        d = self.act_cut
        if d is None or self.n_tp < 2 or x.ndim <= d or x.shape[d] % self.n_tp:
            return jnp.sum(x * 0)
        line = x[tuple(slice(None) if i == d else 0 for i in range(x.ndim))]
        return jax.shard_map(lambda v: jnp.sum(v * 0), mesh=self._region_mesh(), in_specs=P(self.tp), out_specs=P(),
                             axis_names={self.tp}, check_vma=False)(line)

    # --- linen ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        import flax.linen as nn

        from spmd.parallel.styles._nnx import installing

        with nn.intercept_methods(self._linen), installing(self):
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
        if self.gather_units and spath in self.units and spath not in self.active:
            return self._linen_unit(spath, path, mod, context.method_name, args, kwargs)
        if spath not in self.active and (policy := self.remat_policy(fqn)) is not None:
            return self.linen_remat(spath, path, mod, context.method_name, args, kwargs, policy)
        method = context.method_name
        if method == "__call__" and self.model.ep and (hit := self.model.ep.style_for(fqn)) is not None:
            return ep_call(self.model.ep.mesh_dim, fqn, typ, hit[1], next_fun, args, kwargs, self.ep_records)
        key = fqn if method == "__call__" else f"{fqn}.{method}"  # "embed.attend": a styled method
        if method not in ("__call__", *METHODS) or self.model.tp is None or (
                self.model.tp.style_for(key) is None and (typ not in KNOWN_LINEAR or method != "__call__")):
            return next_fun(*args, **kwargs)
        own = mod.variables.get("params", {})
        kp, pdef = jax.tree_util.tree_flatten_with_path(own)
        params = [(spath + "/" + path_str(k), v) for k, v in kp]
        if method == "attend":
            self._check_attend(key, params)

        lookup = method == "__call__" and typ == "Embed" and self.rows_cut(  # a vocabulary-cut Embed's lookup
            typ, [self.entry_for(p, v) for p, v in params], [p.split("/")[-1] for p, _ in params])

        def run_local(vals, a, k, zero_bias):
            tree = jax.tree_util.tree_unflatten(pdef, vals)
            if zero_bias and "bias" in tree:
                tree = {**tree, "bias": jnp.zeros_like(tree["bias"])}
            hit = self.model.tp.style_for(key)
            style = hit[1] if hit is not None else None
            if method == "attend":  # the tied head on this device's rows of the table: its vocabulary columns
                with self.bypassing():
                    return mod.clone(parent=None, num_embeddings=tree["embedding"].shape[0]).apply(
                        {"params": tree}, *a, method="attend", **k)
            if lookup:
                return self._embed_rows(tree["embedding"], a[0], getattr(mod, "dtype", None))
            attrs = {}
            if typ in ("Dense", "DenseGeneral", "Embed"):  # their width as their blocks have it
                attrs["features"] = self._local_features(typ, mod, tree)
            elif style is not None and isinstance(getattr(mod, "features", None), int) and self.features_cut(style, typ):
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

        self._one_body_trace(mod, spath)
        return self.around(key, typ, next_fun, args, kwargs, params, run_local)

    def _one_body_trace(self, mod, spath: str) -> None:
        """A styled module inside an ``nn.scan`` body: its records from the body's last trace alone. flax traces a
        scan's body twice (an abstract trace checking the loop invariants, then ``lax.scan``'s), each time in a new
        scope: a call seen in a new body scope drops the records of that scan's earlier trace."""
        scan = next((s for s, _ in self.plan.scans if spath.startswith(s + "/")), None)
        if scan is None:
            return
        body, depth = mod.scope, len(scan.split("/")) - len(self.prefix)
        while len(body.path) > depth and body.parent is not None:
            body = body.parent
        bodies = self.__dict__.setdefault("_scan_bodies", {})
        if scan in bodies and bodies[scan] is not body:
            self.records[:] = [r for r in self.records if not r["module"].replace(".", "/").startswith(scan + "/")]
        bodies[scan] = body  # kept alive: a freed scope's id may be another's

    def features_cut(self, style, typ: str) -> bool:
        """Whether the style computes its module's output cut on the features (``Shard(-1)``: column-parallel)."""
        local = style.output_layouts_for(typ)[0]
        return isinstance(local, Shard) and local.dim == -1

    def _check_attend(self, key: str, params) -> None:
        style = self.model.tp.style_for(key)[1]
        e = self.plan.entry(params[0][0]) if params else None
        if (not self.features_cut(style, "Embed") or e is None
                or (self.ti is not None and e.shard_dim(self.ti) != 0)):
            raise ValueError(
                f"parallelize_module: {style!r} on {key!r}: a tied output projection runs column-parallel on the "
                "vocabulary, the embedding table's rows: use ColwiseParallel(output_layouts=Replicate()) (or "
                f"Shard(-1)) on {key!r} with RowwiseParallel() (a vocabulary-cut lookup) or nothing on its module.")

    def _linen_unit(self, spath: str, path: tuple, mod, method: str, args, kwargs):
        variables = mod.variables
        params = variables.get("params", {})
        others = {k: v for k, v in variables.items() if k != "params"}
        kp, treedef = jax.tree_util.tree_flatten_with_path(params)
        entries = [self.entry_for(spath + "/" + path_str(k), x) for k, x in kp]
        shards = [x for _, x in kp]
        mine = [i for i, e in enumerate(entries) if e.unit == spath]
        arrays, rebuild = split_arrays((args, kwargs))
        clone = mod.clone(parent=None)
        policy = self.remat_policy(".".join(path))
        mutable = mutable_collections(mod, others)

        def apply(full, arrays):
            a, k = self.cast_inputs(rebuild(list(arrays)))
            with self.entered(spath, path, remat=policy is not None):
                return clone.apply({"params": jax.tree_util.tree_unflatten(treedef, full), **others}, *a,
                                   method=method, **k, **({"mutable": mutable} if mutable else {}))

        out = self.call_unit(self.gathering(apply, mine, entries, spath, policy), shards, arrays, policy)
        return put_back(mod, out) if mutable else out

    # --- nnx --------------------------------------------------------------------------------------
    def nnx_call(self, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict) -> Any:
        """A hooked nnx submodule's ``__call__`` (see ``spmd.parallel.styles._nnx``)."""
        spath = fqn.replace(".", "/")
        typ = type(sub).__name__
        if self.gather_units and spath in self.units and spath not in self.active:
            return self._nnx_unit(spath, sub, orig, args, kwargs)
        if not self.bypass and spath not in self.active and (policy := self.remat_policy(fqn)) is not None:
            return self.nnx_remat(spath, sub, orig, args, kwargs, policy)
        call = lambda *a, **k: orig(sub, *a, **k)  # noqa: E731
        if self.bypass or self.model.tp is None or (self.model.tp.style_for(fqn) is None and typ not in KNOWN_LINEAR):
            return call(*args, **kwargs)
        from spmd.parallel.styles._nnx import nnx_unit_params

        own = [(rel, v) for rel, v in nnx_unit_params(sub) if "/" not in rel]
        params = [(f"{spath}/{rel}/value", v[...]) for rel, v in own]

        rels = [rel for rel, _ in own]
        lookup = typ == "Embed" and self.rows_cut(  # a vocabulary-cut Embed's lookup
            typ, [self.entry_for(p, v) for p, v in params], rels)

        def run_local(vals, a, k, zero_bias):
            if lookup:
                return self._embed_rows(vals[rels.index("embedding")], a[0], getattr(sub, "dtype", None))
            from spmd.parallel.styles._nnx import with_values

            local = with_values(sub, {rel: jnp.zeros_like(x) if zero_bias and rel == "bias" else x
                                      for rel, x in zip(rels, vals)})
            with self.bypassing():
                return orig(local, *a, **k)

        return self.around(fqn, typ, call, args, kwargs, params, run_local)

    def _nnx_unit(self, spath: str, sub: Any, orig: Callable, args, kwargs):
        from spmd.parallel.styles._nnx import nnx_unit_params

        params = nnx_unit_params(sub)
        entries = [self.entry_for(f"{spath}/{rel}/value", v[...]) for rel, v in params]  # nnx.scan: one layer
        mine = [i for i, e in enumerate(entries) if e.unit == spath]
        arrays, rebuild = split_arrays((args, kwargs))

        from spmd.parallel.styles._nnx import with_values

        policy = self.remat_policy(spath.replace("/", "."))

        def apply(full, arrays):
            local = with_values(sub, {rel: x for (rel, _), x in zip(params, full)})
            with self.entered(spath, remat=policy is not None):
                a, k = self.cast_inputs(rebuild(list(arrays)))
                return orig(local, *a, **k)

        return self.call_unit(self.gathering(apply, mine, entries, spath, policy), [v[...] for _, v in params],
                              arrays, policy)


def _plus_zero(leaves: list, zero: Any, kinds: set | None = None) -> list:
    """``leaves`` plus ``zero`` (a scalar; None: ``leaves`` unchanged), added to the floating leaves, or to those
    whose ``(shape, dtype)`` is in ``kinds``."""
    if zero is None:
        return list(leaves)

    def tied(x) -> bool:
        return jnp.issubdtype(x.dtype, jnp.floating) if kinds is None else (tuple(np.shape(x)),
                                                                             jnp.dtype(x.dtype)) in kinds

    return [x + zero.astype(x.dtype) if tied(x) else x for x in leaves]

