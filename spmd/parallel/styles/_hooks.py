"""The hooks that run a model's submodules under their styles, the model's code unchanged.

The train step runs the user's ``loss_fn`` in one ``shard_map`` region that is *manual* over the data mesh
dims (``dp``, ``fsdp``: each device holds its batch rows and its parameter shards, and every collective
is ours, written out) and *automatic* (global view, GSPMD) over the tensor-parallel dim. ``Hooks``
intercepts every submodule call (linen: ``nn.intercept_methods``; nnx: the merged module's submodules are
wrapped in place), makes it a ``ModuleCall`` and hands it to the first style that applies to the module,
through the one protocol method every style has (``ParallelStyle.run_call``):

1. a ``fully_shard`` unit's ``FullyShardUnit`` (``spmd.parallel.styles._fully_shard``): its parameters
   gathered before it runs, their gradients reduce-scattered;
2. an activation-checkpointing unit's ``ActivationCheckpoint`` (``spmd.parallel.styles._remat``): the call
   under ``jax.checkpoint``;
3. the module's style on the ep dim (``ExpertParallel``, ``spmd.parallel.styles._experts``; a linen module's
   call): its tokens exchanged over ep with all_to_alls around the module's own code on its local experts;
4. else the module's tensor-parallel style, built-in or a user's: its layouts (``spmd.parallel.styles._tp_calls``),
   on its tp blocks in a region manual over tp, or in global view with its layouts as constraints.

A style runs the module's own code with ``call.apply``, which the hooks intercept again with that style
done, so the next one applies in turn (a checkpointed unit whose projections are tp-styled runs all three).

Why manual over the data dims and over tp in the styled regions, and global view elsewhere: in global view
XLA:CPU reduces a gradient with an all-reduce and a slice (twice the bytes of FSDP's reduce-scatter), and
turns a sequence-parallel reduce-scatter into the same; a collective over the data dims on a tp-sharded
operand makes XLA gather it over tp first; and in local view over tp the model would see local head counts
(torch users patch ``n_heads`` by hand). So: manual wherever a collective is the algorithm's, global view
where the model's own shapes must stay.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.plan._param_plan import ROOT, ParamPlan, PlanEntry, path_str
from spmd.parallel.plan._scan import scan_of, unstacked
from spmd.parallel.styles._experts import ExpertTensorParallel, apply_stored, run_on_ep, stored_params
from spmd.parallel.styles._remat import checkpoint_policy
from spmd.parallel.styles._styles import KNOWN_LINEAR, ParallelStyle
from spmd.parallel.styles._tp_calls import COLWISE_MARK, TP_COMM, WHOLE_MARK, TPCalls
from spmd.parallel.styles._transforms import METHODS, ParallelModule, param_module
from spmd.parallel.styles._weight_stationary import activation_cut_dim

__all__ = ["Hooks", "ModuleCall", "COLWISE_MARK", "WHOLE_MARK", "TP_COMM"]


class Hooks:
    """The styles of one ``ParallelModule`` and ``ParamPlan`` inside the train step's region (one trace).
    ``gather_units=False``: the units' parameters come gathered (accumulation, a pipeline's stage);
    ``whole_heads``: the projections run whole over tp, by module: their head count (``spmd.parallel.step._heads``);
    ``gather_flip``: the paths of the fsdp-cut 2-D parameters gathered transposed (``plan._shard.gather_unit``)."""

    # a module left out of a sequence-parallel plan, outside its blocks, runs whole over tp, its inputs gathered
    # (``TPCalls.run_whole``); a pipeline's stages (``pipelining._tp.StageHooks``) leave it to GSPMD
    whole_outside_blocks = True

    def __init__(self, model: ParallelModule, plan: ParamPlan, *, gather_units: bool = True,
                 whole_heads: dict | None = None, gather_flip: frozenset = frozenset()):
        self.model, self.plan = model, plan
        self.gather_flip = frozenset(gather_flip)
        self.whole_heads = dict(whole_heads or {})
        fsdp = model.fsdp
        self.fsdp = fsdp.shard_dim if fsdp else None
        self.fi = plan.mesh_dim_names.index(self.fsdp) if fsdp else None
        self.unit_style = fsdp.unit_style if fsdp else None
        self.units = set(plan.units) - {ROOT} if gather_units and fsdp else set()
        # the dim the plan cuts the activations on over tp (sequence parallel, weight-stationary): the re-gather
        # ties' zeros are summed on each device's block there (``_fully_shard._zero_from``), not over tp
        self.act_cut = activation_cut_dim(model.tp)
        self.prefix: tuple[str, ...] = ()
        self.active: dict[str, str] = {}  # module -> the layer of style running its call ("unit", "remat", "ep", "tp")
        self.in_remat: list[str] = []  # the checkpointed units being traced, outermost first
        self.records: list[dict] = []  # one per styled call over tp: the communication table's activation terms
        self.ep_records: list[dict] = []  # the calls styled on the ep dim (spmd.parallel.styles._experts)
        self.bypass = False
        # the step's hook around a call on a sequence cut over cp (``spmd.parallel.context._calls.ContextCalls``):
        # ``around(call, run)`` runs ``call`` (``run(call)``: its styles) its own way, or returns ``NotImplemented``
        self.around: Callable | None = None
        self.layouts = TPCalls(self)
        self.ti, self.island = self.layouts.ti, self.layouts.island

    def gather(self, leaves: Sequence[Any], entries: Sequence[PlanEntry]) -> list:
        """The full parameters of ``entries`` (the root unit's, or every unit's under accumulation)."""
        return self.unit_style.gather(self, leaves, entries) if self.unit_style else list(leaves)

    def entry_for(self, path: str, value: Any) -> PlanEntry:
        """The plan entry of ``path`` as a module sees ``value``: inside the scan that stacks it, one layer."""
        e = self.plan.entry(path)
        return unstacked(e) if e.stacked is not None and np.ndim(value) == len(e.shape) - 1 else e

    @functools.cached_property
    def blocks(self) -> tuple[str, ...]:
        """The plan's blocks: the children of the styled modules' deepest common ancestor that hold a styled module
        (a Llama's ``layers_0``, ``layers_1``; Hugging Face's ``transformer.h.0``, ...; one stack, ``layers``, holds
        the layers of an ``nn.scan``). The modules are those the plan's parameters belong to that a style on tp or
        ep runs (by its module's name, or a method's: ``embed.attend``)."""
        model, styled = self.model, set()
        for e in self.plan.entries:
            m = param_module(e.path)[0]
            keys = (m, *(f"{m}.{meth}" for meth in METHODS))
            if any((model.tp and model.tp.style_for(k)) or (model.ep and model.ep.style_for(k)) for k in keys):
                styled.add(m)
        if not styled:
            return ()
        paths = [m.split(".") if m else [] for m in styled]
        depth = 0
        while all(len(p) > depth for p in paths) and len({p[depth] for p in paths}) == 1:
            depth += 1
        if depth and scan_of("/".join(paths[0][:depth]), dict(self.plan.scans)) > 1:
            return (".".join(paths[0][:depth]),)  # the styled modules all in one nn.scan stack: it is the blocks
        return tuple(sorted({".".join(p[:depth + 1]) for p in paths}))

    # --- dispatch -----------------------------------------------------------------------------------
    def style_of(self, call: ModuleCall) -> ParallelStyle | None:
        """The first style to run ``call`` (its ``layer`` set): its unit's, else its checkpointing's, then its style
        on the ep dim (a linen module's call), else its tp style; none of a layer that already runs this module's
        call (``entered``) or one before it."""
        done = self.active.get(call.spath)
        if done is None and call.spath in self.units:
            call.layer = "unit"
            return self.unit_style
        if done is None and call.remat_policy is not None:
            call.layer = "remat"
            return self.model.remat.style
        on_ep = self.model.ep and (not isinstance(call, LinenCall) or call.method == "__call__")
        ep = self.model.ep.style_for(call.fqn) if on_ep else None
        if ep is not None:
            call.layer = "ep"
            return ep[1]
        hit = self.model.tp.style_for(call.tp_key) if self.model.tp and call.tp_key and done != "tp" else None
        call.layer = "tp"
        return hit[1] if hit else None

    def dispatch(self, call: ModuleCall) -> Any:
        """``call`` run by its first style (``style_of``); else, with tp, a known linear module left out of the plan
        runs whole over tp (``TPCalls.around``); else as it is."""
        if self.bypass:
            return call.next()
        if self.around is not None:
            out = self.around(call, self._styled)
            if out is not NotImplemented:
                return out
        return self._styled(call)

    def _styled(self, call: ModuleCall) -> Any:
        style = self.style_of(call)
        if style is not None:
            return call.returned(style.run_call(call))
        if self.model.tp and call.tp_key == call.fqn and self.active.get(call.spath) != "tp":
            if self.whole_outside_blocks and self.layouts.outside_blocks(call):
                return self.layouts.run_whole(call)  # sequence parallelism's boundary: whole over tp
            if call.typ in KNOWN_LINEAR:
                return call.with_layouts(None)
        return call.next()

    @contextlib.contextmanager
    def entered(self, spath: str, layer: str, path: tuple | None = None, remat: bool = False):
        """Inside module ``spath``'s own apply under a style of ``layer``: its call is not handed to that layer's
        style (or an earlier one's) again; linen: submodule paths under ``path``; ``remat``: checkpointed."""
        saved, had = self.prefix, self.active.get(spath)
        self.prefix = path if path is not None else saved
        self.active[spath] = layer
        if remat:
            self.in_remat.append(spath.replace("/", "."))
        try:
            yield
        finally:
            self.prefix = saved
            if had is None:
                del self.active[spath]
            else:
                self.active[spath] = had
            if remat:
                self.in_remat.pop()

    @contextlib.contextmanager
    def bypassing(self):
        """Module calls pass straight through (a styled module's own code on its local blocks)."""
        saved, self.bypass = self.bypass, True
        try:
            yield
        finally:
            self.bypass = saved

    # --- the frameworks' interception ---------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        import flax.linen as nn

        from spmd.parallel.styles._nnx import installing

        with nn.intercept_methods(self._linen), installing(self):
            yield

    def _linen(self, next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "setup" and self.model.ep and getattr(mod, "scope", None) is not None:
            # an expert-parallel module's setup declares its parameters on their local experts ([E / ep, ...])
            fqn = ".".join(self.prefix + tuple(str(p) for p in mod.scope.path))
            if self.model.ep.style_for(fqn) is not None:
                with stored_params(mod.scope):
                    return next_fun(*args, **kwargs)
        if context.method_name == "setup" or getattr(mod, "scope", None) is None or self.bypass:
            return next_fun(*args, **kwargs)
        return self.dispatch(LinenCall(self, mod, context.method_name, next_fun, args, kwargs))

    def nnx_call(self, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict) -> Any:
        """A hooked nnx submodule's ``__call__`` (see ``spmd.parallel.styles._nnx``)."""
        return self.dispatch(NnxCall(self, fqn, sub, orig, args, kwargs))


class ModuleCall:
    """One intercepted module call, as its style sees it: ``fqn`` (the module's dotted path), ``spath`` (its
    plan path), ``typ`` (its class name), ``args`` / ``kwargs``, ``hooks`` (the trace's ``Hooks``), and

    - ``params()``: the module's parameters (its submodules' too), ``[(plan path, value)]``;
    - ``apply(values, args, kwargs, remat=False)``: the module's own code on those parameter values, its
      calls intercepted again with the running style's layer done (a unit's or checkpointing's: both);
    - ``next(args=None, kwargs=None)``: the call as it goes on without a style (on other inputs, if given);
    - ``with_layouts(style)``: the call under a style's layouts (``ParallelStyle.run_call``'s default): over tp,
      or, a call of the ep layer, over ep (``spmd.parallel.styles._experts.run_on_ep``);
    - ``abstract(args, kwargs, how=jax.eval_shape)``: the call's output shapes on other inputs (``how``: another
      tracer of ``(f, args, kwargs)``), on the module's local parameters;
    - ``local_params()``: a context in which ``next`` runs the module on its parameters as this device holds them
      (a linen module's declared shapes not compared: its local experts, ``[E / ep, ...]``);
    - ``remat_policy``: the ``jax.checkpoint`` policy of its activation checkpointing (None: not a unit of it).
    """

    tp_key: str | None = None  # the key a tp plan styles it by ("embed.attend": a method)
    layer = "tp"  # the layer of the style running it: "unit", "remat", "ep" or "tp" (``Hooks.style_of``)

    def __init__(self, hooks: Hooks, fqn: str, typ: str, args: tuple, kwargs: dict):
        self.hooks, self.fqn, self.spath, self.typ = hooks, fqn, fqn.replace(".", "/"), typ
        self.args, self.kwargs = args, kwargs

    def returned(self, out: Any) -> Any:
        """What the call returns of its style's ``run_call`` result (a linen unit's updated collections put back)."""
        return out

    def local_params(self) -> Any:
        return contextlib.nullcontext()  # an nnx module reads its parameters' own shapes

    @functools.cached_property
    def remat_policy(self) -> Callable | None:
        remat = self.hooks.model.remat
        return checkpoint_policy(remat.policy) if remat and remat.matches(self.fqn) else None


class LinenCall(ModuleCall):
    def __init__(self, hooks: Hooks, mod, method: str, next_fun: Callable, args: tuple, kwargs: dict):
        self.path = hooks.prefix + tuple(str(p) for p in mod.scope.path)
        super().__init__(hooks, ".".join(self.path), type(mod).__name__, args, kwargs)
        self.spath = "/".join(self.path)
        self.mod, self.method, self.next_fun = mod, method, next_fun
        if method in ("__call__", *METHODS):
            self.tp_key = self.fqn if method == "__call__" else f"{self.fqn}.{method}"

    @functools.cached_property
    def _variables(self):
        variables = self.mod.variables
        kp, treedef = jax.tree_util.tree_flatten_with_path(variables.get("params", {}))
        others = {k: v for k, v in variables.items() if k != "params"}
        # the collections its caller may update (``batch_stats`` under ``apply(..., mutable=["batch_stats"])``):
        # the module applied as a function of its variables returns their updates, put back by ``returned``
        # and the ones it made mutable with nothing in them yet (``mutable=["intermediates"]``: what the module
        # sows inside the unit reaches the caller's state as it does without the style)
        mutable = [c for c in others if self.mod.is_mutable_collection(c)]
        declared = self.mod.scope.mutable
        declared = [declared] if isinstance(declared, str) else declared if isinstance(declared, (list, tuple)) else (
            ["intermediates"] if declared is True else [])
        mutable += [c for c in declared if isinstance(c, str) and c not in mutable and c != "params"]
        return kp, treedef, others, self.mod.clone(parent=None), mutable

    def params(self) -> list:
        return [(self.spath + "/" + path_str(k), v) for k, v in self._variables[0]]

    def local_params(self) -> Any:
        return stored_params(self.mod.scope)

    def abstract(self, args: tuple, kwargs: dict, how: Callable = jax.eval_shape) -> Any:
        """The module's shapes out on ``args`` (``jax.eval_shape``: nothing runs; ``how``: another tracer of ``(f, args,
        kwargs)``, ``jax.make_jaxpr``'s for its program), on its local parameters: a copy applied as a function of its variables (a bound module's method
        runs once per call of its parent)."""
        import flax.linen as nn

        kp, treedef, others, clone, _ = self._variables
        values = jax.tree_util.tree_unflatten(treedef, [v for _, v in kp])

        def local(next_fun, a, k, context):
            scope = getattr(context.module, "scope", None)
            if scope is not None and not scope.path:
                with stored_params(scope):
                    return next_fun(*a, **k)
            return next_fun(*a, **k)

        with nn.intercept_methods(local), self.hooks.bypassing():
            return how(lambda a, k: clone.apply({"params": values, **others}, *a, method=self.method, **k), args, kwargs)

    def apply(self, values: list, args: tuple, kwargs: dict, *, remat: bool = False) -> Any:
        _, treedef, others, clone, mutable = self._variables
        self.applied = True
        with self.hooks.entered(self.spath, self.layer, self.path, remat=remat):
            return clone.apply({"params": jax.tree_util.tree_unflatten(treedef, values), **others}, *args,
                               method=self.method, **kwargs, **({"mutable": mutable} if mutable else {}))

    def returned(self, out: Any) -> Any:
        """``out = (y, updates)`` of an ``apply`` with mutable collections: each update written into the module's
        own variables (as if it had run in place, outside any trace the style opened); ``y``."""
        if not (getattr(self, "applied", False) and self._variables[4]):
            return out
        y, updates = out
        for col, tree in updates.items():
            for name, value in tree.items():
                self.mod.put_variable(col, name, value)
        return y

    def next(self, args: tuple | None = None, kwargs: dict | None = None) -> Any:
        return self.next_fun(*(self.args if args is None else args), **(self.kwargs if kwargs is None else kwargs))

    def with_layouts(self, style: ParallelStyle | None) -> Any:
        if self.layer == "ep":  # a style on the ep dim: its layouts over ep (one all_to_all each way)
            return run_on_ep(style, self)
        hooks, tpc = self.hooks, self.hooks.layouts
        mod, method, typ, key, fqn = self.mod, self.method, self.typ, self.tp_key, self.fqn
        pdef = self._variables[1]
        params = self.params()
        if method == "attend":
            tpc.check_attend(style, key, params)
        if isinstance(style, ExpertTensorParallel) and self.args:
            style.check_input(fqn, {p.split("/")[-1]: np.shape(v) for p, v in params}, self.args[0])
        lookup = method == "__call__" and typ == "Embed" and tpc.rows_cut(  # a vocabulary-cut Embed's lookup
            typ, [hooks.entry_for(p, v) for p, v in params], [p.split("/")[-1] for p, _ in params])

        def run_local(vals, a, k, zero_bias):
            tree = jax.tree_util.tree_unflatten(pdef, vals)
            if zero_bias and "bias" in tree:
                tree = {**tree, "bias": jnp.zeros_like(tree["bias"])}
            if method == "attend":  # the tied head on this device's rows of the table: its vocabulary columns
                with hooks.bypassing():
                    return mod.clone(parent=None, num_embeddings=tree["embedding"].shape[0]).apply(
                        {"params": tree}, *a, method="attend", **k)
            if lookup:
                return tpc.embed_rows(tree["embedding"], a[0], getattr(mod, "dtype", None))
            if isinstance(style, ExpertTensorParallel):  # the experts' tp blocks ([E, d, f / tp]) where it declares f
                with hooks.bypassing():
                    return apply_stored(mod.clone(parent=None), tree, a, k)
            attrs = {}
            if typ in ("Dense", "DenseGeneral", "Embed"):  # their width as their blocks have it
                attrs["features"] = tpc.local_features(typ, mod, tree)
            elif style is not None and isinstance(getattr(mod, "features", None), int) and tpc.features_cut(style, typ):
                attrs["features"] = mod.features // tpc.n_tp  # a module type of its own (FlaxConv1D): its width
            import flax.errors

            try:
                with hooks.bypassing():
                    return mod.clone(parent=None, **attrs).apply({"params": tree}, *a, **k)
            except flax.errors.ScopeParamShapeError as err:
                raise ValueError(
                    f"parallelize_module: {type(style).__name__} on {fqn!r} ({typ}): the module checks its "
                    f"parameter shapes against its own attributes, and its code does not run on its tp blocks "
                    f"({err}). Give it a 'features' attribute, use a known type ({', '.join(KNOWN_LINEAR)}), or "
                    "leave it out of the plan.") from None

        self._one_body_trace()
        return tpc.around(style, key, typ, self.next_fun, self.args, self.kwargs, params, run_local)

    def _one_body_trace(self) -> None:
        """A styled module inside an ``nn.scan`` body: its records from the body's last trace alone. flax traces a
        scan's body twice (an abstract trace checking the loop invariants, then ``lax.scan``'s), each time in a new
        scope: a call seen in a new body scope drops the records of that scan's earlier trace."""
        hooks, spath = self.hooks, self.spath
        scan = next((s for s, _ in hooks.plan.scans if spath.startswith(s + "/")), None)
        if scan is None:
            return
        body, depth = self.mod.scope, len(scan.split("/")) - len(hooks.prefix)
        while len(body.path) > depth and body.parent is not None:
            body = body.parent
        bodies = hooks.__dict__.setdefault("_scan_bodies", {})
        if scan in bodies and bodies[scan] is not body:  # (the cut's entry, seen in the first trace alone, kept)
            hooks.records[:] = [r for r in hooks.records if r.get("boundary")
                                or not r["module"].replace(".", "/").startswith(scan + "/")]
        bodies[scan] = body  # kept alive: a freed scope's id may be another's


class NnxCall(ModuleCall):
    def __init__(self, hooks: Hooks, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict):
        super().__init__(hooks, fqn, type(sub).__name__, args, kwargs)
        self.sub, self.orig, self.tp_key = sub, orig, fqn

    @functools.cached_property
    def _params(self) -> list:
        from spmd.parallel.styles._nnx import nnx_unit_params

        return nnx_unit_params(self.sub)

    def params(self) -> list:
        return [(f"{self.spath}/{rel}/value", v[...]) for rel, v in self._params]

    def apply(self, values: list, args: tuple, kwargs: dict, *, remat: bool = False) -> Any:
        """The module's own code on a copy holding ``values``; what it sows (``nnx.Intermediate``) comes out with
        its output, ``(y, sown values)``, as does a BatchNorm's update of its ``nnx.BatchStat`` statistics, for
        ``returned`` to put back on the module (the copy runs inside the
        style's transforms, where the module cannot be written)."""
        from flax import nnx

        from spmd.parallel.styles._nnx import with_values

        local = with_values(self.sub, {rel: x for (rel, _), x in zip(self._params, values)})
        with self.hooks.entered(self.spath, self.layer, remat=remat):
            y = self.orig(local, *args, **kwargs)
        sown = [(tuple(path), v.get_value() if hasattr(v, "get_value") else v.value)
                for path, v in nnx.iter_graph(local) if isinstance(v, (nnx.Intermediate, nnx.BatchStat))]
        self.sown_paths = [path for path, _ in sown]
        return (y, [v for _, v in sown]) if sown else y

    def returned(self, out: Any) -> Any:
        """``out = (y, sown values)`` of an ``apply`` whose copy sowed: each value set on the module (as if it had
        run in place); ``y``."""
        from flax import nnx

        paths = getattr(self, "sown_paths", None)
        if not paths:
            return out
        y, values = out
        for path, value in zip(paths, values):
            owner = self.sub
            for key in path[:-1]:
                owner = getattr(owner, key) if isinstance(key, str) else owner[key]
            have = getattr(owner, path[-1], None)
            if isinstance(have, nnx.BatchStat):  # a BatchNorm's running statistics, updated on the copy
                have[...] = value
            elif isinstance(have, nnx.Intermediate):
                have.value = value
            else:
                setattr(owner, path[-1], nnx.Intermediate(value))
        return y

    def abstract(self, args: tuple, kwargs: dict, how: Callable = jax.eval_shape) -> Any:
        """The module's shapes out on ``args`` (``jax.eval_shape``: nothing runs; ``how``: another tracer of ``(f, args,
        kwargs)``, ``jax.make_jaxpr``'s for its program)."""
        with self.hooks.bypassing():
            return how(lambda a, k: self.orig(self.sub, *a, **k), args, kwargs)

    def next(self, args: tuple | None = None, kwargs: dict | None = None) -> Any:
        return self.orig(self.sub, *(self.args if args is None else args),
                         **(self.kwargs if kwargs is None else kwargs))

    def with_layouts(self, style: ParallelStyle | None) -> Any:
        from spmd.parallel.styles._nnx import with_values

        if self.layer == "ep":  # a style on the ep dim: its layouts over ep (one all_to_all each way)
            return run_on_ep(style, self)
        hooks, tpc, sub, orig, typ = self.hooks, self.hooks.layouts, self.sub, self.orig, self.typ
        own = [(rel, v) for rel, v in self._params if "/" not in rel]
        params = [(f"{self.spath}/{rel}/value", v[...]) for rel, v in own]
        rels = [rel for rel, _ in own]
        lookup = typ == "Embed" and tpc.rows_cut(  # a vocabulary-cut Embed's lookup
            typ, [hooks.entry_for(p, v) for p, v in params], rels)

        def run_local(vals, a, k, zero_bias):
            if lookup:
                return tpc.embed_rows(vals[rels.index("embedding")], a[0], getattr(sub, "dtype", None))
            local = with_values(sub, {rel: jnp.zeros_like(x) if zero_bias and rel == "bias" else x
                                      for rel, x in zip(rels, vals)})
            with hooks.bypassing():
                return orig(local, *a, **k)

        return tpc.around(style, self.fqn, typ, lambda *a, **k: orig(sub, *a, **k), self.args, self.kwargs, params,
                          run_local)
