"""The train step of a ``PipelineModule``: the schedule's tick table run in one SPMD program.

One ``shard_map`` manual over ``pp`` (each rank its stages' stacked parameters) and the data dims (each
replica its rows of the batch, cut into ``num_microbatches`` micro-batches), automatic over ``tp`` (a
tensor-parallel model: its styled calls run in regions manual over tp, ``spmd.parallel.pipelining._tp``). The ticks are
unrolled; at each, every rank looks up its own forward and backward in the table
(``spmd.parallel.pipelining._tables``, indexed by ``axis_index(pp)``) and ``lax.switch``-es to each (a tick
holds at most one of each per rank, ``spmd.parallel.pipelining._schedules`` says why):

- ``F`` of chunk ``j`` on micro-batch ``m``: its input is the pre-unit code on the micro-batch (the first
  stage) or the activation slot the table names; the output goes to the next stage, or (the last stage) the
  user's loss is evaluated for the metrics;
- ``B``: the chunk's forward recomputed from that input under ``jax.vjp``, pulled back with the received
  gradient (the last stage: with ``1 / M`` of the loss), the parameter gradients accumulated, the input's
  gradient sent to the previous stage;

then the tick's sends: one ``ppermute`` forward and one backward, over exactly the pairs the table says.
The unit gradients are averaged over the data dims; the rest (embeddings, head) summed over ``pp`` too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.parallel.plan._checks import check_rng
from spmd.parallel.styles._nnx import nnx_params
from spmd.parallel.pipelining._calls import model_kind
from spmd.parallel.pipelining._comm import REST, STAGES, format_pipeline_communication, pipeline_communication
from spmd.parallel.pipelining._tables import ROLES, branch_codes, tick_tables
from spmd.parallel.pipelining._tp import map_tp_aware, reduce_tp_aware, segment_records, stage_hooks
from spmd.parallel.plan._shard import entry_sharding, map_like_params
from spmd.parallel.step._step import TrainState, _as_arrays, _check_batch, _split_loss, state_shardings

__all__ = ["init_pipeline_state", "make_pipeline_step", "build_pipeline_step", "unshard_pipeline_params", "STAGES",
           "REST"]



def _place(pm, optimizer, params) -> TrainState:
    lay = pm.layout(params)
    plan = lay.plan
    shard = map_like_params(plan, lay.stored_shapes(), lambda x, e: entry_sharding(e, pm.mesh))
    stored = jax.jit(lay.stack, out_shardings=shard)(params)
    _, opt_sh = state_shardings(plan, pm.mesh, stored, jax.eval_shape(optimizer.init, stored), optimizer)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(stored)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(pm.mesh.jax_mesh, P()))
    return TrainState(step=step, params=stored, opt_state=opt_state, plan=plan)


def init_pipeline_state(pm, optimizer, *init_args, params=None, mesh=None) -> TrainState:
    """Step 0: the units' parameters stacked per stage and cut over pp, the rest replicated."""
    where = "init_train_state"
    if mesh is not None and mesh.root_mesh != pm.mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not the mesh the model was pipelined on ({pm.mesh!r}); leave "
                         "mesh= out.")
    kind = model_kind(pm.module)
    if params is None and kind == "nnx":
        params = nnx_params(pm.module)  # an nnx model holds its parameters
    elif params is None and kind == "hf":
        params = pm.module.params
    elif params is None:
        if not init_args:
            raise TypeError(f"{where}: give params=, or (rng, *example_inputs) to initialize the model.")
        rng, *xs = init_args
        check_rng(where, rng)
        params = jax.jit(lambda r: pm.module.init(r, *xs)["params"])(rng)
    return _place(pm, optimizer, params)


def unshard_pipeline_params(pm, params) -> Any:
    """The user's parameter tree (unstacked, replicated) from a pipeline state's ``params``."""
    if isinstance(params, TrainState):
        params = params.params
    if not isinstance(params, dict) or set(params) != {STAGES, REST}:
        raise ValueError(f"unshard_params: these parameters were not laid out by init_train_state({pm!r}, ...); pass "
                         "that state (or its .params).")
    lay = next((lay for lay in pm._layouts.values()
                if set(lay.rest) == set(params[REST]) and set(lay.rel) == set(params[STAGES])), None)
    if lay is None:
        raise ValueError(f"unshard_params: no layout of {pm!r} holds these parameters; build them with "
                         "init_train_state on this model.")
    rep = NamedSharding(pm.mesh.jax_mesh, P())
    return jax.jit(lay.unstack, out_shardings=rep)(params)


def make_pipeline_step(pm, loss_fn: Callable, optimizer, *, accum_steps: int = 1,
                       mesh=None) -> Callable:
    """``(state, batch) -> (state, metrics)`` of a pipelined model (see the module doc)."""
    where = "make_train_step"
    if mesh is not None and mesh.root_mesh != pm.mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not the mesh the model was pipelined on; leave mesh= out.")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"{where}: accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")
    data = pm.data_dims
    sizes = dict(zip(pm.mesh.mesh_dim_names, pm.mesh.shape))
    n_data = int(np.prod([sizes[d] for d in data])) if data else 1
    m_count = pm.schedule.num_microbatches
    builds: dict = {}
    mbs: dict = {}  # the micro-batch's shapes per build (the tp terms trace one)

    def build(state: TrainState, batch):
        key = (state.plan, jax.tree_util.tree_structure(batch), tuple(np.shape(x) for x in jax.tree.leaves(batch)))
        if key not in builds:
            lay = next(lay for lay in pm._layouts.values() if lay.plan == state.plan)
            n_local = jax.tree.leaves(batch)[0].shape[0] // n_data
            mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n_local // (accum_steps * m_count), *np.shape(x)[1:]),
                                                             jnp.result_type(x)), batch)
            lay.record(loss_fn, jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths]), mb)
            mbs[key] = mb
            builds[key] = [build_pipeline_step(pm, lay, loss_fn, optimizer, accum_steps, state.plan), lay, n_local]
        return builds[key]

    def check(state, batch):
        if not isinstance(state, TrainState) or state.plan is None:
            raise TypeError(f"train_step: state={type(state).__name__} must be the TrainState init_train_state(model, "
                            "optimizer, ...) returns.")
        if not any(lay.plan == state.plan for lay in pm._layouts.values()):
            raise ValueError(f"train_step: the state was laid out for another model than this step's ({pm!r}); build "
                             "it with init_train_state on the same model.")
        batch = _as_arrays(batch)
        _check_batch(batch, n_data, 1, data, sizes)
        n = np.shape(jax.tree.leaves(batch)[0])[0]
        if n % (n_data * m_count * accum_steps):
            raise ValueError(
                f"train_step: the batch has {n} examples; each of the {n_data} data-parallel replicas cuts its rows into "
                f"num_microbatches={m_count}" + (f" x accum_steps={accum_steps}" if accum_steps > 1 else "")
                + f" micro-batches: use a batch size that is a multiple of {n_data * m_count * accum_steps}.")
        return batch

    def executable(state, batch):  # batch: check's
        b = build(state, batch)
        if len(b) == 3:
            b.append(b[0].lower(state, batch).compile())
        return b[3]

    def compiled(state, batch):
        """The compiled step for ``(state, batch)`` (``.as_text()``, ``.memory_analysis()``); what ``step`` runs."""
        return executable(state, check(state, batch))

    def step(state, batch):
        batch = check(state, batch)
        return executable(state, batch)(state, batch)

    def lower(state, batch):
        batch = check(state, batch)
        return build(state, batch)[0].lower(state, batch)

    def communication(state, batch) -> dict:
        batch = check(state, batch)
        lay = build(state, batch)[1]
        key = next(k for k, b in builds.items() if b[1] is lay)
        recs = segment_records(pm, lay, loss_fn, mbs[key])
        ticks = branch_codes(tick_tables(pm)) if recs is not None else None
        return pipeline_communication(pm, lay, accum_steps, recs, ticks)

    step.lower = lower
    step.compiled = compiled
    step.communication = communication
    step.table = lambda state, batch: (state.plan.table() + "\n" + str(pm.schedule) + "\n"
                                       + format_pipeline_communication(communication(state, batch)))
    step.schedule = pm.schedule
    return step


def build_pipeline_step(pm, lay, loss_fn, optimizer, accum_steps: int, plan) -> Callable:
    """The jitted ``(state, batch) -> (state, metrics)`` of ``pm`` on layout ``lay`` (its unit calls recorded
    at the micro-batch's shapes), unchecked: what ``make_train_step`` compiles once per layout and batch shape,
    and what ``spmd.parallel.pipelining._memory`` compiles at other micro-batch counts."""
    unroll = pm.unroll
    mesh, ppd, data = pm.mesh, pm.pp, pm.data_dims
    s = pm.schedule
    m_count, lc = s.num_microbatches, lay.per_slot
    tables = tick_tables(pm)
    kx, kg = max(s.x_slots), max(s.g_slots)
    act = lay.act
    skip = not lay.valid.all()
    valid = jnp.asarray(lay.valid)

    hooks = stage_hooks(pm, lay)  # tp: the styled calls in regions manual over tp (spmd.parallel.pipelining._tp)
    unit_named = (lambda: hooks.unit(lay.units[0])) if hooks else contextlib.nullcontext  # noqa: E731

    def chunk_of(sp: dict, j) -> dict:  # chunk j's units of each stacked parameter: [lc, ...]
        return {rel: lax.dynamic_slice_in_dim(sp[rel], j * lc, lc) for rel in lay.rel}

    def add_chunk(gsp: dict, j, dj: dict) -> dict:  # chunk j's gradient added in place (no zero-padded copy)
        return {rel: lax.dynamic_update_slice_in_dim(
            gsp[rel], lax.dynamic_slice_in_dim(gsp[rel], j * lc, lc) + dj[rel], j * lc, 0) for rel in lay.rel}

    def chunk(spj: dict, r, j, x, side):  # spj: chunk_of(sp, j)
        for l in range(lc):
            leaves = [spj[rel][l] for rel in lay.rel]
            with unit_named():
                y = lay.apply_unit(leaves, x, side)
            x = jnp.where(valid[r, j, l], y, x) if skip else y
        return x

    def side_of(rest, mb):  # the units' side arrays (a mask), computed again on a stage after the first
        return lay.pre(loss_fn, rest, mb)[1] if lay.calls.side_shapes else []

    def loss_aux(rest, mb, h):
        return _split_loss(lay.post(loss_fn, rest, mb, h), "make_train_step")

    fd = {rel: lay.fsdp_dim(rel) for rel in lay.rel}  # stage parameters cut over fsdp: gathered once per step
    rels = list(lay.rel)
    st_entries = [plan.entry(f"{STAGES}/{rel}") for rel in rels]

    def over_fsdp(tree: dict, op) -> dict:  # op(x, dim) of each stage parameter cut over fsdp, on its tp block
        return dict(zip(rels, map_tp_aware(hooks, st_entries, [tree[rel] for rel in rels],
                                           lambda i, x: x if fd[rels[i]] is None else op(x, fd[rels[i]]))))

    def region(stored, batch):
        with hooks.installed() if hooks else contextlib.nullcontext():
            return region_body(stored, batch)

    def region_body(stored, batch):
        r = lax.axis_index(ppd)
        sp, rest = stored[STAGES], stored[REST]
        sp = over_fsdp(sp, lambda x, d: lax.all_gather(x, lay.fsdp, axis=d, tiled=True))
        n_local = jax.tree.leaves(batch)[0].shape[0]
        micro = jax.tree.map(lambda x: x.reshape(accum_steps, m_count, n_local // (accum_steps * m_count),
                                                 *x.shape[1:]), batch)
        aux0 = jax.eval_shape(lambda: loss_aux(rest, jax.tree.map(lambda x: x[0, 0], micro),
                                               jnp.zeros(act.shape, act.dtype))[1])
        aux0z = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)

        def one_pass(carry, mbs):
            gsp, grest, loss, aux = carry
            xbuf = jnp.zeros((kx + 1, *act.shape), act.dtype)
            gbuf = jnp.zeros((kg + 1, *act.shape), act.dtype)
            zero_act = jnp.zeros(act.shape, act.dtype)

            def mb_of(m):
                return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, keepdims=False), mbs)

            def idle_f(x, j, m):
                return zero_act

            def idle_b(acc, x, g, j, m):
                return acc, zero_act

            def fwd(role):
                def f(x, j, m):
                    if role in ("last", "only"):  # the loss comes with the backward's recomputation
                        return zero_act
                    mb = mb_of(m)
                    x, side = lay.pre(loss_fn, rest, mb) if role == "first" else (x, side_of(rest, mb))
                    return chunk(chunk_of(sp, j), r, j, x, side)
                return f

            def bwd(role):
                def f(acc, x, g_in, j, m):
                    gsp, grest, loss, aux = acc
                    mb = mb_of(m)
                    first, last = role in ("first", "only"), role in ("last", "only")
                    side = None if first else side_of(rest, mb)

                    def g(rest_, sp_, x):
                        h = chunk(sp_, r, j, *(lay.pre(loss_fn, rest_, mb) if first else (x, side)))
                        if not last:
                            return h, aux0z
                        lo, ax = loss_aux(rest_, mb, h)
                        return lo / m_count, ax

                    out, pull, ax = jax.vjp(g, rest, chunk_of(sp, j), zero_act if first else x, has_aux=True)
                    drest, dspj, dx = pull(jnp.ones_like(out) if last else g_in)
                    gsp = add_chunk(gsp, j, dspj)
                    grest = jax.tree.map(jnp.add, grest, drest)
                    if last:
                        loss = loss + out
                        aux = jax.tree.map(lambda a, b: a + b / m_count, aux, ax)
                    return (gsp, grest, loss, aux), (zero_act if first else dx)
                return f

            f_branches = [idle_f] + [fwd(ro) for ro in ROLES]  # code k: f_branches[k]
            b_branches = [idle_b] + [bwd(ro) for ro in ROLES]  # code k: b_branches[k - len(ROLES)] (k > 0)
            c = (xbuf, gbuf, gsp, grest, loss, aux)

            def run(branches, code, used, args):  # used: the codes some rank runs (index into branches)
                if len(used) == 1:
                    return branches[used[0]](*args)
                return lax.switch(code, [branches[k] for k in used], *args)

            def compute(c, fc, bc, fused, bused, frow, brow):
                # the branches get the stash slots they read, not the stash (a buffer two branches take as
                # an operand is copied at every tick)
                xb, gb, *acc = c
                fj, fm, fxr = frow
                bj, bm, bxr, bgr = brow
                sf = run(f_branches, fc, fused, (xb[fxr], fj, fm))
                acc, sb = run(b_branches, bc, bused, (tuple(acc), xb[bxr], gb[bgr], bj, bm))
                return (xb, gb, *acc), sf, sb

            fcols, bcols = ("fj", "fm", "fxr"), ("bj", "bm", "bxr", "bgr")

            def after_previous(c, m):  # m, tied to the carry's loss (min(m, m + isnan) is m; XLA can't tell): else
                # a tick reading no stash slot ran ahead, holding GPipe's memory under 1F1B (docs/training/layouts.md)
                return jnp.minimum(m, m + jnp.isnan(c[4]).astype(m.dtype))

            def local_codes(codes, shift):  # a tick's (or the step's) codes -> the used list and each rank's index
                codes = np.asarray(codes)
                used = sorted({int(k) - shift if k else 0 for k in codes.flat})
                return used, np.vectorize(lambda k: used.index(int(k) - shift if k else 0))(codes).astype(np.int32)

            if unroll:
                for tb in tables:
                    pick = lambda a: jnp.asarray(a)[r]  # noqa: E731
                    fused, fl = local_codes(tb["fcode"], 0)  # only the branches some rank runs at this tick
                    bused, bl = local_codes(tb["bcode"], len(ROLES))
                    fj, fm, fxr = [pick(tb[k]) for k in fcols]
                    bj, bm, bxr, bgr = [pick(tb[k]) for k in bcols]
                    c, sf, sb = compute(c, pick(fl), pick(bl), fused, bused, [fj, after_previous(c, fm), fxr],
                                        [bj, after_previous(c, bm), bxr, bgr])
                    xb, gb, *others = c
                    if tb["fwd"]:
                        xb = xb.at[pick(tb["rx"])].set(lax.ppermute(sf, ppd, tb["fwd"]))
                    if tb["bwd"]:
                        gb = gb.at[pick(tb["rg"])].set(lax.ppermute(sb, ppd, tb["bwd"]))
                    c = (xb, gb, *others)
            else:  # one loop over the ticks: each tick's sends picked from the distinct pair sets
                fused, fl = local_codes(np.stack([tb["fcode"] for tb in tables]), 0)
                bused, bl = local_codes(np.stack([tb["bcode"] for tb in tables]), len(ROLES))
                fl, bl = jnp.asarray(fl), jnp.asarray(bl)
                cols = {k: jnp.asarray(np.stack([tb[k] for tb in tables])) for k in (*fcols, *bcols, "rx", "rg")}
                sends = {}
                for d in ("fwd", "bwd"):
                    sets = sorted({tuple(tb[d]) for tb in tables if tb[d]})
                    sends[d] = (jnp.asarray([sets.index(tuple(tb[d])) + 1 if tb[d] else 0 for tb in tables]),
                                [lambda x: jnp.zeros_like(x)] + [lambda x, p=p: lax.ppermute(x, ppd, list(p))
                                                                 for p in sets])

                def tick(t, c):
                    c, sf, sb = compute(c, fl[t, r], bl[t, r], fused, bused, [cols[k][t, r] for k in fcols],
                                        [cols[k][t, r] for k in bcols])
                    xb, gb, *others = c
                    xb = xb.at[cols["rx"][t, r]].set(lax.switch(sends["fwd"][0][t], sends["fwd"][1], sf))
                    gb = gb.at[cols["rg"][t, r]].set(lax.switch(sends["bwd"][0][t], sends["bwd"][1], sb))
                    return (xb, gb, *others)

                c = lax.fori_loop(0, len(tables), tick, c)
            return tuple(c[2:]), None

        zeros = jax.tree.map(jnp.zeros_like, (sp, rest))
        init = (*zeros, jnp.zeros((), jnp.float32), aux0z)
        if accum_steps == 1:
            (gsp, grest, loss, aux), _ = one_pass(init, jax.tree.map(lambda x: x[0], micro))
        else:
            (gsp, grest, loss, aux), _ = lax.scan(one_pass, init, micro)
        k = accum_steps
        gsp = jax.tree.map(lambda g: g / k, gsp)
        grest = jax.tree.map(lambda g: g / k, grest)
        metrics = {"loss": loss / k, **jax.tree.map(lambda a: a / k, aux)}
        # one all-reduce each: the rest over pp (summed: each end's part) and the data dims (averaged)
        n_data = int(np.prod([mesh.size(d) for d in data])) if data else 1
        rp = list(grest)
        grest = dict(zip(rp, [g / n_data for g in reduce_tp_aware(
            hooks, [plan.entry(f"{REST}/{p}") for p in rp], [grest[p] for p in rp], (ppd, *data))]))
        metrics = jax.tree.map(lambda g: g / n_data, lax.psum(metrics, (ppd, *data)))
        cut = {rel for rel in lay.rel if fd[rel] is not None}  # reduce-scattered over fsdp (the gather's transpose)
        gsp = over_fsdp(gsp, lambda g, d: lax.psum_scatter(g, lay.fsdp, scatter_dimension=d, tiled=True) / lay.n_fsdp)
        others = tuple(d for d in data if d != lay.fsdp)
        whole = {rel: g for rel, g in gsp.items() if rel not in cut}
        if data and whole:
            wr = list(whole)
            whole = dict(zip(wr, reduce_tp_aware(hooks, [plan.entry(f"{STAGES}/{rel}") for rel in wr],
                                                 [whole[rel] for rel in wr], data, lax.pmean)))
        shards = {rel: g for rel, g in gsp.items() if rel in cut}
        if others and shards:  # HSDP: the shards averaged over the other data dims
            sr = list(shards)
            shards = dict(zip(sr, reduce_tp_aware(hooks, [plan.entry(f"{STAGES}/{rel}") for rel in sr],
                                                  [shards[rel] for rel in sr], others, lax.pmean)))
        gsp = {**whole, **shards}
        return {STAGES: gsp, REST: grest}, metrics

    names = mesh.mesh_dim_names
    tp_dim = {pm.tp.tp.mesh_dim} if pm.tp else set()  # automatic in the region (global view over tp)
    st_spec = {rel: P(ppd, *[None] * (fd[rel] - 1), lay.fsdp) if fd[rel] else P(ppd) for rel in lay.rel}
    specs = {STAGES: st_spec, REST: {p: P() for p in lay.rest}}
    batch_spec = P(data if len(data) > 1 else (data[0] if data else None))

    def step(state: TrainState, batch):
        grads, metrics = jax.shard_map(region, mesh=mesh.jax_mesh, in_specs=(specs, batch_spec),
                                       out_specs=(specs, P()), axis_names=set(names) - tp_dim, check_vma=False)(
            state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        p_sh, o_sh = state_shardings(plan, mesh, params, opt_state, optimizer)
        new = TrainState(step=state.step + 1, params=lax.with_sharding_constraint(params, p_sh),
                         opt_state=lax.with_sharding_constraint(opt_state, o_sh), plan=state.plan)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return new, metrics

    return jax.jit(step)

