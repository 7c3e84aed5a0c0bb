"""A tensor-parallel style's layouts around its module's call (``TPCalls``, what ``ParallelStyle.run_call`` runs
by default), on the module's tp blocks.

A style that ``runs_on_blocks`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, a user's
own) runs its module in a region manual over tp (``jax.shard_map`` with ``axis_names={tp}``, nested in the
step's region): each device computes the module on its blocks of the parameters and of the input, and
every tp collective between the style's layouts is written out: an input arriving ``Shard(d)`` and needed
``Replicate`` is all-gathered (sequence parallelism; its transpose, the reduce-scatter, in the backward
pass); a whole floating input has its gradient all-reduced (the region's transpose, Megatron's ``f``); a
``Partial`` output is all-reduced (Megatron's ``g``, with no backward communication) or reduce-scattered;
a cut output wanted ``Replicate`` is all-gathered. Other styles (``PrepareModuleInput`` /
``PrepareModuleOutput``) are sharding constraints in global view. Outside these regions the model runs in global view over tp, so
its own code (reshapes by the global head count, grouped-query attention) sees global shapes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from placements import Partial, Replicate, Shard
from spmd.parallel.plan._param_plan import PlanEntry
from spmd.parallel.plan._scan import scan_of
from spmd.parallel.styles._styles import CP_DIM, KNOWN_LINEAR

__all__ = ["TPCalls", "COLWISE_MARK", "WHOLE_MARK", "TP_COMM"]

COLWISE_MARK = "spmd.colwise|"  # checkpoint_name prefix on column-parallel outputs (the head-cut check reads it)
WHOLE_MARK = "spmd.whole|"  # ... and on the outputs of projections whole over tp (left out of the plan)
TP_COMM = "spmd.tp_comm"  # checkpoint_name of the tp collectives' results: a re-gathering unit and every
# checkpointing policy but "full" keep them (spmd.parallel.styles._remat), so their backward pass repeats no tp
# communication; "full" keeps the unit's inputs alone and runs them again (torch's full AC)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
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



class TPCalls:
    """The layouts over tp of one traced step: a tensor-parallel style's call on its blocks or in global view,
    and the regions manual over tp that the parameters' own collectives run in (``island``). ``hooks``: the
    ``Hooks`` it serves, to whose ``records`` it adds one per styled call (the communication table's
    activation terms)."""

    def __init__(self, hooks: Any):
        model, plan = hooks.model, hooks.plan
        self.hooks, self.model, self.plan = hooks, model, plan
        self.tp = model.tp.mesh_dim if model.tp else None
        self.ti = plan.mesh_dim_names.index(self.tp) if self.tp else None
        self.n_tp = model.mesh.size(self.tp) if self.tp else 1
        # a step whose mesh cuts the batch's sequence (dim 1) over cp: a sequence-parallel layout (Shard(1) over
        # tp) cuts each device's cp block of the sequence over tp, so dim 1 is over (cp, tp), cp-major
        names = plan.mesh_dim_names
        self.cp = CP_DIM if CP_DIM in names and plan.mesh_shape[names.index(CP_DIM)] > 1 else None
        self._inputs: dict[int, Any] = {}  # the inputs recorded by id, kept alive: see ``_input_id``
        # sequence parallelism's boundary (``run_whole``): the outputs of the modules run whole outside the plan's
        # blocks (by id, kept alive), the whole inputs whose entry into the cut is counted, whether a value cut
        # on the sequence has been handed on yet, and the depth of the whole modules being run
        self._whole: dict[int, Any] = {}
        self._whole_cut: set[int] = set()
        self._cut_seen = False
        self._whole_depth = 0

    def _input_id(self, x: Any) -> int:
        """``id(x)``, a record's ``input_id`` (the table counts one all-gather per input however many modules read
        it), with ``x`` kept alive while the step traces: a freed tracer's id may be given to another input, which
        would then count as the same one (one all-gather fewer than the program's)."""
        self._inputs[id(x)] = x
        return id(x)

    def tp_cut(self, e: PlanEntry) -> bool:
        return self.ti is not None and isinstance(e.placements[self.ti], Shard)

    def constrain(self, x: Any, layout: Any, seq: bool = False) -> Any:
        """``x`` laid out as ``layout`` (``Shard(d)`` / ``Replicate()``) over tp: a sharding constraint; ``seq``: an
        activation whose sequence (dim 1) stays cut over cp (else a ``Replicate()`` would gather it over cp too)."""
        if self.tp is None or layout is None or isinstance(layout, Partial) or not _is_array(x) or not hasattr(x, "ndim"):
            return x
        if isinstance(layout, Shard) and not -x.ndim <= layout.dim < x.ndim:
            return x
        if isinstance(layout, Shard) and x.ndim >= 3 and layout.dim % x.ndim == 1:
            self._cut_seen = True  # an activation cut on the sequence
        spec = self.layout_spec(layout, x.ndim, seq=seq or self._seq_cut(layout, x.ndim))
        if jax.sharding.get_abstract_mesh().empty:  # no enclosing region (a mesh of tp alone): the model's mesh
            return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.model.mesh.jax_mesh, spec))
        return jax.lax.with_sharding_constraint(x, spec)

    def layout_spec(self, layout: Any, ndim: int, seq: bool = False) -> P:
        """The ``PartitionSpec`` over tp of a ``Shard(d)`` / ``Replicate()`` layout of a rank-``ndim`` array; ``seq``
        (a ``[batch, seq, ...]`` activation in a region manual over cp too): its sequence over cp, then tp."""
        spec: list = [None] * ndim
        if isinstance(layout, Shard):
            spec[layout.dim % ndim] = self.tp
        if seq and ndim >= 2:
            spec[1] = (self.cp, self.tp) if spec[1] == self.tp else self.cp
        return P(*spec)

    def _seq_cut(self, layout: Any, ndim: int) -> bool:
        """A sequence-parallel layout under cp: ``Shard(1)`` over tp of an activation whose dim 1 is cut over cp."""
        return self.cp is not None and isinstance(layout, Shard) and ndim >= 2 and layout.dim % ndim == 1

    def tp_spec(self, e: PlanEntry, ndim: int) -> P:
        return self.layout_spec(e.placements[self.ti] if self.ti is not None else None, ndim)

    def island(self, fn: Callable, entries: Sequence[PlanEntry], leaves: Sequence[Any]):
        """``fn(*leaves)`` in a region manual over tp too (each leaf's tp block), or as it is without tp."""
        if self.tp is None:
            return fn(*leaves)
        specs = tuple(self.tp_spec(e, np.ndim(x)) for e, x in zip(entries, leaves))
        return jax.shard_map(fn, mesh=self.region_mesh(), in_specs=specs, out_specs=specs,
                             axis_names={self.tp}, check_vma=False)(*leaves)

    def around(self, style: Any, fqn: str, typ: str, call: Callable, args: tuple, kwargs: dict, params=(),
               run_local=None) -> Any:
        """``style``'s layouts around ``call(*args, **kwargs)`` of module ``fqn`` (a type ``typ``; ``style`` None:
        a known linear module left out of the plan, run whole).

        ``params``: the module's own ``(plan path, value)`` pairs; ``run_local(values, args, kwargs,
        zero_bias)``: the module's computation on this device's tp blocks of them."""
        records = self.hooks.records
        first = len(records)
        if fqn in self.hooks.whole_heads:
            y = self._whole_call(fqn, typ, style, call, args, kwargs, params, run_local)
        elif style is None:
            y = call(*args, **kwargs)
            if typ in KNOWN_LINEAR and _is_array(y) and jnp.issubdtype(y.dtype, jnp.inexact) and np.ndim(y) >= 2:
                y = checkpoint_name(y, f"{WHOLE_MARK}{fqn}|{self.n_tp}")  # split into heads? (the step asks)
        elif style.runs_on_blocks() and args and _is_array(args[0]):
            y = self._island_call(fqn, typ, style, params, run_local, args, kwargs)
        else:
            y = self._constrained(fqn, style, typ, call, args, kwargs)
        for r in records[first:]:  # a module inside an nn.scan runs (and communicates) once per layer
            if not r.get("boundary"):  # ... but the blocks' input enters the cut once, before the loop
                r["calls"] = scan_of(fqn.replace(".", "/"), dict(self.plan.scans))
        return y

    def _constrained(self, fqn, style, typ, call, args, kwargs):
        given, desired = style.input_layouts_for(typ)
        args = list(args)
        if given is not None or desired is not None:
            gs = given if isinstance(given, (tuple, list)) else (given,)
            ds = desired if isinstance(desired, (tuple, list)) else (desired,)
            for i, (g, d) in enumerate(zip(gs, ds)):
                if i < len(args):
                    self._record_gather(fqn, style, typ, args[i], g, d)
                    args[i] = self.constrain(self.constrain(args[i], g), d)
        kg, kd = style.kwarg_layouts()
        kwargs = dict(kwargs)
        for k in set(kg) | set(kd):
            if k in kwargs:
                self._record_gather(fqn, style, typ, kwargs[k], kg.get(k), kd.get(k))
                kwargs[k] = self.constrain(self.constrain(kwargs[k], kg.get(k)), kd.get(k))
        y = call(*args, **kwargs)
        given, desired = style.output_layouts_for(typ)
        if (isinstance(given, Replicate) and isinstance(desired, Shard) and _is_array(y)
                and jnp.issubdtype(y.dtype, jnp.inexact)):  # a whole output cut: its gradient is gathered back
            self.hooks.records.append({
                "module": fqn, "style": type(style).__name__, "type": typ, "region": False, "in_layout": None,
                "in_desired": None, "local_out": given, "out_layout": desired, "in_bytes": 0,
                "out_bytes": int(np.prod(y.shape)) * jnp.dtype(y.dtype).itemsize, "input_grad": False,
                "summed_params": [], "input_id": None})
        if isinstance(y, (tuple, list)) and isinstance(desired, (tuple, list)):
            gs = given if isinstance(given, (tuple, list)) else (given,) * len(desired)
            return type(y)(self.constrain(self.constrain(v, g), d) for v, g, d in zip(y, gs, desired))
        if isinstance(y, (tuple, list)) and y:
            return type(y)([self.constrain(self.constrain(y[0], given), desired), *y[1:]])
        return self.constrain(self.constrain(y, given), desired)

    def _record_gather(self, fqn, style, typ, x, given, desired):
        """An input arriving cut (``Shard``) and needed whole (``Replicate``) in global view (``PrepareModuleInput``
        before a module run whole: a tied head after sequence parallelism): an all-gather forward, one per module
        reading it (XLA does not merge the gathers of q, k and v reading one input); its gradient, whole on each
        device, is sliced back (no collective). One module called twice on one input (Hugging Face's GPT-Neo runs
        its ``ln_f`` twice, the first result unused): one gather."""
        key = self._input_id(x)
        if any(r["module"] == fqn and r.get("gathered_input") and r["input_id"] == key for r in self.hooks.records):
            return
        if (isinstance(given, Shard) and isinstance(desired, Replicate) and _is_array(x)
                and jnp.issubdtype(x.dtype, jnp.inexact)):
            self.hooks.records.append({
                "module": fqn, "style": type(style).__name__, "type": typ, "region": False, "in_layout": given,
                "in_desired": desired, "local_out": None, "out_layout": None, "gathered_input": True,
                "in_bytes": int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize, "out_bytes": 0,
                "input_grad": False, "summed_params": [], "input_id": key})

    def _island_call(self, fqn, typ, style, params, run_local, args, kwargs):
        """The styled module on this device's tp blocks, in a region manual over tp: every tp collective
        between the style's layouts written out (Megatron's f and g; sequence parallelism's all-gather /
        reduce-scatter)."""
        tp = self.tp
        x, rest = args[0], tuple(args[1:])
        paths = [p for p, _ in params]
        ents = [self.hooks.entry_for(p, v) for p, v in params]  # under nn.scan: one layer's (its tp cut, one dim less)
        vals = [v for _, v in params]
        names = [p[:-len("/value")].split("/")[-1] if p.endswith("/value") else p.split("/")[-1] for p in paths]
        # the style may refuse the module's type (a kernel layout it does not know): ask it once, with the type
        style.param_placements(fqn, {n: tuple(np.shape(v)) for n, v in zip(names, vals)}, typ)
        given, desired = style.input_layouts_for(typ)
        given, desired = (v[0] if isinstance(v, (tuple, list)) else v for v in (given, desired))
        x_layout = given if given is not None else Replicate()  # the input's block as it enters the region
        # inside a module run on the sequence gathered over cp (and tp: sequence parallelism beside cp), the
        # sequence is whole: a style's Shard(1) of it is read as Replicate (Megatron's plan without sp there)
        ctx = getattr(self.hooks, "context", None)
        whole_seq = self.cp is not None and ctx is not None and ctx.in_gathered()
        if whole_seq and self._seq_cut(x_layout, np.ndim(x)):
            x_layout = Replicate()
        # the input the module's computation reads: a cut one is read as it arrives where a cut one is needed
        need = x_layout if desired is None or (isinstance(desired, Shard) and isinstance(x_layout, Shard)) else desired
        kern = next((e for e, n in zip(ents, names) if n in ("kernel", "embedding")), None)
        kern_cut = kern is not None and self.ti is not None and kern.shard_dim(self.ti) is not None
        # ... on the same dim; or, needed Shard(-1) by a module whose kernel is cut, on the features where the
        # kernel's rows are (a DenseGeneral's heads)
        if (isinstance(x_layout, Shard) and isinstance(desired, Shard) and not (desired.dim == -1 and kern_cut)
                and x_layout.dim % np.ndim(x) != desired.dim % np.ndim(x)):
            raise ValueError(
                f"parallelize_module: {type(style).__name__} on {fqn!r} takes its input (of shape {np.shape(x)}) as it "
                f"arrives, {x_layout!r}, but its computation needs it {desired!r}: a redistribute from one cut to "
                "another (an all-to-all) is not written by a style. Make the style need the layout the input "
                f"arrives in ({x_layout!r}) or Replicate() (an all-gather), or have the module before it hand its "
                f"output on as {desired!r}.")
        gather_in = x_layout.dim if isinstance(x_layout, Shard) and isinstance(need, Replicate) else None
        slice_in = need.dim if isinstance(x_layout, Replicate) and isinstance(need, Shard) else None
        local, out = style.output_layouts_for(typ)
        local = local if local is not None else Replicate()
        out = out if out is not None else local
        if whole_seq and isinstance(out, Shard) and out.dim == 1 and not isinstance(local, Shard):
            out = Replicate()  # the sequence whole (above): the partial sum all-reduced, not reduce-scattered
        if isinstance(x_layout, Shard) and np.shape(x)[x_layout.dim % np.ndim(x)] % self.n_tp:
            d = x_layout.dim % np.ndim(x)
            raise ValueError(
                f"parallelize_module: {type(style).__name__} on {fqn!r} takes its input cut on dim {d} (size "
                f"{np.shape(x)[d]}) over tp={self.n_tp}, which does not divide it; "
                + (f"under the weight-stationary layout (the batch cut over tp) use a batch per data replica and "
                   f"micro-batch that is a multiple of {self.n_tp}." if d == 0 else
                   f"under sequence parallelism use a sequence length that is a multiple of {self.n_tp}."))
        partial = isinstance(local, Partial)
        bias_after = partial and "bias" in names  # a partial sum's bias: added once, after the reduction
        bias_outside = bias_after and not isinstance(out, Shard)  # whole output: every rank's bias gradient is whole
        # an output cut on its features (Shard(-1)) is cut where its kernel is: the kernel's output axes end the
        # output's dims (Dense (in, out): the last; DenseGeneral (D, 3, H, hd) cut on the heads (dim=2): the third
        # from the end; other types: the last)
        col_back = len(kern.shape) - kern.shard_dim(self.ti) if kern_cut and typ in KNOWN_LINEAR else 1
        x_bytes = int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize  # x is global over tp here

        def resolve(layout, ndim):
            if isinstance(layout, Shard) and layout.dim == -1:
                return Shard(ndim - col_back)
            return Shard(layout.dim % ndim) if isinstance(layout, Shard) else layout

        def body(vals, x):
            if gather_in is not None:
                x = checkpoint_name(jax.lax.all_gather(x, tp, axis=gather_in % x.ndim, tiled=True), TP_COMM)
            elif slice_in is not None:
                x = self._local_slice(x, slice_in % x.ndim)
            y = run_local(list(vals), (x, *rest), kwargs, bias_after)
            if partial:
                if isinstance(out, Shard):
                    y = jax.lax.psum_scatter(y, tp, scatter_dimension=out.dim % y.ndim, tiled=True)
                else:
                    y = _reduce_forward(y, tp, self.n_tp)
                y = checkpoint_name(y, TP_COMM)
                if bias_after and not bias_outside:
                    y = y + vals[names.index("bias")].astype(y.dtype)
            elif isinstance(local, Shard) and not isinstance(out, Shard):
                y = checkpoint_name(jax.lax.all_gather(y, tp, axis=resolve(local, y.ndim).dim, tiled=True),
                                    TP_COMM)
            elif isinstance(local, Replicate) and isinstance(out, Shard):
                y = self._local_slice(y, out.dim % y.ndim)
            return y

        local_vals = [jax.ShapeDtypeStruct(self._local_shape(e, np.shape(v)), v.dtype) for e, v in zip(ents, vals)]
        local_x = jax.ShapeDtypeStruct(self._local_layout_shape(need, np.shape(x)), x.dtype)
        if self.rows_cut(typ, ents, names) and not jnp.issubdtype(x.dtype, jnp.inexact):
            # a vocabulary-parallel lookup reads the tp rank: no shape to evaluate outside the region
            ndim = np.ndim(x) + 1
        else:
            ndim = len(jax.eval_shape(lambda v, x: run_local(list(v), (x, *rest), kwargs, bias_after), local_vals,
                                      local_x).shape)
        if (not partial and isinstance(local, Shard) and isinstance(out, Shard)
                and resolve(local, ndim).dim != resolve(out, ndim).dim):
            raise ValueError(
                f"parallelize_module: {type(style).__name__} on {fqn!r} computes its output cut on dim "
                f"{resolve(local, ndim).dim} ({local!r}) and hands it on as {out!r} (dim {resolve(out, ndim).dim} of "
                f"{ndim}): a redistribute from one cut to another (an all-to-all) is not written by a style. Hand it "
                f"on as it is computed ({local!r}) or Replicate() (an all-gather).")
        if partial:
            out_layout = out
        elif isinstance(local, Shard):
            out_layout = resolve(local, ndim) if isinstance(out, Shard) else Replicate()
        else:
            out_layout = out
        # sequence parallelism under cp: the region manual over cp too, each device's (cp, tp) block of the sequence
        # (in global view over cp its tp collectives would span the whole sequence, gathered over cp first)
        seq = self._seq_cut(x_layout, x.ndim) or self._seq_cut(out_layout, ndim)
        # ... and a module taking the [batch, seq, ...] sequence whole over tp (Megatron's f), where the step read
        # that input's sequence from the program (``ContextCalls.cut_seq``): its region is manual over cp too
        seq = seq or (self.cp is not None and ctx is not None and ndim >= 2 and not isinstance(x_layout, Shard)
                      and ctx.cut_seq(x))
        in_specs = (tuple(self.tp_spec(e, np.ndim(v)) for e, v in zip(ents, vals)),
                    self.layout_spec(x_layout, x.ndim, seq))
        y = jax.shard_map(body, mesh=self.region_mesh(), in_specs=in_specs,
                          out_specs=self.layout_spec(out_layout, ndim, seq), axis_names={tp} | ({self.cp} if seq else set()),
                          check_vma=False)(tuple(vals), x)
        if bias_outside:
            y = y + vals[names.index("bias")].astype(y.dtype)
        if seq and ctx is not None and self._seq_cut(out_layout, ndim):
            ctx.note_sp_cut(y)  # handed on cut over cp and tp: a gathered module gathers it over both
        self._entered_cut(fqn, style, typ, x, x_layout)
        if isinstance(out_layout, Shard) and ndim >= 3 and out_layout.dim % ndim == 1:
            self._cut_seen = True
        # every parameter whole over tp read in the region has its gradient all-reduced (the region's transpose)
        summed = [int(np.prod(np.shape(v))) * jnp.dtype(v.dtype).itemsize for e, n, v in zip(ents, names, vals)
                  if e.shard_dim(self.ti) is None and not (n == "bias" and bias_outside)]
        self.hooks.records.append({
            "module": fqn, "style": type(style).__name__, "type": typ, "region": True, "in_layout": x_layout,
            "in_desired": need, "local_out": local, "out_layout": out,
            "in_bytes": x_bytes, "out_bytes": int(np.prod(y.shape)) * jnp.dtype(y.dtype).itemsize,
            # (a region manual over cp too sums them over cp and tp at once: the step's reduction over cp, counted
            # with it, spmd.parallel.context._calls.with_context)
            "input_grad": bool(jnp.issubdtype(x.dtype, jnp.inexact)), "summed_params": [] if seq else summed,
            "whole_seq": whole_seq,  # inside a module run on the sequence gathered over cp: whole-sequence bytes
            # modules reading one input (q, k, v) share its sequence all-gather (XLA merges them)
            "input_id": self._input_id(x)})
        if isinstance(local, Shard) and local.dim == -1 and isinstance(out, Shard) and "embedding" not in names:
            y = checkpoint_name(y, f"{COLWISE_MARK}{fqn}|{self.n_tp}")  # an output cut on its features (heads)
        return y

    # --- sequence parallelism's boundary: the modules outside the plan's blocks, whole over tp ---------------
    def outside_blocks(self, call: Any) -> bool:
        """Whether ``call`` (a module no style runs) is one that sequence parallelism leaves whole over tp: under a
        plan cutting the activations on the sequence (not beside cp), a module holding parameters, no styled
        module among them, outside the plan's blocks (``Hooks.blocks``: a decoder's embedding, final norm and head
        left out of the plan)."""
        if self.hooks.act_cut != 1 or self.cp is not None or self.tp is None:
            return False
        fqn = call.fqn
        if self._whole_depth or not fqn or not self.hooks.blocks:
            return self._whole_depth > 0 and bool(fqn)
        under = lambda a, b: a == b or a.startswith(b + ".")  # noqa: E731
        if any(under(fqn, b) or under(b, fqn) for b in self.hooks.blocks):
            return False
        return bool(call.params())

    def run_whole(self, call: Any) -> Any:
        """A module outside the plan's blocks (``outside_blocks``) run whole over tp, as on one device: each floating
        input cut on the sequence is all-gathered (forward; its gradient is sliced back), every floating output is
        whole (a region of the blocks taking it cut slices it: its gradient all-gathered back, ``_entered_cut``).
        Left to GSPMD, the cut would run on through the module (its parameters' gradients summed over tp: a
        head's ``V x D``, where the gather moves the activation) and into an embedding's lookup (its ids
        gathered too in the backward pass). The modules it calls run inside it as they are."""
        if self._whole_depth:
            return call.next()
        arrays, rebuild = split_arrays((call.args, call.kwargs))
        ins = []
        for x in arrays:
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact) and np.ndim(x) >= 3:
                if self._cut_seen and self._whole.get(id(x)) is not x:  # cut by the blocks: gathered here
                    self.hooks.records.append({
                        "module": call.fqn, "style": "whole outside the plan", "type": call.typ, "region": False,
                        "in_layout": Shard(1), "in_desired": Replicate(), "local_out": None, "out_layout": None,
                        "gathered_input": True, "in_bytes": int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize,
                        "out_bytes": 0, "input_grad": False, "summed_params": [], "input_id": self._input_id(x)})
                x = self.constrain(x, Replicate())
            ins.append(x)
        args, kwargs = rebuild(ins)
        self._whole_depth += 1
        try:
            y = call.next(args, kwargs)
        finally:
            self._whole_depth -= 1
        outs, rebuild_out = split_arrays(y)
        outs = [self.constrain(v, Replicate()) if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact)
                and np.ndim(v) >= 3 else v for v in outs]
        for v in outs:
            self._whole[id(v)] = v
        return rebuild_out(outs)

    def _entered_cut(self, fqn, style, typ, x, x_layout) -> None:
        """A region taking ``x`` cut on the sequence where ``x`` is whole (the output of a module run whole outside
        the plan's blocks, or, before anything was cut, a value the model's own code made of them: an embedding
        plus positions): its slice (no communication), whose gradient, summed over the modules reading it, is
        all-gathered once in the backward pass."""
        if not (isinstance(x_layout, Shard) and np.ndim(x) >= 3 and x_layout.dim % np.ndim(x) == 1
                and jnp.issubdtype(x.dtype, jnp.inexact)):
            return
        whole = self._whole.get(id(x)) is x or (bool(self._whole) and not self._cut_seen)
        if not whole or id(x) in self._whole_cut:
            return
        self._whole_cut.add(self._input_id(x))
        self.hooks.records.append({
            "module": fqn, "style": type(style).__name__, "type": typ, "region": False, "in_layout": None,
            "in_desired": None, "local_out": Replicate(), "out_layout": Shard(1), "in_bytes": 0,
            "out_bytes": int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize, "input_grad": False,
            "summed_params": [], "input_id": None, "boundary": True})

    def _whole_call(self, fqn, typ, style, call, args, kwargs, params, run_local):
        """A projection whose heads are fewer than the tp size (``whole_heads``; ``spmd.parallel.step._heads``)
        run whole over tp, in global view: its parameters cut over tp gathered whole (an all-gather each, kept
        for the backward pass), a sequence-cut input too (its gradient sliced back), its output whole on every
        device (each device reads the heads its query heads use) and its output's gradient made whole (the
        devices sharing a head sum their parts: an all-reduce within each group, then an all-gather across the
        groups when there are several heads)."""
        heads = self.hooks.whole_heads[fqn]
        if style is not None:
            given = style.input_layouts_for(typ)[0]
            given = given[0] if isinstance(given, (tuple, list)) else given
            if isinstance(given, Shard) and given.dim % np.ndim(args[0]) != 1:
                raise ValueError(
                    f"parallelize_module: {type(style).__name__} on {fqn!r} takes its input cut ({given!r}: the "
                    f"weight-stationary layout's batch cut), and its output is split into {heads} heads, fewer than "
                    f"tp={self.n_tp}: such a projection runs whole over tp on its whole input, which this layout "
                    "never gathers. Use a tp size that its heads divide by, or a layout without the batch cut "
                    "(Megatron's, or sequence parallelism).")
        ents = [self.hooks.entry_for(p, v) for p, v in params]
        vals = [v for _, v in params]
        cut = [self.tp_cut(e) for e in ents]
        given = style.input_layouts_for(typ)[0] if style is not None else None
        given = given[0] if isinstance(given, (tuple, list)) else given
        x0 = args[0] if args else None
        # under cp, an input holding the sequence cut over cp (read from the program, or sequence parallelism's
        # Shard(1)): its input and output stay cut over cp, whole over tp (not gathered over cp too)
        ctx = getattr(self.hooks, "context", None)
        seq = (self.cp is not None and ctx is not None and _is_array(x0) and np.ndim(x0) >= 2
               and not ctx.in_gathered() and (self._seq_cut(given, np.ndim(x0)) or ctx.cut_seq(x0)))
        if isinstance(given, Shard):  # a sequence-cut input: gathered whole (GSPMD; its gradient sliced back)
            args = (checkpoint_name(self.constrain(self.constrain(x0, given), Replicate(), seq), TP_COMM), *args[1:])
        if any(cut):
            vals = [checkpoint_name(self._gather_whole(v, e), TP_COMM) if c else v for v, e, c in zip(vals, ents, cut)]
            y = run_local(vals, args, kwargs, False)
        else:
            with self.hooks.bypassing():
                y = call(*args, **kwargs)
        y = self.constrain(y, Replicate(), seq and np.ndim(y) >= 2)  # and its gradient: summed over the devices
        # sharing a head
        x = args[0] if args else None
        self.hooks.records.append({
            "module": fqn, "style": type(style).__name__ if style is not None else "whole over tp", "type": typ,
            "region": False, "in_layout": given if isinstance(given, Shard) else Replicate(),
            "in_desired": Replicate(), "local_out": Replicate(),
            "out_layout": Replicate(),
            "in_bytes": int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize if _is_array(x) else 0,
            "out_bytes": int(np.prod(y.shape)) * jnp.dtype(y.dtype).itemsize, "input_grad": False,
            "summed_params": [], "input_id": self._input_id(x0), "whole_heads": heads, "n_tp": self.n_tp,
            "gathered_params": [int(np.prod(np.shape(v))) * jnp.dtype(v.dtype).itemsize
                                for v, c in zip(vals, cut) if c]})
        return y

    def _gather_whole(self, v: jax.Array, e: PlanEntry) -> jax.Array:
        """A parameter cut over tp gathered whole (an all-gather). Under cp its gradient, summed over cp (each
        device's positions' part), is taken back to its tp block first: the reduction over cp is of the block
        (left to GSPMD, the whole gradient's constraint sums the whole over cp, then slices it)."""
        if self.cp is None:
            return self.constrain(v, Replicate())
        whole, block = self.layout_spec(Replicate(), v.ndim), self.tp_spec(e, v.ndim)
        mesh = self.model.mesh.jax_mesh if jax.sharding.get_abstract_mesh().empty else None

        def wsc(x, spec):
            return jax.lax.with_sharding_constraint(x, spec if mesh is None else jax.sharding.NamedSharding(mesh, spec))

        @jax.custom_vjp
        def gather(x):
            return wsc(x, whole)

        gather.defvjp(lambda x: (wsc(x, whole), None), lambda _, g: (wsc(g, block),))
        return gather(v)

    def features_cut(self, style, typ: str) -> bool:
        """Whether the style computes its module's output cut on the features (``Shard(-1)``: column-parallel)."""
        local = style.output_layouts_for(typ)[0]
        return isinstance(local, Shard) and local.dim == -1

    def check_attend(self, style, key: str, params) -> None:
        """A styled ``Embed.attend`` (a tied output projection) is column-parallel on a table cut on its rows."""
        e = self.plan.entry(params[0][0]) if params else None
        if (not self.features_cut(style, "Embed") or e is None
                or (self.ti is not None and e.shard_dim(self.ti) != 0)):
            raise ValueError(
                f"parallelize_module: {style!r} on {key!r}: a tied output projection runs column-parallel on the "
                "vocabulary, the embedding table's rows: use ColwiseParallel(output_layouts=Replicate()) (or "
                f"Shard(-1)) on {key!r} with RowwiseParallel() (a vocabulary-cut lookup) or nothing on its module.")

    def rows_cut(self, typ: str, ents: Sequence[PlanEntry], names: Sequence[str]) -> bool:
        """Whether an ``Embed``'s table is cut on its rows (the vocabulary) over tp: a vocabulary-parallel lookup."""
        return (typ == "Embed" and "embedding" in names and self.ti is not None
                and ents[list(names).index("embedding")].shard_dim(self.ti) == 0)

    def _local_slice(self, x: jax.Array, d: int) -> jax.Array:
        """This device's ``Shard(d)`` block of a whole ``x`` (no communication)."""
        size = x.shape[d] // self.n_tp
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.tp) * size, size, axis=d)

    def region_mesh(self):
        """The enclosing region's mesh; the model's own when there is none (a mesh of tp alone)."""
        mesh = jax.sharding.get_abstract_mesh()
        return mesh if not mesh.empty else self.model.mesh.jax_mesh

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

    def local_features(self, typ: str, mod, tree) -> Any:
        if typ == "Embed":
            return tree["embedding"].shape[-1]
        if typ == "Dense":
            return tree["kernel"].shape[-1]
        feats = mod.features if isinstance(mod.features, tuple) else (mod.features,)
        return tuple(tree["kernel"].shape[-len(feats):]) if isinstance(mod.features, tuple) else tree["kernel"].shape[-1]

    def embed_rows(self, table, ids, dtype):
        """A vocabulary-parallel lookup on this device's rows: the rows it holds, zeros elsewhere (summed after)."""
        vc = table.shape[0]
        local = ids - jax.lax.axis_index(self.tp) * vc
        ok = (local >= 0) & (local < vc)
        e = jnp.take(table, jnp.clip(local, 0, vc - 1), axis=0)
        e = jnp.where(ok[..., None], e, jnp.zeros((), e.dtype))
        return e.astype(dtype) if dtype is not None else e

