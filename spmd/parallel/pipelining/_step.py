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
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.parallel.context._calls import seq_len
from spmd.parallel.context._seq import batch_seq
from spmd.parallel.plan._checks import check_rng
from spmd.parallel.styles._nnx import nnx_params
from spmd.parallel.pipelining._calls import model_kind
from spmd.parallel.pipelining._split import unit_modules
from spmd.parallel.pipelining._cp import (context_records, gathered_context, ring_blocker, routed, stage_context,
                                          uncounted, unit_gathered, unit_rings)
from spmd.parallel.pipelining._comm import REST, STAGES, format_pipeline_communication, pipeline_communication
from spmd.parallel.pipelining._tables import ROLES, branch_codes, tick_tables
from spmd.parallel.pipelining._tp import (ep_placements, map_tp_aware, reduce_tp_aware, refuse_sliced_heads,
                                          segment_records, stage_hooks)
from spmd.parallel.plan._shard import entry_sharding, map_like_params
from spmd.parallel.step._batch_norm import BATCH_STATS_REASON
from spmd.parallel.step._finite import _keep_finite, _raise_nonfinite
from spmd.parallel.step._loss_io import _as_arrays, _split_loss
from spmd.parallel.step._model_checks import check_batch as _check_batch
from spmd.parallel.step._protocol import TrainStep
from spmd.parallel.step._state import TrainState, state_shardings

__all__ = ["init_pipeline_state", "make_pipeline_step", "PipelineStep", "build_pipeline_step", "seq_batch_leaves",
           "unshard_pipeline_params", "STAGES", "REST"]



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
        held = jax.eval_shape(lambda r: pm.module.init(r, *xs), rng)
        if "batch_stats" in held:
            raise ValueError(f"{where}: the model holds a 'batch_stats' collection (nn.BatchNorm's running "
                             f"statistics), which {type(pm).__name__} does not carry: {BATCH_STATS_REASON}")
        params = jax.jit(lambda r: pm.module.init(r, *xs)["params"])(rng)
        init_args = tuple(xs)
    if init_args and kind in ("linen", "nnx"):
        _scanned_units(pm, params, init_args)
    return _place(pm, optimizer, params)


def _scanned_units(pm, params, example_inputs) -> None:
    """The units as a scanned stack (``nn.scan`` / ``nnx.scan``, found by one abstract call of the model on
    ``example_inputs``): ``units`` naming the stack itself makes its layers the units (``pm._scan``: the stack
    and each parameter's layer axis); a unit inside a stack, or a stack among other units, is refused by name."""
    import re

    from spmd.parallel.plan._param_plan import path_str
    from spmd.parallel.styles._transforms import glob_regex, stacked_of

    stacked = stacked_of(pm.module, params, example_inputs) or {}
    shapes = {path_str(kp): np.shape(x) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    pat = glob_regex(pm.units, "/")
    tool = "nnx.scan" if model_kind(pm.module) == "nnx" else "nn.scan"
    stacks: dict = {}
    for path, (m, axis) in stacked.items():
        comps = path.split("/")
        u = next(("/".join(comps[:i]) for i in range(1, len(comps)) if re.fullmatch(pat, "/".join(comps[:i]))), None)
        if u is None:
            continue
        if u != m:
            raise ValueError(
                f"pipeline: units={pm.units.replace('/', '.')!r} matches {u.replace('/', '.')!r}, a module of a "
                f"scanned stack ({m.replace('/', '.')!r} runs under {tool}: its "
                f"{shapes[path][axis]} layers stacked on axis {axis} of its parameters); a unit inside a stack is "
                f"called once per layer. Name the stack itself (units={m.replace('/', '.')!r}: its layers become the "
                "units, the stages slices of its layer axis).")
        stacks.setdefault(m, []).append((path[len(m) + 1:], axis))
    if not stacks:
        return
    found = sorted(_unit_names(pm, shapes))
    if len(found) != 1 or found[0] not in stacks:
        raise ValueError(
            f"pipeline: units={pm.units!r} matches {', '.join(found)}, among them the scanned stack "
            f"{next(iter(stacks))!r}; a pipeline's units are one scanned stack (its layers) or modules called once "
            "each: match one of the two.")
    (stack,) = stacks
    rels = {r for r, _ in stacks[stack]}
    missing = [p for p in shapes if p.startswith(stack + "/") and p[len(stack) + 1:] not in rels]
    if missing:
        raise ValueError(f"pipeline: parameter {missing[0]!r} of the scanned stack {stack!r} is not stacked on a "
                         "layer axis; every parameter of the stack must be (variable_axes={'params': axis}).")
    object.__setattr__(pm, "_scan", (stack, tuple(sorted(stacks[stack]))))


def _unit_names(pm, shapes) -> list[str]:
    return unit_modules(list(shapes), pm.units)


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


def _check_leading_dims(batch) -> None:
    """Every batch leaf is cut into micro-batches along its leading dim: the same number of rows in each."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("train_step: batch holds no arrays; give the pipeline a pytree of [batch, ...] arrays.")
    p0, x0 = leaves[0]
    for p, x in leaves:
        if np.ndim(x0) == 0 or np.ndim(x) == 0 or np.shape(x)[0] != np.shape(x0)[0]:
            raise ValueError(
                f"train_step: batch{jax.tree_util.keystr(p)} has shape {np.shape(x)}, and batch"
                f"{jax.tree_util.keystr(p0)} {np.shape(x0)}; a pipelined step cuts every batch leaf into micro-batches "
                "along its leading (batch) dim, so each needs one, the same in all: give per-example arrays "
                "(broadcast a shared one inside loss_fn).")


def make_pipeline_step(pm, loss_fn: Callable, optimizer, *, accum_steps: int = 1, mesh=None,
                       check_finite: bool | str = False, donate: bool = False) -> "PipelineStep":
    """``(state, batch) -> (state, metrics)`` of a pipelined model (see the module doc); ``check_finite`` and
    ``donate`` as ``spmd.parallel.make_train_step`` documents them, the update kept or dropped inside the one
    jitted step."""
    where = "make_train_step"
    if mesh is not None and mesh.root_mesh != pm.mesh:
        raise ValueError(f"{where}: mesh={mesh!r} is not the mesh the model was pipelined on; leave mesh= out.")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"{where}: accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")
    if check_finite not in (False, True, "skip") or not isinstance(check_finite, (bool, str)):
        raise (ValueError if isinstance(check_finite, str) else TypeError)(
            f"{where}: check_finite={check_finite!r} must be False (no check), 'skip' (a non-finite step keeps the "
            "previous params and opt_state) or True (the same, and the call raises FloatingPointError).")
    return PipelineStep(pm, loss_fn, optimizer, accum_steps, check_finite, donate)


class PipelineStep(TrainStep):
    """A ``PipelineModule``'s ``TrainStep``: one compiled program per (plan, batch shape), built on first use;
    ``schedule``: the pipeline's tick table."""

    def __init__(self, pm, loss_fn: Callable, optimizer, accum_steps: int, check_finite: bool | str = False,
                 donate: bool = False):
        self._pm, self._loss_fn, self._optimizer, self._accum_steps = pm, loss_fn, optimizer, accum_steps
        self._check_finite, self._donate = check_finite, donate
        self.schedule = pm.schedule
        sizes = dict(zip(pm.mesh.mesh_dim_names, pm.mesh.shape))
        self._sizes = sizes
        self._n_data = int(np.prod([sizes[d] for d in pm.data_dims])) if pm.data_dims else 1
        self._builds: dict = {}  # (plan, batch tree, shapes) -> _PipelineBuild

    def __repr__(self) -> str:
        finite = f", check_finite={self._check_finite!r}" if self._check_finite else ""
        return f"TrainStep({self._pm!r}, accum_steps={self._accum_steps}{finite})"

    def _build(self, state: TrainState, batch) -> "_PipelineBuild":
        key = (state.plan, jax.tree_util.tree_structure(batch), tuple(np.shape(x) for x in jax.tree.leaves(batch)))
        if key in self._builds:  # the layout's unit calls made this build's again (another shape's may be there)
            b = self._builds[key]
            b.lay.record(self._loss_fn, b.lay.logical(), b.mb)
        else:
            pm, k = self._pm, self._accum_steps
            lay = next(lay for lay in pm._layouts.values() if lay.plan == state.plan)
            n_local = jax.tree.leaves(batch)[0].shape[0] // self._n_data
            mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (n_local // (k * pm.schedule.num_microbatches), *np.shape(x)[1:]), jnp.result_type(x)), batch)
            lay.record(self._loss_fn, lay.logical(), mb)
            seq = seq_batch_leaves(pm, lay, self._loss_fn, mb)
            stages: list = []
            self._builds[key] = _PipelineBuild(
                build_pipeline_step(pm, lay, self._loss_fn, self._optimizer, k, state.plan,
                                    keep_finite=bool(self._check_finite), stages_out=stages, seq=seq,
                                    donate=self._donate), lay, mb)
            self._builds[key].stages = stages[0]
            self._builds[key].seq = seq
        return self._builds[key]

    def _checked(self, state, batch):
        """``batch`` as arrays, checked with ``state`` against the pipeline."""
        pm = self._pm
        if not isinstance(state, TrainState) or state.plan is None:
            raise TypeError(f"train_step: state={type(state).__name__} must be the TrainState init_train_state(model, "
                            "optimizer, ...) returns.")
        if not any(lay.plan == state.plan for lay in pm._layouts.values()):
            raise ValueError(f"train_step: the state was laid out for another model than this step's ({pm!r}); build "
                             "it with init_train_state on the same model.")
        batch = _as_arrays(batch)
        _check_leading_dims(batch)
        n_data, m_count, k = self._n_data, pm.schedule.num_microbatches, self._accum_steps
        _check_batch(batch, n_data, 1, pm.data_dims, self._sizes)
        n = np.shape(jax.tree.leaves(batch)[0])[0]
        if n % (n_data * m_count * k):
            raise ValueError(
                f"train_step: the batch has {n} examples; each of the {n_data} data-parallel replicas cuts its rows into "
                f"num_microbatches={m_count}" + (f" x accum_steps={k}" if k > 1 else "")
                + f" micro-batches: use a batch size that is a multiple of {n_data * m_count * k}.")
        return batch

    def _executable(self, state, batch):  # batch: _checked's
        b = self._build(state, batch)
        if b.compiled is None:
            b.compiled = b.jitted.lower(state, batch).compile()
        return b.compiled

    def __call__(self, state, batch):
        batch = self._checked(state, batch)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, batch))):
            return self._build(state, batch).jitted(state, batch)  # inside a user's jit: the jitted step composes
        new, metrics = self._executable(state, batch)(state, batch)
        if self._check_finite is True:
            _raise_nonfinite(state, metrics)
        return new, metrics

    def lower(self, state, batch):
        batch = self._checked(state, batch)
        return self._build(state, batch).jitted.lower(state, batch)

    def compiled(self, state, batch):
        """The compiled step for ``(state, batch)`` (``.as_text()``, ``.memory_analysis()``): what the call runs."""
        return self._executable(state, self._checked(state, batch))

    def communication(self, state, batch) -> dict:
        b = self._build(state, self._checked(state, batch))
        t = b.seq[0] if b.seq else None
        recs = segment_records(self._pm, b.lay, self._loss_fn, b.mb,  # the tp / ep styled calls by segment
                               lambda: gathered_context(self._pm, b.lay, t or seq_len(b.mb)) if self._pm.cp
                               else contextlib.nullcontext())
        cp = (context_records(self._pm, b.lay, self._loss_fn, b.mb, b.seq[0] if b.seq else None)
              if self._pm.cp else None)
        ticks = branch_codes(tick_tables(self._pm)) if recs is not None or cp is not None else None
        out = pipeline_communication(self._pm, b.lay, self._accum_steps, recs, ticks, cp)
        if self._pm.cp:  # what the cp terms leave to GSPMD, said (``_cp.uncounted``)
            out["uncounted"] = uncounted(self._pm, b.lay, b.seq[0] if b.seq else seq_len(b.mb))
        return out

    def attention(self, state, batch) -> list[dict]:
        """Under cp: the stages' attention calls as traced (a unit traced once per branch that runs it), each with
        its method (``ring``, ``ring (zigzag)``, ``all-gather K/V``)."""
        b = self._build(state, self._checked(state, batch))
        if self._pm.cp and b.stages.attention is None:
            jax.eval_shape(b.jitted, state, self._checked(state, batch))  # traced: the calls recorded
        return list(b.stages.attention.records) if b.stages.attention is not None else []

    def table(self, state, batch) -> str:
        b = self._build(state, self._checked(state, batch))
        blocked = ring_blocker(self._pm, b.lay, b.seq[0] if b.seq else None)

        def why(r):  # where a call runs as it does in a stage (spmd.parallel.pipelining._cp)
            if r["method"].startswith("ring"):
                return "in a stage's branch: the branches without a ring run the chunk too"
            return f"a stage's branch: no ring, {blocked}" if blocked else "a mask or bias array: no ring"

        lines = [f"    {r['call']}: {r['method']} over cp={r['n']} ({why(r)}), q {list(r['q'][0])} "
                 f"{r['q'][1]}, k/v {list(r['kv'][0])}" + (", causal" if r["causal"] else "")
                 if "q" in r else f"    attention '{r['call']}' (a unit's module): gather sequence over cp={r['n']} "
                 f"(in {', '.join(f'{list(s)} {d}' for s, d in r['gathered'])}; its output cut back)"
                 for r in self.attention(state, batch)]
        lines = list(dict.fromkeys(lines))  # each distinct call once
        return (state.plan.table() + "\n" + str(self._pm.schedule) + "\n"
                + format_pipeline_communication(self.communication(state, batch))
                + ("\n  context (cp): the stages' attention calls\n" + "\n".join(lines) if lines else ""))


class _PipelineBuild:
    """One (plan, batch shape)'s step: ``jitted``, its layout ``lay``, the micro-batch's shapes ``mb`` (the tp
    terms trace one) and, once compiled, ``compiled``."""

    def __init__(self, jitted: Callable, lay, mb):
        self.jitted, self.lay, self.mb, self.compiled, self.stages = jitted, lay, mb, None, None
        self.seq = None  # under cp: (sequence length, the batch leaves cut over cp), ``seq_batch_leaves``


def _stage_spec(ppd: str, ndim: int, cuts: dict) -> P:
    """The region's spec of a stacked stage parameter: ``pp`` on its stacked dim, each of ``cuts`` (mesh dim:
    the dim it cuts, or None) on its own dim."""
    dims: list = [ppd] + [None] * (ndim - 1)
    for name, d in cuts.items():
        if name is not None and d is not None:
            dims[d] = name
    while len(dims) > 1 and dims[-1] is None:
        dims.pop()
    return P(*dims)


def seq_batch_leaves(pm, lay, loss_fn, mb) -> tuple[int, tuple[bool, ...]] | None:
    """Under cp: the sequence length and which batch leaves hold it on dim 1 (cut over cp), read from the program
    (``spmd.parallel.context._seq.batch_seq``, as the plain step: ``loss_fn`` traced with them at fewer
    positions), not from their size: a ``[batch, d]`` input, ``d`` equal to the sequence length or not, stays
    whole over cp; leaves of two lengths the program takes either way are refused. None without cp."""
    if not pm.cp or pm.mesh.size(pm.cp) < 2:
        return None
    params = jax.tree_util.tree_unflatten(lay.treedef, [lay.shapes[p] for p in lay.paths])

    def trace(b):
        return jax.eval_shape(lambda p, b: lay.calls.run(loss_fn, p, b, lambda path, mod, call, a, kw: call(*a, **kw)),
                              params, b)

    return batch_seq(trace, mb, pm.mesh.size(pm.cp))


def build_pipeline_step(pm, lay, loss_fn, optimizer, accum_steps: int, plan, keep_finite: bool = False,
                        stages_out: list | None = None, seq: tuple[int, tuple[bool, ...]] | None = None,
                        donate: bool = False) -> Callable:
    """The jitted ``(state, batch) -> (state, metrics)`` of ``pm`` on layout ``lay`` (its unit calls recorded
    at the micro-batch's shapes), unchecked: what ``make_train_step`` compiles once per layout and batch shape,
    and what ``spmd.parallel.pipelining._memory`` compiles at other micro-batch counts.

    Its parts, in the order they run: ``_region`` (one ``shard_map`` region: the stages gathered over fsdp,
    the batch cut into micro-batches, one ``_one_pass`` per accumulation step, then ``_reduce_grads``); a
    pass runs the tick table (``_ticks_unrolled`` or ``_ticks_looped``), each tick switching between the
    ``_Pass`` branches (a chunk's forward or backward in each stage role) that the table names for the rank.
    ``keep_finite``: the update applied only where the loss and gradient norm are finite (else the state's
    params and opt_state kept; ``metrics["nonfinite"]``), in this same program. ``seq``: under cp, the sequence
    length and which batch leaves (``jax.tree.leaves`` order) hold it, cut over cp (``seq_batch_leaves``; None:
    every leaf of rank 2 or more, of the one dim-1 length). ``donate``: the state's buffers reused for the state
    returned (``donate_argnums=0``)."""
    mesh, ppd, data = pm.mesh, pm.pp, pm.data_dims
    st = _Stages(pm, lay, loss_fn, accum_steps, plan)
    st.seq_len = seq[0] if seq is not None else None
    refuse_sliced_heads(pm, lay)  # a fused qkv's heads sliced under tp: GSPMD's permutes hang, refused
    if st.seq_len and pm.mesh.size(pm.cp) > 1:  # one unit traced here, outside the region (whose mesh it would see)
        unit_gathered(pm, lay, st.seq_len), unit_rings(pm, lay, st.seq_len)
    if stages_out is not None:
        stages_out.append(st)

    def region(stored, batch):
        return _region(st, stored, batch)

    names = mesh.mesh_dim_names
    tp_dim = {pm.tp.tp.mesh_dim} if pm.tp else set()  # automatic in the region (global view over tp)
    cp_dim = {pm.cp} if pm.cp else set()  # automatic too: the sequence cut over cp, attention across it
    st_spec = {rel: _stage_spec(ppd, lay.unit_shapes[rel].ndim + 1, {lay.fsdp: st.fd[rel], st.ep: st.ed.get(rel)})
               for rel in lay.rel}
    specs = {STAGES: st_spec, REST: {p: P() for p in lay.rest}}
    batch_spec = P(data if len(data) > 1 else (data[0] if data else None))

    def step(state: TrainState, batch):
        if pm.cp:  # the sequence (dim 1 of the leaves that hold it) cut over cp, the batch over the data dims
            leaves, tree = jax.tree.flatten(batch)
            cut = seq[1] if seq is not None else tuple(np.ndim(x) >= 2 for x in leaves)
            batch = jax.tree.unflatten(tree, [lax.with_sharding_constraint(x, NamedSharding(mesh.jax_mesh, P(
                batch_spec[0], *((pm.cp,) if c else ())))) for x, c in zip(leaves, cut)])
        grads, metrics = jax.shard_map(region, mesh=mesh.jax_mesh, in_specs=(specs, batch_spec),
                                       out_specs=(specs, P()), axis_names=set(names) - tp_dim - cp_dim,
                                       check_vma=False)(
            state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        p_sh, o_sh = state_shardings(plan, mesh, params, opt_state, optimizer)
        new = TrainState(step=state.step + 1, params=lax.with_sharding_constraint(params, p_sh),
                         opt_state=lax.with_sharding_constraint(opt_state, o_sh), plan=state.plan)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return _keep_finite(state, new, metrics) if keep_finite else (new, metrics)

    return jax.jit(step, donate_argnums=(0,) if donate else ())


class _Stages:
    """What every part of the step reads: the pipeline, its stage layout, the loss, the schedule's sizes and
    the stage parameters' fsdp cuts; and the chunk-level operations on the stacked stage parameters."""

    def __init__(self, pm, lay, loss_fn, accum_steps: int, plan):
        self.pm, self.lay, self.loss_fn, self.accum_steps, self.plan = pm, lay, loss_fn, accum_steps, plan
        self.seq_len = None  # under cp: the batch's sequence length (``seq_batch_leaves``), once built
        self.ppd, self.data = pm.pp, pm.data_dims
        s = pm.schedule
        self.m_count, self.lc = s.num_microbatches, lay.per_slot
        self.tables = tick_tables(pm)
        self.kx, self.kg = max(s.x_slots), max(s.g_slots)
        self.act = lay.act
        self.skip = not lay.valid.all()
        self.valid = jnp.asarray(lay.valid)
        self.attention = None  # under cp: the stages' attention calls (ContextCalls), once traced
        self.shadow = False  # under cp: a unit runs a ring (the branches without one run a chunk too, _cp.py)
        self.hooks = stage_hooks(pm, lay)  # tp: the styled calls in regions manual over tp (pipelining._tp)
        self.fd = {rel: lay.fsdp_dim(rel) for rel in lay.rel}  # stage parameters cut over fsdp: gathered once
        # the experts cut over ep (ExpertParallel in the units): each rank its own experts, never gathered
        self.ep = pm.ep.ep.mesh_dim if pm.ep else None
        self.ed = {rel: p.dim for rel, p in ep_placements(pm, lay).items()}
        self.rels = list(lay.rel)
        self.st_entries = [plan.entry(f"{STAGES}/{rel}") for rel in self.rels]

        kinds = lay.kind_rows  # [pp, v, lc]: each slot's unit kind (units that differ run as themselves)
        self.slot_kinds = []  # per slot: (the kinds some rank's chunk holds there, each (rank, chunk)'s index)
        for l in range(self.lc):
            used = sorted({int(k) for k in kinds[:, :, l].flat if k >= 0})
            self.slot_kinds.append((used, np.vectorize(lambda k: used.index(k) if k >= 0 else 0)(
                kinds[:, :, l]).astype(np.int32)))

    def unit_call(self, k: int, leaves: list, x, side, unit=0):
        """A unit of kind ``k`` (``UnitCalls.kind_of``), named (tp) by its kind's first unit; ``unit``: its index
        (its constants' row, ``UnitCalls.unit_consts``)."""
        lay = self.lay
        with self.hooks.unit(lay.module_of(lay.calls.kinds[k])) if self.hooks else contextlib.nullcontext(), \
                routed(self.attention if self.attention is not None and self.attention.gathered else None, lay):
            return lay.apply_unit(leaves, x, side, kind=k, unit=unit)

    def chunk_of(self, sp: dict, j) -> dict:
        """Chunk ``j``'s units of each stacked parameter: ``[lc, ...]``."""
        lc = self.lc
        return {rel: lax.dynamic_slice_in_dim(sp[rel], j * lc, lc) for rel in self.lay.rel}

    def add_chunk(self, gsp: dict, j, dj: dict) -> dict:
        """Chunk ``j``'s gradient added in place (no zero-padded copy)."""
        lc = self.lc
        return {rel: lax.dynamic_update_slice_in_dim(
            gsp[rel], lax.dynamic_slice_in_dim(gsp[rel], j * lc, lc) + dj[rel], j * lc, 0) for rel in self.lay.rel}

    def chunk(self, spj: dict, r, j, x, side, sown: dict | None = None):
        """Chunk ``j`` of rank ``r`` on ``x``: its units in turn (``spj``: ``chunk_of(sp, j)``), a skipped slot
        passing ``x`` through. ``sown`` (``{name: [units, ...]}``): what each unit sows added at its row."""
        lay = self.lay
        rows = np.maximum(np.asarray(lay.rows).reshape(lay.valid.shape), 0)  # [pp, v, lc]: each slot's unit
        if lay.scanned:  # a slice of a scanned stack: a scan over its layers (its program one layer's size)
            def layer(ls, h):
                return self.unit_call(0, ls, h, side) if sown is None else self.sowing(0, ls, h, side)

            for policy, prevent_cse in reversed(lay.calls.remat):  # the user's nn.remat, its policy: B saves so
                layer = jax.checkpoint(layer, policy=policy, prevent_cse=prevent_cse)
            if sown is None:
                return lax.scan(lambda h, ls: (layer(ls, h), None), x, [spj[rel] for rel in lay.rel])[0]
            # what each layer sowed, stacked on the scan's output, added at its layer's row
            x, got = lax.scan(lambda h, ls: layer(ls, h), x, [spj[rel] for rel in lay.rel])
            idx = jnp.asarray(rows)[r, j]
            for n, v in got.items():
                sown[n] = sown[n].at[idx].add(v.astype(sown[n].dtype))
            return x
        for l in range(self.lc):
            leaves = [spj[rel][l] for rel in lay.rel]
            used, idx = self.slot_kinds[l]
            u = jnp.asarray(rows[:, :, l])[r, j] if lay.calls.unit_consts else 0
            call = (lambda k, ls, x, sd: self.unit_call(k, ls, x, sd, u)) if sown is None else \
                (lambda k, ls, x, sd: self.sowing(k, ls, x, sd, u))
            if len(used) == 1:
                y = call(used[0], leaves, x, side)
            else:  # the slot holds units of several kinds across ranks / chunks: each runs its own
                y = lax.switch(jnp.asarray(idx)[r, j], [functools.partial(call, k) for k in used], leaves, x, side)
            if sown is not None:  # (y, what the unit sowed): added at its unit's row (a skipped slot: nothing)
                y, got = y
                row, ok = jnp.asarray(rows[:, :, l])[r, j], self.valid[r, j, l]
                for n, v in got.items():
                    sown[n] = sown[n].at[row].add(jnp.where(ok, v, 0).astype(sown[n].dtype))
            x = jnp.where(self.valid[r, j, l], y, x) if self.skip else y
        return x

    def sowing(self, k: int, leaves, x, side, u=0, raw: bool = False):
        """``(unit_call, {name: what it sowed})``, float32, for every name some unit sows (zero where this kind
        does not; ``raw``: its own names only)."""
        calls = self.lay.calls
        calls.sown = {}
        try:
            y = self.unit_call(k, leaves, x, side, u)
            got = {n: jnp.asarray(v, jnp.float32) for n, v in calls.sown.items()}
        finally:
            calls.sown = None
        return y, got if raw else {n: got[n] if n in got else jnp.zeros(sh.shape, jnp.float32)
                                   for n, sh in self.sown_shapes.items()}

    def find_sown(self, sp: dict, rest, mb) -> dict:
        """``{name: [units, ...] float32 zeros}``: what the units sow (``self.sown_shapes``, ``self.sown_kinds``:
        each kind's names), traced (shapes only) once per kind (a scanned stack: its one layer); empty for units
        sowing nothing."""
        self.sown_shapes, self.sown_kinds = {}, {}
        leaves, side = [sp[rel][0] for rel in self.rels], self.side_of(rest, mb)
        for k in range(len(self.lay.calls.kinds)):
            got = jax.eval_shape(lambda: self.sowing(k, leaves, jnp.zeros(self.act.shape, self.act.dtype), side,
                                                     raw=True)[1])
            self.sown_kinds[k] = sorted(got)
            self.sown_shapes.update(got)
        n = len(self.lay.calls.kind_of)
        return {name: jnp.zeros((n, *sh.shape), jnp.float32) for name, sh in self.sown_shapes.items()}

    def side_of(self, rest, mb):
        """The units' side arrays (a mask), computed again on a stage after the first."""
        return self.lay.pre(self.loss_fn, rest, mb)[1] if self.lay.calls.side_shapes else []

    def loss_aux(self, rest, mb, h):
        return _split_loss(self.lay.post(self.loss_fn, rest, mb, h), "make_train_step")

    def over_fsdp(self, tree: dict, op) -> dict:
        """``op(x, dim)`` of each stage parameter cut over fsdp, on its tp block."""
        rels, fd = self.rels, self.fd
        return dict(zip(rels, map_tp_aware(self.hooks, self.st_entries, [tree[rel] for rel in rels],
                                           lambda i, x: x if fd[rels[i]] is None else op(x, fd[rels[i]]))))


def _region(st: _Stages, stored, batch):
    """The step's region (manual over pp and the data dims): this rank's reduced gradients and the metrics."""
    with st.hooks.installed() if st.hooks else contextlib.nullcontext(), stage_context(st, batch):
        return _region_body(st, stored, batch)


def _region_body(st: _Stages, stored, batch):
    r = lax.axis_index(st.ppd)
    sp, rest = stored[STAGES], stored[REST]
    sp = st.over_fsdp(sp, lambda x, d: lax.all_gather(x, st.lay.fsdp, axis=d, tiled=True))
    n_local = jax.tree.leaves(batch)[0].shape[0]
    accum_steps, m_count, act = st.accum_steps, st.m_count, st.act
    micro = jax.tree.map(lambda x: x.reshape(accum_steps, m_count, n_local // (accum_steps * m_count),
                                             *x.shape[1:]), batch)
    aux0 = jax.eval_shape(lambda: st.loss_aux(rest, jax.tree.map(lambda x: x[0, 0], micro),
                                              jnp.zeros(act.shape, act.dtype))[1])
    aux0z = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)
    sown0 = st.find_sown(sp, rest, jax.tree.map(lambda x: x[0, 0], micro))  # what the units sow: the metrics'

    def one_pass(carry, mbs):
        return _one_pass(st, r, sp, rest, aux0z, carry, mbs)

    zeros = jax.tree.map(jnp.zeros_like, (sp, rest))
    init = (*zeros, jnp.zeros((), jnp.float32), (aux0z, sown0))
    if accum_steps == 1:
        (gsp, grest, loss, aux), _ = one_pass(init, jax.tree.map(lambda x: x[0], micro))
    else:
        (gsp, grest, loss, aux), _ = lax.scan(one_pass, init, micro)
    return _reduce_grads(st, gsp, grest, loss, aux)


def _one_pass(st: _Stages, r, sp, rest, aux0z, carry, mbs):
    """One pass of the schedule over ``mbs`` (``num_microbatches`` micro-batches): the tick table run with a
    fresh stash, the gradients and the loss accumulated into ``carry``."""
    gsp, grest, loss, aux = carry
    xbuf = jnp.zeros((st.kx + 1, *st.act.shape), st.act.dtype)
    gbuf = jnp.zeros((st.kg + 1, *st.act.shape), st.act.dtype)
    zero_act = jnp.zeros(st.act.shape, st.act.dtype)
    ps = _Pass(st, r, sp, rest, mbs, aux0z, zero_act)
    f_plain = [ps.idle_f] + [functools.partial(ps.forward, ro) for ro in ROLES]  # code k: f_branches[k]
    # code k: b_branches[k - len(ROLES)] (k > 0)
    b_plain = [ps.idle_b] + [functools.partial(ps.backward, ro) for ro in ROLES]
    # a ring in the units: a switch holding a branch with one runs the chunk in those without (_cp.py)
    f_shadow = [ps.shadow_f] + f_plain[1:3] + [ps.shadow_f] * 2 if st.shadow else None
    b_shadow = [ps.shadow_b] + b_plain[1:] if st.shadow else None
    # the codes (of ``_local_codes``' list) whose branch runs a ring: a forward of a middle or the first stage (the
    # last stage's runs nothing), any backward
    f_branches, b_branches = (f_plain, f_shadow, (1, 2)), (b_plain, b_shadow, tuple(range(1, len(ROLES) + 1)))
    c = (xbuf, gbuf, gsp, grest, loss, aux)
    run_ticks = _ticks_unrolled if st.pm.unroll else _ticks_looped
    c = run_ticks(st, r, c, f_branches, b_branches)
    return tuple(c[2:]), None


class _Pass:
    """The branches a tick switches between, for one pass: a chunk's forward or backward on a micro-batch of
    ``mbs`` in each stage role (first, middle, last, only), or idle."""

    def __init__(self, st: _Stages, r, sp, rest, mbs, aux0z, zero_act):
        self.st, self.r, self.sp, self.rest, self.mbs, self.aux0z, self.zero_act = st, r, sp, rest, mbs, aux0z, zero_act

    def mb_of(self, m):
        return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, keepdims=False), self.mbs)

    def idle_f(self, x, j, m):
        return self.zero_act

    def idle_b(self, acc, x, g, j, m):
        return acc, self.zero_act

    def shadow_f(self, x, j, m, *_):
        """An idle or last-stage forward in a tick where another rank's forward runs a ring: chunk ``j`` on ``x``,
        nothing of it kept (``m`` is never negative), so that this rank's cp group runs the ring's
        collective-permutes as the others do (``spmd.parallel.pipelining._cp``)."""
        st = self.st
        y = st.chunk(st.chunk_of(self.sp, j), self.r, j, x, st.side_of(self.rest, self.mb_of(m)))
        return jnp.where(m < 0, y, self.zero_act)

    def shadow_b(self, acc, x, g, j, m):
        """An idle backward in a tick where another rank's backward runs (a ring in it): chunk ``j``'s forward and
        backward on ``x`` and ``g``, nothing of it kept (its sum tied to the loss under ``m < 0``, never true)."""
        st, r = self.st, self.r
        side = st.side_of(self.rest, self.mb_of(m))
        _, pull = jax.vjp(lambda sp_, x_: st.chunk(sp_, r, j, x_, side), st.chunk_of(self.sp, j), x)
        tie = sum(jnp.sum(d).astype(jnp.float32) for d in jax.tree.leaves(pull(g)))
        gsp, grest, loss, aux = acc
        return (gsp, grest, jnp.where(m < 0, loss + tie, loss), aux), self.zero_act

    def forward(self, role, x, j, m):
        """Chunk ``j`` forward on micro-batch ``m``; the last stage's waits for its backward (which computes the
        loss in its recomputation)."""
        st, rest = self.st, self.rest
        if role in ("last", "only"):
            return self.zero_act
        mb = self.mb_of(m)
        x, side = st.lay.pre(st.loss_fn, rest, mb) if role == "first" else (x, st.side_of(rest, mb))
        return st.chunk(st.chunk_of(self.sp, j), self.r, j, x, side)

    def backward(self, role, acc, x, g_in, j, m):
        """Chunk ``j`` recomputed from its stashed input under ``jax.vjp`` and pulled back with the received
        gradient (the last stage: with ``1 / M`` of the loss); its gradients accumulated into ``acc``."""
        st, rest, r, zero_act = self.st, self.rest, self.r, self.zero_act
        gsp, grest, loss, aux = acc
        mb = self.mb_of(m)
        first, last = role in ("first", "only"), role in ("last", "only")
        side = None if first else st.side_of(rest, mb)

        def g(rest_, sp_, x):
            sown = {n: jnp.zeros_like(v) for n, v in aux[1].items()}
            h = st.chunk(sp_, r, j, *(st.lay.pre(st.loss_fn, rest_, mb) if first else (x, side)), sown=sown or None)
            if not last:
                return h, (self.aux0z, sown)
            lo, ax = st.loss_aux(rest_, mb, h)
            return lo / st.m_count, (ax, sown)

        out, pull, (ax, sown) = jax.vjp(g, rest, st.chunk_of(self.sp, j), zero_act if first else x, has_aux=True)
        drest, dspj, dx = pull(jnp.ones_like(out) if last else g_in)
        gsp = st.add_chunk(gsp, j, dspj)
        grest = jax.tree.map(jnp.add, grest, drest)
        user, sown = aux[0], jax.tree.map(lambda a, b: a + b / st.m_count, aux[1], sown)  # each micro-batch's, once
        if last:
            loss = loss + out
            user = jax.tree.map(lambda a, b: a + b / st.m_count, user, ax)
        return (gsp, grest, loss, (user, sown)), (zero_act if first else dx)


_FCOLS, _BCOLS = ("fj", "fm", "fxr"), ("bj", "bm", "bxr", "bgr")


def _run(branches, code, used, args):
    """``branches[code]`` where ``used`` (the codes some rank runs) holds several, else the one directly.
    ``branches``: ``(plain, shadowed, ring)``: the shadowed ones (a ring in the units, else None) where a code of
    ``used`` is one of ``ring`` (its branch runs a ring), so that every rank runs one."""
    plain, shadowed, ring = branches
    branches = shadowed if shadowed is not None and any(k in ring for k in used) else plain
    if len(used) == 1:
        return branches[used[0]](*args)
    return lax.switch(code, [branches[k] for k in used], *args)


def _compute(c, fc, bc, fused, bused, frow, brow, f_branches, b_branches):
    """One tick's forward and backward on this rank. The branches get the stash slots they read, not the
    stash (a buffer two branches take as an operand is copied at every tick)."""
    xb, gb, *acc = c
    fj, fm, fxr = frow
    bj, bm, bxr, bgr = brow
    sf = _run(f_branches, fc, fused, (xb[fxr], fj, fm))
    acc, sb = _run(b_branches, bc, bused, (tuple(acc), xb[bxr], gb[bgr], bj, bm))
    return (xb, gb, *acc), sf, sb


def _after_previous(c, m):
    """``m``, tied to the carry's loss (``min(m, m + isnan)`` is ``m``; XLA can't tell): else a tick reading no
    stash slot ran ahead, holding GPipe's memory under 1F1B (docs/training/layouts.md)."""
    return jnp.minimum(m, m + jnp.isnan(c[4]).astype(m.dtype))


def _local_codes(codes, shift):
    """A tick's (or the step's) branch codes -> the used list and each rank's index into it."""
    codes = np.asarray(codes)
    used = sorted({int(k) - shift if k else 0 for k in codes.flat})
    return used, np.vectorize(lambda k: used.index(int(k) - shift if k else 0))(codes).astype(np.int32)


def _ticks_unrolled(st: _Stages, r, c, f_branches, b_branches):
    """The ticks unrolled: each tick runs only the branches some rank runs then, and sends over exactly its
    table's pairs."""
    ppd = st.ppd
    for tb in st.tables:
        pick = lambda a: jnp.asarray(a)[r]  # noqa: E731
        fused, fl = _local_codes(tb["fcode"], 0)  # only the branches some rank runs at this tick
        bused, bl = _local_codes(tb["bcode"], len(ROLES))
        fj, fm, fxr = [pick(tb[k]) for k in _FCOLS]
        bj, bm, bxr, bgr = [pick(tb[k]) for k in _BCOLS]
        c, sf, sb = _compute(c, pick(fl), pick(bl), fused, bused, [fj, _after_previous(c, fm), fxr],
                             [bj, _after_previous(c, bm), bxr, bgr], f_branches, b_branches)
        xb, gb, *others = c
        if tb["fwd"]:
            xb = xb.at[pick(tb["rx"])].set(lax.ppermute(sf, ppd, tb["fwd"]))
        if tb["bwd"]:
            gb = gb.at[pick(tb["rg"])].set(lax.ppermute(sb, ppd, tb["bwd"]))
        c = (xb, gb, *others)
    return c


def _ticks_looped(st: _Stages, r, c, f_branches, b_branches):
    """One loop over the ticks: each tick's sends picked from the distinct pair sets."""
    ppd, tables = st.ppd, st.tables
    fused, fl = _local_codes(np.stack([tb["fcode"] for tb in tables]), 0)
    bused, bl = _local_codes(np.stack([tb["bcode"] for tb in tables]), len(ROLES))
    fl, bl = jnp.asarray(fl), jnp.asarray(bl)
    cols = {k: jnp.asarray(np.stack([tb[k] for tb in tables])) for k in (*_FCOLS, *_BCOLS, "rx", "rg")}
    sends = {}
    for d in ("fwd", "bwd"):
        sets = sorted({tuple(tb[d]) for tb in tables if tb[d]})
        sends[d] = (jnp.asarray([sets.index(tuple(tb[d])) + 1 if tb[d] else 0 for tb in tables]),
                    [lambda x: jnp.zeros_like(x)] + [lambda x, p=p: lax.ppermute(x, ppd, list(p)) for p in sets])

    def tick(t, c):
        c, sf, sb = _compute(c, fl[t, r], bl[t, r], fused, bused, [cols[k][t, r] for k in _FCOLS],
                             [cols[k][t, r] for k in _BCOLS], f_branches, b_branches)
        xb, gb, *others = c
        xb = xb.at[cols["rx"][t, r]].set(lax.switch(sends["fwd"][0][t], sends["fwd"][1], sf))
        gb = gb.at[cols["rg"][t, r]].set(lax.switch(sends["bwd"][0][t], sends["bwd"][1], sb))
        return (xb, gb, *others)

    return lax.fori_loop(0, len(tables), tick, c)


def _reduce_grads(st: _Stages, gsp, grest, loss, aux):
    """The accumulated gradients and metrics averaged over the accumulation steps, then reduced: the rest over
    pp (summed: each end's part) and the data dims (averaged), one all-reduce each; the stage gradients
    reduce-scattered over fsdp (the gather's transpose), the whole ones and (HSDP) the shards averaged over
    the other data dims (those of size over 1)."""
    lay, plan, hooks, ppd, data, fd = st.lay, st.plan, st.hooks, st.ppd, st.data, st.fd
    k = st.accum_steps
    gsp = jax.tree.map(lambda g: g / k, gsp)
    grest = jax.tree.map(lambda g: g / k, grest)
    aux, sown = aux
    metrics = {"loss": loss / k, **jax.tree.map(lambda a: a / k, aux)}
    if sown:  # what the units sowed (an MoE's drops), each unit's on its rank: by unit, summed over pp below
        kinds = lay.calls.kind_of
        metrics.update({f"intermediates/{u}/{n}": sown[n][i] / k for i, u in enumerate(lay.units)
                        for n in st.sown_kinds[kinds[i]]})
    n_data = int(np.prod([st.pm.mesh.size(d) for d in data])) if data else 1
    rp = list(grest)
    grest = dict(zip(rp, [g / n_data for g in reduce_tp_aware(
        hooks, [plan.entry(f"{REST}/{p}") for p in rp], [grest[p] for p in rp], (ppd, *data))]))
    metrics = jax.tree.map(lambda g: g / n_data, lax.psum(metrics, (ppd, *data)))
    cut = {rel for rel in lay.rel if fd[rel] is not None}
    gsp = st.over_fsdp(gsp, lambda g, d: lax.psum_scatter(g, lay.fsdp, scatter_dimension=d, tiled=True) / lay.n_fsdp)
    # an expert's gradient over ep is its own (its tokens came from every ep rank through the all-to-alls, its
    # sum of their losses): averaged over the other data dims only and divided by ep
    experts = set(st.ed)
    n_ep = st.pm.mesh.size(st.ep) if st.ep else 1
    out = {}
    for group, axes in ((lambda rel: rel not in cut and rel not in experts, data),
                        (lambda rel: rel in cut and rel not in experts, tuple(d for d in data if d != lay.fsdp)),
                        (lambda rel: rel not in cut and rel in experts, tuple(d for d in data if d != st.ep)),
                        (lambda rel: rel in cut and rel in experts,
                         tuple(d for d in data if d not in (lay.fsdp, st.ep)))):
        rels = [rel for rel in gsp if group(rel)]
        gs = [gsp[rel] for rel in rels]
        # a data dim of size 1 (a named dp=1) reduces nothing: left out (its all-reduce over singleton groups
        # would stay in the compiled program, moving the whole gradients for nothing)
        axes = tuple(d for d in axes if st.pm.mesh.size(d) > 1)
        if axes and gs:  # (HSDP: the shards averaged over the other data dims)
            gs = reduce_tp_aware(hooks, [plan.entry(f"{STAGES}/{rel}") for rel in rels], gs, axes, lax.pmean)
        out.update({rel: g / n_ep if rel in experts else g for rel, g in zip(rels, gs)})
    gsp = {rel: out[rel] for rel in gsp}
    return {STAGES: gsp, REST: grest}, metrics
