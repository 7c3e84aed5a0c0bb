"""One plan's step program (``_build``): the manual region over the data dims that runs the user's loss on
each device's rows with the layouts' gathers, reduces the gradients (with accumulation, once), applies the
optimizer in global view, and reads what the communication table needs off the traced step (``prepare``:
the model's heads over tp, the gathers to transpose, the sequence over cp)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements import Shard
from spmd.parallel.context._calls import CALL_SCOPE, ContextCalls, experts_routers, scopes_of, with_context
from spmd.parallel.context._seq import batch_seq, seq_inputs
from spmd.parallel.cost._comm import step_communication
from spmd.parallel.cost._recompute import EXTRA, SYNC_BN, dead_gathers, recomputed_collectives, regathered
from spmd.parallel.plan._param_plan import ROOT, ParamPlan
from spmd.parallel.step._batch_norm import sync_batch_norm, sync_nnx_batch_norm
from spmd.parallel.step._finite import _keep_finite
from spmd.parallel.step._grad_layout import (equal_grads, gathered_dot_grads, out_cut_gathers, reduced_once,
                                             transposed_dot_grads, zero_grads)
from spmd.parallel.step._heads import (check_whole_sequence, dot_params, head_splits, lookup_cotangents,
                                       positional_params, side_params, whole_over_tp,
                                       whole_sequence_products)
from spmd.parallel.step._loss_io import _as_arrays, _split_loss, _split_stats
from spmd.parallel.step._model_checks import check_batch as _check_batch
from spmd.parallel.step._state import TrainState, state_shardings
from spmd.parallel.step._vocab import check_vocab_gathers, vocab_reductions, vocab_terms
from spmd.parallel.styles._experts import with_experts
from spmd.parallel.styles._hooks import Hooks
from spmd.parallel.styles._nnx import is_nnx, nnx_loss
from spmd.parallel.styles._transforms import ParallelModule


class _Built:
    """One plan's compiled step (``_build``): ``jitted`` (the jax.jit: after ``prepare``, the one whose trace
    ``prepare`` read, where that trace is the step's), ``plan``, ``run(state, batch)`` (the batch checked, then
    the jitted step) and ``communication(state, batch)`` (the analytic table)."""

    def __init__(self, jitted: list, plan: ParamPlan, run: Callable, communication: Callable,
                 prepare: Callable):
        self._jitted, self.plan, self._run, self.communication = jitted, plan, run, communication
        self.prepare = prepare  # (state, batch): read the model's heads once, before the step is traced

    @property
    def jitted(self) -> Callable:
        return self._jitted[0]

    def __call__(self, state: TrainState, batch: Any):
        return self._run(state, batch)


class _AsWritten:
    """Hooks that run each nnx submodule's call as written: the loss traced as on one device."""

    def nnx_call(self, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict) -> Any:
        return orig(sub, *args, **kwargs)


def _placed(base: list, idx: list[int], values) -> list:
    """``base`` with ``values`` at the positions ``idx``."""
    out = list(base)
    for i, v in zip(idx, values):
        out[i] = v
    return out


def _build(pm: ParallelModule, loss_fn: Callable, optimizer, accum_steps: int, plan: ParamPlan,
           keep_finite: bool = False, batch_norm: str = "broadcast", donate: bool = False) -> "_Built":
    mesh = pm.mesh
    jit = functools.partial(jax.jit, donate_argnums=(0,) if donate else ())  # donate: the state's buffers reused
    names = mesh.mesh_dim_names
    sizes = dict(zip(names, mesh.shape))
    tp = pm.tp.mesh_dim if pm.tp else None
    cp = pm.cp
    n_cp = sizes[cp] if cp else 1
    seq_dims = (cp, tp) if cp and tp and n_cp > 1 else None  # a recomputed tp collective's sequence cut over cp
    data = pm.data_dims
    n_data = int(np.prod([sizes[d] for d in data])) if data else 1
    fsdp = pm.fsdp.shard_dim if pm.fsdp else None
    fi = names.index(fsdp) if fsdp else None
    n_fsdp = sizes[fsdp] if fsdp else 1
    entries = plan.entries
    # each parameter's gradient: divided by the data dims it is cut over (fsdp's reduce-scatter and ep's
    # all-to-alls sum over them), then averaged over the rest
    cut_over = [tuple(d for d in data if e.shard_dim(names.index(d)) is not None) for e in entries]
    nnx_model = is_nnx(pm.module)

    def manual_spec(e) -> P:
        spec: list[list[str]] = [[] for _ in e.shape]
        for n, p in zip(names, e.placements):
            if n not in (tp, cp) and isinstance(p, Shard):
                spec[p.dim].append(n)
        return P(*[None if not s else (s[0] if len(s) == 1 else tuple(s)) for s in spec])

    param_specs = jax.tree_util.tree_unflatten(plan.treedef, [manual_spec(e) for e in entries])
    batch_spec = P(data if len(data) > 1 else (data[0] if data else None))

    def unflat(ls):
        return jax.tree_util.tree_unflatten(plan.treedef, ls)

    def run_loss(hooks: Hooks, params_tree, mb, stats=None):
        """``(loss, (aux, new batch_stats))``."""
        if stats is not None and nnx_model:  # loss_fn(model, batch); its BatchNorms update their statistics
            bn_calls.clear()
            prep = sync_nnx_batch_norm(data, bn_calls) if batch_norm == "sync" and data else None
            with hooks.installed(), _context(mb, hooks):
                out, new = nnx_loss(pm.module, loss_fn, params_tree, mb, hooks, stats=stats, prepare=prep)
            loss, aux = _split_loss(out, "make_train_step")
            return loss, (aux, new)
        if stats is not None:
            import flax.linen as nn

            bn_calls.clear()
            sync = nn.intercept_methods(sync_batch_norm(data, bn_calls)) if batch_norm == "sync" and data else \
                contextlib.nullcontext()
            with hooks.installed(), sync, _context(mb, hooks):
                out, new = _split_stats(loss_fn(params_tree, stats, mb), stats, "make_train_step")
            loss, aux = _split_loss(out, "make_train_step")
            return loss, (aux, new)
        with hooks.installed(), _context(mb, hooks):
            out = nnx_loss(pm.module, loss_fn, params_tree, mb, hooks) if nnx_model else loss_fn(params_tree, mb)
        loss, aux = _split_loss(out, "make_train_step")
        return loss, (aux, None)

    attention: list = []  # the attention calls of one micro-batch over cp (filled when the step is traced)

    # (prepare) the parameters added to the sequence row by row; the modules run on the sequence gathered over cp
    positional, whole_seq, seq_of, dotted, cotangents, routers = set(), set(), {}, set(), {}, set()
    side: dict = {}  # "params": the parameters computed on batch vectors whole over cp only, "joins": the bytes of
    # each broadcast of such a value into the sequence (``_heads.side_params``)

    seq_cuts: dict = {}  # (batch tree, leaves' shapes past dim 0) -> (sequence length, the leaves cut over cp)

    def seq_of_batch(batch, stats=None) -> tuple[int, tuple[bool, ...]]:
        """Under cp: the batch's sequence length and which leaves hold it on dim 1 (cut over cp), read from the
        program (``spmd.parallel.context._seq.batch_seq``: ``loss_fn`` traced on one device's view, shapes only,
        with them at fewer positions), not from their size: a ``[batch, d]`` input with ``d`` equal to the
        sequence length, or of another width, stays whole over cp. Refused where it is ambiguous."""
        leaves, tree = jax.tree.flatten(batch)
        key = (tree, tuple((tuple(np.shape(x)[1:]), jnp.result_type(x)) for x in leaves))
        if key not in seq_cuts:
            logical = unflat([jax.ShapeDtypeStruct(e.shape, e.dtype) for e in entries])
            held = None if stats is None else jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), stats)

            def trace(b):
                if nnx_model:
                    return jax.eval_shape(lambda p, b: nnx_loss(pm.module, loss_fn, p, b, _AsWritten()), logical, b)
                if held is not None:
                    return jax.eval_shape(loss_fn, logical, held, b)
                return jax.eval_shape(loss_fn, logical, b)

            seq_cuts[key] = batch_seq(trace, jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), batch), n_cp)
        return seq_cuts[key]

    def _context(mb, hooks):
        if cp is None:
            return contextlib.nullcontext()
        calls = ContextCalls(mesh.jax_mesh, n_cp, seq_of_batch(mb)[0], cp, gathered=frozenset(whole_seq),
                             tp=(tp, sizes[tp]) if tp else None, seq_of=seq_of, routers=frozenset(routers))
        hooks.around, hooks.context = calls.around, calls
        attention.clear()
        attention.append(calls)
        return calls.installed()

    def gathered(hooks: Hooks, leaves, units):
        out = list(leaves)
        for u in units:
            idx = [i for i, e in enumerate(entries) if e.unit == u]
            for i, y in zip(idx, hooks.gather([leaves[i] for i in idx], [entries[i] for i in idx])):
                out[i] = y
        return out

    def reduce(hooks: Hooks, g: list, flip: list, zero: list) -> list:
        """The gradients averaged over the data dims; a ``flip`` one reduced transposed, a ``zero`` one (zero
        by construction) not at all (``_grad_layout``)."""
        g = list(g)
        kinds = list(dict.fromkeys(cut_over))
        groups = [([i for i in range(len(g)) if cut_over[i] == k and not zero[i]], tuple(d for d in data if d not in k),
                   int(np.prod([sizes[d] for d in k]))) for k in kinds]
        for idx, axes, scale in groups:
            if not idx:
                continue
            if scale != 1:
                for i in idx:
                    g[i] = g[i] / scale
            if axes and int(np.prod([sizes[a] for a in axes])) > 1:
                def mean(*xs, fl=[flip[i] for i in idx], axes=axes):  # on each device's blocks
                    ys = lax.pmean([x.T if f else x for x, f in zip(xs, fl)], axes)
                    return tuple(y.T if f else y for y, f in zip(ys, fl))

                red = hooks.island(mean, [entries[i] for i in idx], [g[i] for i in idx])
                for i, y in zip(idx, red):
                    g[i] = y
        return g

    def local_grads(params, batch, stats):
        leaves = jax.tree_util.tree_leaves(params)
        hooks = Hooks(pm, plan, whole_heads=whole, gather_flip=frozenset(gather_flip))
        new_stats = None
        if accum_steps == 1:
            def loss_of(ls):
                return run_loss(hooks, unflat(gathered(hooks, ls, [ROOT])), batch, stats)

            loss, backward, (aux, new_stats) = jax.vjp(loss_of, leaves, has_aux=True)
            seed = jnp.ones_like(loss)  # jax.grad's
            closed = jax.make_jaxpr(backward)(seed)
            flip, zero = transposed_dot_grads(closed), zero_grads(closed)
            merged[:] = reduced_once(equal_grads(closed), entries, zero, cut_over)
            if fsdp is not None and not gather_flip:  # the first trace (prepare's): which to gather transposed
                found.clear()
                found.extend(e.path for e, f in zip(entries, gathered_dot_grads(closed)) if f)
            (g,) = backward(seed)
            recomputed.clear()
            recomputed.append(recomputed_collectives(closed, sizes, axis=fsdp, seq=seq_dims))
            rec_dims.clear()
            rec_dims.update(recomputed_collectives(closed, sizes, axis=fsdp, by_dims=True, seq=seq_dims))
            recomputed.append(recomputed_collectives(closed, sizes, scope=SYNC_BN))
            again = pm.fsdp is not None and pm.fsdp.reshard_after_forward  # the units' re-gathers the gradients read
            recomputed.append(regathered(closed, sizes, fsdp) if again else None)
            if new_stats is not None and data:
                if batch_norm == "broadcast":  # data rank 0's statistics, on every rank (DDP's broadcast_buffers)
                    first = functools.reduce(jnp.logical_and, [lax.axis_index(d) == 0 for d in data])
                    new_stats = lax.psum(jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x)), new_stats),
                                         data)
                # "sync": equal on every rank already (each BatchNorm's moments were averaged over the data dims)
        else:
            plain = Hooks(pm, plan, gather_units=False, whole_heads=whole)
            # one micro-batch traced alone, for the carry's shapes
            records = Hooks(pm, plan, gather_units=False, whole_heads=whole)
            n_local = jax.tree.leaves(batch)[0].shape[0]
            micro = jax.tree.map(lambda x: x.reshape(accum_steps, n_local // accum_steps, *x.shape[1:]), batch)
            grad_fn = jax.value_and_grad(lambda ls, mb: run_loss(plain, unflat(ls), mb), has_aux=True)
            # one micro-batch's backward pass, traced alone on the gathered parameters' shapes: the carry's
            # shapes, the gradient-layout rule (a flagged gradient accumulates as its dot's output, transposed,
            # and is reduced so) and the gradients zero by construction (neither accumulated nor reduced)
            full_shapes = jax.eval_shape(lambda ls: gathered(hooks, ls, plan.units), leaves)
            closed = jax.make_jaxpr(lambda ls, mb: jax.value_and_grad(
                lambda l: run_loss(Hooks(pm, plan, gather_units=False, whole_heads=whole), unflat(l), mb),
                has_aux=True)(ls)[1])(full_shapes, jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro))
            flip, zero = transposed_dot_grads(closed), zero_grads(closed)
            merged.clear()  # each micro-batch's gradients accumulate in a loop carry of their own
            on_scatter = [any(e.shard_dim(names.index(d)) is not None for d in data) for e in entries]
            flip = [f and not c for f, c in zip(flip, on_scatter)]  # a dp-reduced gradient only (reduce's)
            live = [i for i, z in enumerate(zero) if not z]  # the zero-gradient ones gathered as constants
            full, scatter = jax.vjp(lambda xs: gathered(hooks, _placed(leaves, live, xs), plan.units),
                                    [leaves[i] for i in live])

            def one(carry, mb):
                (value, aux_mb), gr = grad_fn(full, mb)
                gr = [gr[i].T if flip[i] else gr[i] for i in live]
                return jax.tree.map(jnp.add, carry, ((value, aux_mb), gr)), None

            shapes = jax.eval_shape(jax.value_and_grad(lambda ls, mb: run_loss(records, unflat(ls), mb), has_aux=True),
                                    full, jax.tree.map(lambda x: x[0], micro))
            shapes = (shapes[0], [jax.ShapeDtypeStruct(shapes[1][i].shape[::-1], shapes[1][i].dtype) if flip[i]
                                  else shapes[1][i] for i in live])
            init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            ((loss, (aux, _)), gf), _ = lax.scan(one, init, micro)
            loss, aux = jax.tree.map(lambda x: x / accum_steps, (loss, aux))
            (g_live,) = scatter(_placed([jnp.zeros(x.shape, x.dtype) for x in full_shapes], live,
                                        [(x.T if flip[i] else x) / accum_steps for i, x in zip(live, gf)]))
            g = _placed([jnp.zeros_like(x) for x in leaves], live, g_live)
            recomputed.clear()  # a checkpoint's recomputation, once per micro-batch
            recomputed.append({k: {f: accum_steps * n for f, n in v.items()}
                               for k, v in recomputed_collectives(closed, sizes, axis=fsdp, seq=seq_dims).items()})
            rec_dims.clear()
            by = recomputed_collectives(closed, sizes, axis=fsdp, by_dims=True, seq=seq_dims)
            rec_dims.update({d: {k: {f: accum_steps * n for f, n in v.items()} for k, v in t.items()}
                             for d, t in by.items()})
        g = reduce(hooks, g, flip, zero)
        zeros.clear()
        zeros.extend(e.path for e, z in zip(entries, zero) if z)
        metrics = {"loss": loss, **aux}
        if data:
            metrics = jax.tree.map(lambda m: lax.pmean(m, data), metrics)
        traced.clear()
        traced.extend(records.records if accum_steps > 1 else hooks.records)
        ep_traced.clear()
        ep_traced.extend(records.ep_records if accum_steps > 1 else hooks.ep_records)
        return unflat(g), metrics, new_stats

    zeros: list = []  # the paths of the parameters whose gradient is zero by construction (filled when traced)
    merged: list = []  # the paths of the parameters whose gradient is an earlier one's (reduced_once; when traced)
    # the fsdp-cut parameters gathered transposed: known from the plan (_grad_layout.output_cut), else read off the
    # backward pass once (_grad_layout.gathered_dot_grads)
    gather_flip: set = set(out_cut_gathers(plan, fsdp))
    found: list = []  # what a trace without them found
    dead: list = []  # the units' all-gathers nothing reads, {"count", "bytes"} (filled by communication)
    recomputed: list = []  # the collectives a checkpoint's recomputation runs again, and the backward pass's
    # all-reduces of SyncBatchNorm's statistics (filled when traced)
    rec_dims: dict = {}  # the first of them by the mesh dims they run over ("tp": a checkpointed unit's tp ones)
    bn_calls: list = []  # the forward all-reduces of SyncBatchNorm's statistics, bytes each (filled when traced)
    vocab: list = []  # the loss's reductions over a column-parallel output's cut features (read by prepare)
    whole: dict = {}  # the projections run whole over tp: {module: heads}, read from the traced step (prepare)
    ep_traced: list = []  # the calls styled on the ep dim, of one micro-batch
    traced: list = []  # the styled calls of one micro-batch, (module, style, input bytes, output bytes): the
    # activation terms of the communication table (filled when the step is traced)

    def region(params, batch, stats):
        if not data:
            return local_grads(params, batch, stats)
        return jax.shard_map(local_grads, mesh=mesh.jax_mesh, in_specs=(param_specs, batch_spec, P()),
                             out_specs=(param_specs, P(), P()), axis_names=set(data), check_vma=False)(
            params, batch, stats)

    def step(state: TrainState, batch: Any):
        if cp is not None:  # the sequence (dim 1 of the leaves that hold it) cut over cp, the batch over the data dims
            leaves, tree = jax.tree.flatten(batch)
            cut = seq_of_batch(batch, state.batch_stats)[1]
            batch = jax.tree.unflatten(tree, [lax.with_sharding_constraint(x, NamedSharding(mesh.jax_mesh, P(
                batch_spec[0], *((cp,) if c else ())))) for x, c in zip(leaves, cut)])
        grads, metrics, stats = region(state.params, batch, state.batch_stats)
        if stats is not None:
            stats = jax.lax.with_sharding_constraint(stats, NamedSharding(mesh.jax_mesh, P()))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # the state leaves the step laid out as it came in (XLA may otherwise pick another sharding for an
        # optimizer moment, and the next call would compile the step again)
        p_sh, o_sh = state_shardings(plan, mesh, params, opt_state, optimizer)
        new = TrainState(step=state.step + 1, params=jax.lax.with_sharding_constraint(params, p_sh),
                         opt_state=jax.lax.with_sharding_constraint(opt_state, o_sh), plan=state.plan,
                         batch_stats=stats)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return _keep_finite(state, new, metrics) if keep_finite else (new, metrics)

    jitted = [jit(step)]  # the step's jit; prepare's probe where its trace is the step's (read by _Built)
    checked = []

    def prepare(state: TrainState, batch: Any) -> None:
        """Once, before the step is traced for good: which fsdp gathers to transpose (``_grad_layout``) and where
        the model splits a tp-cut projection into heads (``spmd.parallel.step._heads``): a cut that would split a
        head is refused, and a projection with fewer heads than the tp size runs whole over tp. Both are read off
        one trace of the step (the heads are marked on the projections' outputs, which a gather's layout does not
        change); where neither changes the step, that trace is the step's (its jit is kept: the call, the table
        and ``lower`` reuse it), else the step is traced again with them."""
        if not checked:
            flips = fsdp is not None and accum_steps == 1 and plan.out_cut is None  # which gathers to transpose
            if flips or tp is not None:
                # a function of its own: jax caches a trace by function, and a changed step must be traced again
                probe = jit(lambda s, b: step(s, b))
                jaxpr = probe.trace(state, batch).jaxpr.jaxpr
                if tp is not None:  # the loss's reductions over a column-parallel output's cut (``_vocab``)
                    vocab[:] = vocab_reductions(jaxpr, tp)
                    if cp is not None and n_cp > 1 and data:
                        check_vocab_gathers(vocab, {d: sizes[d] for d in (*data, cp, tp)})
                new = set(found) - gather_flip if flips else set()
                heads = whole_over_tp(head_splits(jaxpr)) if tp is not None else {}
                if new or heads:
                    gather_flip.update(new)
                    whole.update(heads)
                    traced.clear()
                else:  # the probe's trace is the step's: its records stand
                    jitted[0] = probe
            if cp is not None and n_cp > 1:
                _find_gathered(state, batch)
                jitted[0] = jit(step)  # the step with what it found, traced afresh
            checked.append(True)

    def _find_gathered(state: TrainState, batch: Any) -> None:
        """A model's own attention (scores over the whole cut sequence): the innermost submodule computing it that
        takes the [batch, seq, ...] sequence runs on it gathered over cp (``ContextCalls.around``), else refused."""
        t, cut = seq_of_batch(batch, state.batch_stats)
        jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(state, batch).jaxpr  # the state's step, then the parameters
        positional.update(entries[i].path for i in positional_params(jaxpr, jaxpr.invars[1:1 + len(entries)], t))
        dotted.update(entries[i].path for i in dot_params(jaxpr, jaxpr.invars[1:1 + len(entries)]))
        cotangents.update(lookup_cotangents(jaxpr, scopes_of))
        leaves = list(zip(jaxpr.invars[len(jaxpr.invars) - len(cut):], cut))  # the batch's, cut over cp or not
        found, joins = side_params(jaxpr, jaxpr.invars[1:1 + len(entries)], [v for v, c in leaves if c], t,
                                   [v for v, c in leaves if not c])
        side.update(params={entries[i].path for i in found}, joins=joins)
        seen, products = attention[0].seen if attention else {}, whole_sequence_products(jaxpr, t)
        products = [p for p in products if CALL_SCOPE not in p[1]]
        if (products or ep_traced or tp is not None) and attention:  # tp: its styles' inputs (TPCalls)
            seen = seq_inputs(lambda b: (jax.make_jaxpr(lambda s, b: step(s, b))(state, b), attention[0])[1],
                              attention[0], batch, t, n_cp, seq_of, cut)
        for _, stack in products:
            mods = [m for m in scopes_of(stack) if m and seen.get(m)]  # a submodule: not the model itself
            if mods and not any(m in whole_seq for m in mods):
                whole_seq.add(mods[-1])
        routers.update(experts_routers(seen, ep_traced))  # an MoE's routing over the sequence: gathered
        whole_seq.update(routers)
        if products:  # traced again with the gathers; what is left is refused
            jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(state, batch).jaxpr
            check_whole_sequence(jaxpr, t, n_cp, lambda stack: CALL_SCOPE in stack
                                 or any(m in whole_seq for m in scopes_of(stack)))
        traced.clear()

    def run(state: TrainState, batch: Any):
        batch = _as_arrays(batch)
        _check_batch(batch, n_data, accum_steps, data, sizes)
        if cp is not None:
            seq_of_batch(batch, state.batch_stats)  # refused here, before anything is compiled, where ambiguous
        prepare(state, batch)
        return jitted[0](state, batch)

    def communication(state: TrainState, batch: Any) -> dict:
        batch = _as_arrays(batch)
        _check_batch(batch, n_data, accum_steps, data, sizes)  # as the call: refused by name, not by a reshape
        prepare(state, batch)
        if fsdp is not None and not dead:  # the units' gathers nothing reads (XLA drops them): traced once
            dead.append(dead_gathers(jitted[0].trace(state, batch).jaxpr, fsdp))  # the step's trace, reused
        if not traced:  # not traced yet: trace it (the styled calls and their shapes; nothing runs)
            jax.eval_shape(step, state, batch)
        stats = None
        if state.batch_stats is not None and n_data > 1:
            stats = {k: {"count": 0, "bytes": 0} for k in ("all-gather", "reduce-scatter", "all-reduce")}
            if batch_norm == "sync":  # forward: each BatchNorm's means; backward: their transposes
                back = recomputed[1]["all-reduce"] if len(recomputed) > 1 else {"count": 0, "bytes": 0}
                stats["all-reduce"] = {"count": len(bn_calls) + back["count"], "bytes": sum(bn_calls) + back["bytes"]}
            else:  # rank 0's new statistics, summed with the others' zeros: one all-reduce per array
                leaves = [x for x in jax.tree.leaves(state.batch_stats) if np.ndim(x)]
                stats["all-reduce"] = {"count": len(leaves), "bytes": sum(int(x.nbytes) for x in leaves)}
        comm = step_communication(plan, pm, traced, accum_steps=accum_steps, zero=frozenset(zeros),
                                  merged=frozenset(merged),
                                  recomputed=recomputed[0] if recomputed else None, batch_stats=stats,
                                  dead=dead[0] if dead else None,
                                  regathered=recomputed[2] if len(recomputed) > 2 else None,
                                  recomputed_dims=dict(rec_dims))
        if cp is not None and n_cp > 1:
            comm = with_context(comm, plan, attention[0] if attention else None, accum_steps, bool(data),
                                positional, dotted, cotangents, side.get("params", ()), side.get("joins", ()))
        if pm.ep is not None:
            comm = with_experts(comm, ep_traced, accum_steps)
        if any(comm["recomputed"].get(k, {}).get("count") for k in EXTRA):  # a checkpoint's recomputed ring
            # permutes (cp) or all-to-alls (ep): their kinds are beyond step_communication's total
            total = {k: dict(v) for k, v in comm["total"].items()}
            for k in EXTRA:
                t = total.setdefault(k, {"count": 0, "bytes": 0})
                for f in ("count", "bytes"):
                    t[f] += comm["recomputed"].get(k, {}).get(f, 0)
            comm = dict(comm, total=total)
        if vocab:  # tp's all-reduces of the loss over a vocabulary cut: in the activations' term
            t = seq_of_batch(batch, state.batch_stats)[0] if cp is not None and n_cp > 1 else None
            comm = dict(comm, vocab=vocab_terms(vocab, t, n_cp))
            red = comm["vocab"]["all-reduce"]
            for part in ("activations", "total"):
                comm[part] = {k: ({f: v[f] + red[f] for f in ("count", "bytes")} if k == "all-reduce" else v)
                              for k, v in comm[part].items()}
        return comm

    return _Built(jitted, plan, run, communication, prepare)
