"""The tensor-parallel half of the hooks: a styled module's call, on its tp blocks.

``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel`` modules run in a region manual over tp
(``jax.shard_map`` with ``axis_names={tp}``, nested in the step's region): each device computes the
module on its blocks of the parameters and of the input, and every tp collective of the style is written
out: a column-parallel input's all-gather over the sequence (sequence parallelism; its transpose, the
reduce-scatter, in the backward pass) or, for a whole input, the all-reduce of its gradient (the region's
transpose, Megatron's ``f``); a row-parallel output's all-reduce (Megatron's ``g``, with no backward
communication) or reduce-scatter over the sequence. ``PrepareModuleInput`` / ``PrepareModuleOutput``
are sharding constraints in global view. Outside these regions the model runs in global view over tp, so
its own code (reshapes by the global head count, grouped-query attention) sees global shapes.
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
from spmd.parallel.plan._param_plan import PlanEntry
from spmd.parallel.styles._styles import (KNOWN_EMBED, KNOWN_LINEAR, ColwiseParallel, RowwiseParallel, SequenceParallel,
                                   _kernel_dim)

__all__ = ["TPCalls", "COLWISE_MARK", "TP_COMM"]

COLWISE_MARK = "spmd.colwise|"  # checkpoint_name prefix on column-parallel outputs (the head-cut check reads it)
TP_COMM = "spmd.tp_comm"  # checkpoint_name of the tp collectives' results: a re-gathering unit keeps them
# (with the matmul outputs) and recomputes the rest, so its backward pass repeats no tp communication


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
    """Mixed into ``Hooks``: the layouts over tp. Needs ``model``, ``plan``, ``tp``, ``n_tp``, ``ti``,
    ``records`` and ``bypass`` from it."""

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
        return jax.shard_map(fn, mesh=self._region_mesh(), in_specs=specs, out_specs=specs,
                             axis_names={self.tp}, check_vma=False)(*leaves)

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
        return self._constrained(fqn, style, typ, call, args, kwargs)

    def _constrained(self, fqn, style, typ, call, args, kwargs):
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
        if (isinstance(given, Replicate) and isinstance(desired, Shard) and _is_array(y)
                and jnp.issubdtype(y.dtype, jnp.inexact)):  # a whole output cut: its gradient is gathered back
            self.records.append({"module": fqn, "style": type(style).__name__, "type": typ, "in_layout": None,
                                 "out_layout": desired, "in_bytes": 0, "out_bytes": int(np.prod(y.shape)) *
                                 jnp.dtype(y.dtype).itemsize, "input_grad": False, "summed_params": [],
                                 "input_id": None})
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
        if isinstance(x_layout, Shard) and np.shape(x)[x_layout.dim % np.ndim(x)] % self.n_tp:
            d = x_layout.dim % np.ndim(x)
            raise ValueError(
                f"parallelize_module: {type(style).__name__} on {fqn!r} takes its input cut on dim {d} (size "
                f"{np.shape(x)[d]}) over tp={self.n_tp}, which does not divide it; "
                + (f"under the weight-stationary layout (the batch cut over tp) use a batch per data replica and "
                   f"micro-batch that is a multiple of {self.n_tp}." if d == 0 else
                   f"under sequence parallelism use a sequence length that is a multiple of {self.n_tp}."))
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
                y = checkpoint_name(jax.lax.all_gather(y, tp, axis=y.ndim - col_back, tiled=True), TP_COMM)
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
        y = jax.shard_map(body, mesh=self._region_mesh(), in_specs=in_specs,
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
        # the input kept alive while these calls trace: a freed tracer's id may be given to another input, which
        # the table would then count as shared (one all-gather fewer than the program's)
        self.__dict__.setdefault("_inputs_alive", []).append(x)
        if isinstance(style, ColwiseParallel) and isinstance(out, Shard) and typ not in KNOWN_EMBED:
            y = checkpoint_name(y, f"{COLWISE_MARK}{fqn}|{self.n_tp}")
        return y

    def _region_mesh(self):
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

