"""One train step for every layout: ``init_train_state``, ``make_train_step``, ``unshard_params``.

``make_train_step(model, loss_fn, optimizer)`` gives a ``TrainStep``, a jitted ``(state, batch) -> (state,
metrics)`` that can also be lowered, compiled, measured and printed (``spmd.parallel.step._protocol``), for a
model laid out by ``parallelize_module`` / ``fully_shard`` (or neither: DDP over every dim of ``mesh``):

- the region (``spmd.parallel.styles._hooks``) is manual over the data dims (every mesh dim but tp): each device
  takes its rows of the batch and runs ``loss_fn(params, batch)``, the user's own 1-device loss, on them;
  the root unit is gathered once, each FSDP unit right before it runs, the tp styles put their layouts;
- ``jax.grad`` hands back each sharded parameter's gradient reduce-scattered over the shard dim (the
  all-gather's transpose), averaged over the shard dim, then over the replicate dims (HSDP) by one
  all-reduce of the shard bytes; parameters whole on the data dims: one all-reduce over them;
- the optimizer (any optax transformation) runs in global view on the stored arrays: elementwise on the
  shards, a global norm costs a scalar all-reduce;
- ``accum_steps=k`` gathers every unit once, accumulates the full local gradients over ``k``
  micro-batches and reduces once (torch's ``no_sync``); a gradient zero by construction (read off one
  micro-batch's backward pass, as without accumulation) is neither accumulated nor reduced.

The state is a ``TrainState`` whose ``plan`` (static) is the ``ParamPlan`` it was laid out by; a step
refuses a state of another plan. A model that is an ``OwnsTrainStep`` (a pipeline, or a user's own layout)
brings its own state, step and inverse: the three functions hand it to its methods.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements import Shard
from spmd._mesh import DeviceMesh
from spmd.parallel.plan._checks import (check_batch_leaves, check_loss, check_opt_state, check_rng, describe_tree,
                                        params_hint)
from spmd.parallel.cost._comm import format_communication, step_communication
from spmd.parallel.context._calls import (CALL_SCOPE, ContextCalls, check_seq, experts_routers, scopes_of, seq_len,
                                         with_context)
from spmd.parallel.context._seq import seq_inputs
from spmd.parallel.styles._experts import with_experts
from spmd.parallel.cost._recompute import SYNC_BN, recomputed_collectives
from spmd.parallel.step._batch_norm import BATCH_STATS_REASON, sync_batch_norm, sync_nnx_batch_norm
from spmd.parallel.step._grad_layout import gathered_dot_grads, out_cut_gathers, transposed_dot_grads, zero_grads
from spmd.parallel.step._heads import (check_whole_sequence, dot_params, head_splits, lookup_cotangents,
                                       positional_params, whole_over_tp, whole_sequence_products)
from spmd.parallel.step._model_checks import check_batch as _check_batch
from spmd.parallel.step._model_checks import check_model_params, check_seen, check_state_params, held_params
from spmd.parallel.step._protocol import OwnsTrainStep, TrainStep
from spmd.parallel.styles._hooks import Hooks
from spmd.parallel.styles._nnx import is_nnx, nnx_batch_stats, nnx_loss, nnx_params, nnx_trace_seen
from spmd.parallel.plan._param_plan import ROOT, ParamPlan
from spmd.parallel.plan._shard import entry_sharding, map_like_params, shard_params, unshard_tree
from spmd.parallel.plan._scan import check_unscanned, find_stacked, stacked_in, trace_seen
from spmd.parallel.styles._transforms import ParallelModule, as_parallel, build_plan, out_cut_of, stacked_of

__all__ = ["TrainState", "init_train_state", "make_train_step", "unshard_params", "state_shardings"]


@flax.struct.dataclass
class TrainState:
    """Everything a run carries from step to step: ``step``, ``params`` and ``opt_state`` as stored
    (padded shards), the ``plan`` that laid them out (static), and ``batch_stats``: the model's ``batch_stats``
    collection (its ``nn.BatchNorm`` running statistics, torch's buffers), whole on every device, or ``None``."""

    step: jax.Array
    params: Any
    opt_state: Any
    plan: ParamPlan | None = flax.struct.field(pytree_node=False, default=None)
    batch_stats: Any = None  # a linen model's ``batch_stats`` collection (BatchNorm's running statistics), replicated


def _check_optimizer(optimizer: Any, where: str) -> None:
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"{where}: optimizer={optimizer!r} must be an optax.GradientTransformation, e.g. "
                        "optax.adamw(1e-3).")


def state_shardings(plan: ParamPlan, mesh: DeviceMesh, params: Any, opt_state: Any, optimizer) -> tuple:
    rep = NamedSharding(mesh.jax_mesh, P())
    return (map_like_params(plan, params, lambda x, e: entry_sharding(e, mesh)),
            map_like_params(plan, opt_state, lambda x, e: entry_sharding(e, mesh), optimizer=optimizer,
                            other=lambda x: rep))


def init_train_state(model: Any, optimizer: optax.GradientTransformation, *init_args: Any, params: Any = None,
                     mesh: DeviceMesh | None = None, batch_stats: Any = None) -> TrainState:
    """Step 0, laid out by the model's layouts.

    ``params=``: place these (logical) parameters; ``init_args``, if given, are example inputs (a model
    whose blocks run under ``nn.scan`` needs them: the plan must know the stacked layer axis). Otherwise ``init_args = (rng, *example_inputs)``:
    initialize straight into the shards (``model.init`` compiled with the shards as its outputs) with the
    values the unwrapped model's ``init`` gives for that rng. An nnx model holds its parameters: give none;
    its ``init_args`` are example inputs it is called on (``model(*init_args)``: blocks under ``nnx.scan``).
    ``mesh=``: for a model with neither transform (DDP over every dim of ``mesh``).

    ``params=`` must be the model's (paths, shapes, dtypes): checked against ``nnx.state(model, nnx.Param)``,
    the ``.params`` a Hugging Face Flax model holds, a linen model's abstract ``init`` on the example inputs (``init_train_state(model, optimizer, x,
    params=params)``), or the tree an earlier state or step found for this model object. A linen model's
    parameter shapes follow from its inputs (a ``Dense`` kernel's first dim is its input's last dim), so with
    none of them there is nothing to compare ``params=`` with here: the step checks them at its first call,
    before it compiles.

    ``batch_stats``: a linen model's ``batch_stats`` collection (``nn.BatchNorm``'s running statistics) to
    carry in the state, whole on every device (``model.init(rng, x)["batch_stats"]``); initialized from an
    rng, a model that has the collection gets its ``init``'s. A state with ``batch_stats`` calls the loss as
    ``loss_fn(params, batch_stats, batch)`` (``make_train_step``). An nnx model's ``nnx.BatchStat`` values
    (``nnx.BatchNorm``'s) are its state's ``batch_stats`` (a dict by path) without the argument; its loss
    stays ``loss_fn(model, batch)``.
    """
    where = "init_train_state"
    _check_optimizer(optimizer, where)
    if isinstance(model, OwnsTrainStep):  # a layout with a state and step of its own (a pipeline)
        inner = getattr(model, "module", None)
        inner = inner.module if isinstance(inner, ParallelModule) else inner
        if is_nnx(inner):
            _check_no_nnx_batch_stats(where, inner)
        if batch_stats is not None:
            raise ValueError(f"{where}: batch_stats= is not supported by {type(model).__name__} (a layout that owns "
                             f"its step): {BATCH_STATS_REASON}")
        return model.init_train_state(optimizer, *init_args, params=params, mesh=mesh)
    pm = as_parallel(model, mesh, where)
    mesh = pm.mesh
    inner = pm.module
    rep = NamedSharding(mesh.jax_mesh, P())
    if is_nnx(inner) and batch_stats is None:  # its nnx.BatchNorm's running statistics, carried by the state
        batch_stats = nnx_batch_stats(inner)
    elif batch_stats is not None:
        if is_nnx(inner):
            raise TypeError(f"{where}: batch_stats= is for a linen model; an nnx model holds its BatchNorm "
                            "statistics itself (nnx.BatchStat), and the state carries them.")
        if not jax.tree.leaves(batch_stats):
            raise ValueError(f"{where}: batch_stats={batch_stats!r} holds no arrays; pass the model's "
                             "variables['batch_stats'] (or leave it out).")
        batch_stats = jax.device_put(batch_stats, rep)
    known = None  # the model's own parameters (shapes), where known
    if is_nnx(inner):
        if params is None:
            params = nnx_params(inner)
        else:
            check_model_params(where, "params=", inner, params)
        known = params  # init_args: example inputs the module is called on (its nnx.scan blocks' layer axis)
    elif params is not None:
        hint = params_hint(params, sure=True)
        if hint:
            raise ValueError(f"{where}:{hint}")
        if init_args or held_params(inner) is not None:
            known = check_model_params(where, "params=", inner, params, init_args)
        else:
            check_seen(where, "params=", pm, params, "Pass this model's parameters (model.init(rng, x)['params']).")
    if params is None:
        if not init_args:
            raise TypeError(f"{where}: give params=, or (rng, *example_inputs) to initialize the model.")
        rng, *xs = init_args
        check_rng(where, rng)
        variables, seen = trace_seen(lambda r: inner.init(r, *xs), rng)
        abstract = variables["params"]
        plan = build_plan(pm, abstract, find_stacked(seen, abstract),
                          out_cut_of(pm, abstract, xs, batch_stats if batch_stats is not None else variables.get(
                              "batch_stats")))
        shardings = map_like_params(plan, abstract, lambda x, e: entry_sharding(e, mesh))
        from spmd.parallel.plan._shard import pad_tree

        stats = batch_stats is None and "batch_stats" in variables  # the model's running statistics, from init
        stored, got = jax.jit(lambda r: (lambda v: (pad_tree(v["params"], plan), v["batch_stats"] if stats else None))(
            inner.init(r, *xs)), out_shardings=(shardings, rep))(rng)
        batch_stats = got if stats else batch_stats
    else:
        plan = build_plan(pm, params, stacked_of(inner, params, init_args, batch_stats),
                          out_cut_of(pm, params, init_args, batch_stats))
        stored = shard_params(params, plan, mesh)
    opt_abstract = jax.eval_shape(optimizer.init, stored)
    _, opt_sh = state_shardings(plan, mesh, stored, opt_abstract, optimizer)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(stored)
    pm._plans[plan.treedef] = plan
    known = abstract if params is None else known
    if known is not None and describe_tree(known) not in pm._params_seen:
        pm._params_seen.append(describe_tree(known))
    step = jax.device_put(jnp.zeros((), jnp.int32), rep)
    return TrainState(step=step, params=stored, opt_state=opt_state, plan=plan, batch_stats=batch_stats)


def _check_no_nnx_batch_stats(where: str, model: Any) -> None:
    """An nnx model holding ``nnx.BatchStat`` variables (``nnx.BatchNorm``'s running statistics) is refused by a
    pipeline (its micro-batches' statistics are not the batch's)."""
    from flax import nnx

    stats = [path for path, v in nnx.iter_graph(model) if isinstance(v, nnx.BatchStat)]
    if stats:
        name = "/".join(str(p) for p in stats[0])
        raise ValueError(
            f"{where}: model={type(model).__name__} holds nnx.BatchStat variables ({name!r} and {len(stats) - 1} "
            f"more: nnx.BatchNorm's running statistics), which a pipeline does not carry: {BATCH_STATS_REASON}")


def unshard_params(model: Any, params: Any, *example_inputs: Any) -> Any:
    """The logical (unpadded) parameter values, replicated: the inverse of ``init_train_state``'s layout.

    ``params``: ``state.params`` (or a ``TrainState``) of a state built by ``init_train_state(model, ...)``.
    They are checked against the model's own tree (paths, shapes, dtypes): an nnx model's state; a Hugging Face
    Flax model's ``.params``; a linen model's
    abstract ``init`` on ``example_inputs`` when given; else the tree ``init_train_state`` or the step found
    for this model object. A linen model's parameter shapes follow from its inputs (a ``Dense`` kernel's first
    dim is its input's last dim), so a linen model that has done neither and gets no example inputs has no tree
    to compare with: its ``params`` come back unchecked (pass ``example_inputs`` to check them).
    """
    where = "unshard_params"
    if isinstance(model, OwnsTrainStep):
        if example_inputs:
            raise TypeError(f"{where}: {type(model).__name__} checks the parameters against its own layouts; give "
                            "it no example inputs (unshard_params(model, state)).")
        return model.unshard_params(params)
    if isinstance(params, TrainState):
        plan, params = params.plan, params.params
    else:
        plans = getattr(model, "_plans", {})
        plan = plans.get(jax.tree_util.tree_structure(params))
        if plan is None and not isinstance(model, ParallelModule):
            plan = _replicated_plan(model, params)
    if plan is None:
        raise ValueError(f"{where}: these parameters were not laid out by init_train_state(model, ...) for "
                         f"{model!r}; pass that state (or its .params).")
    logical = jax.tree_util.tree_unflatten(plan.treedef, [jax.ShapeDtypeStruct(e.shape, e.dtype)
                                                          for e in plan.entries])
    inner = model.module if isinstance(model, ParallelModule) else model
    if is_nnx(inner) or example_inputs or held_params(inner) is not None:
        check_model_params(where, "params", inner, logical, example_inputs, fix="Pass the state (or its .params) "
                            "built for this model.")
    else:
        check_seen(where, "params", model, logical, "Pass the state (or its .params) built for this model.")
    return unshard_tree(params, plan, model.mesh if isinstance(model, ParallelModule) else None)


def _replicated_plan(model: Any, params: Any) -> ParamPlan | None:
    """The plan of a model with no layout trained data-parallel (``mesh=``): every parameter whole on every
    device, stored unpadded; ``None`` unless every leaf is such an array."""
    from spmd.parallel.styles._transforms import build_plan as _plan

    leaves = jax.tree.leaves(params)
    if not leaves or not all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                             and x.sharding.is_fully_replicated for x in leaves):
        return None
    mesh = DeviceMesh.from_jax(leaves[0].sharding.mesh)
    return _plan(ParallelModule(model, mesh), params)


def _split_loss(out: Any, where: str) -> tuple[jax.Array, dict]:
    if isinstance(out, tuple) and len(out) == 2:
        loss, aux = out
    else:
        loss, aux = out, {}
    if not isinstance(aux, dict):
        aux = {"aux": aux}
    if not hasattr(loss, "shape") or np.shape(loss) != ():
        raise ValueError(f"{where}: loss_fn returned {loss!r}; it must return a scalar loss, or (loss, aux) with aux "
                         "a dict of scalar metrics.")
    check_loss(where, loss, aux)
    return loss, aux


def make_train_step(model: Any, loss_fn: Callable, optimizer: optax.GradientTransformation, *, accum_steps: int = 1,
                    mesh: DeviceMesh | None = None, check_finite: bool | str = False,
                    batch_norm: str = "broadcast") -> TrainStep:
    """The train step ``(state, batch) -> (state, metrics)`` of any layout (see the module doc): a ``TrainStep``,
    whose ``lower``, ``compiled``, ``memory``, ``communication`` and ``table`` read the step before it runs.
    A model that is an ``OwnsTrainStep`` (a pipeline) makes its own.

    ``loss_fn(params, batch)``: what the user writes on one device (an nnx model: ``loss_fn(model, batch)``);
    it returns the mean loss over its batch, or ``(loss, aux)`` with ``aux`` a dict of scalar metrics.
    ``batch``: a pytree of global arrays (host arrays are fine) whose leading dim the data dims divide.
    Metrics: ``loss``, the ``aux`` entries (averaged over the data dims) and ``grad_norm``.

    The first call with a state of a new plan checks, before compiling, that ``state.params`` are the model's
    (an nnx model's own state; a linen model's abstract ``init`` on the inputs ``loss_fn`` applies it to, read
    off one abstract trace of the loss) and ``state.opt_state`` the optimizer's (``optimizer.init``
    abstractly), naming the first path that differs.

    ``check_finite``: what a step whose loss or gradient norm is not finite (NaN, inf) does. ``False`` (the
    default): nothing, its update is applied as any other. ``"skip"``: the step keeps the state's ``params``
    and ``opt_state`` as they came in (a select inside the jitted step: no NaN reaches the state), advances
    ``step`` (it counts the batches the step consumed) and sets ``metrics["nonfinite"]`` to 1 (0 on a finite
    step); nothing waits on the devices. ``True``: the same, and the call raises ``FloatingPointError`` naming
    the step, after reading the flag from the devices (one wait per step); the state passed in is intact.

    A state with ``batch_stats`` (a linen model with ``nn.BatchNorm``: ``init_train_state``) calls
    ``loss_fn(params, batch_stats, batch)``, which returns ``(loss, new_batch_stats)`` or ``((loss, aux),
    new_batch_stats)``: the loss written on one device with ``model.apply({"params": params, "batch_stats":
    batch_stats}, x, mutable=["batch_stats"])``. An nnx model's (``nnx.BatchNorm``) keeps ``loss_fn(model,
    batch)``: its BatchNorms update their ``nnx.BatchStat`` values on the step's copy of the model, which the
    step hands back as the new ``batch_stats``. ``batch_norm`` says what the data-parallel ranks do with them,
    as torch does: ``"broadcast"`` (DDP's ``broadcast_buffers=True``, the default): each rank normalizes with
    its own rows' statistics, and the state keeps data rank 0's updated running statistics (one all-reduce of
    their bytes per step); ``"sync"`` (torch's ``SyncBatchNorm``): every ``nn.BatchNorm`` computes its batch
    mean and variance over the whole global batch (one all-reduce over the data dims per call and its
    backward), so the step equals 1-device training on the global batch. A BatchNorm that names its own
    ``axis_name`` keeps it.
    """
    where = "make_train_step"
    if not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn={loss_fn!r} must be callable as loss_fn(params, batch) -> loss or "
                        "(loss, aux).")
    _check_optimizer(optimizer, where)
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"{where}: accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")
    if not isinstance(check_finite, (bool, str)) or check_finite not in (False, True, "skip"):
        raise (ValueError if isinstance(check_finite, str) else TypeError)(
            f"{where}: check_finite={check_finite!r} must be False (no check), 'skip' (a non-finite step keeps the "
            "previous params and opt_state) or True (the same, and the call raises FloatingPointError).")
    if batch_norm not in ("broadcast", "sync"):
        raise (ValueError if isinstance(batch_norm, str) else TypeError)(
            f"{where}: batch_norm={batch_norm!r} must be 'broadcast' (each rank its own rows' statistics, the state "
            "keeps data rank 0's: DDP's broadcast_buffers) or 'sync' (statistics over the global batch: "
            "SyncBatchNorm).")
    if isinstance(model, OwnsTrainStep):  # a layout with a step of its own (a pipeline)
        inside = check_finite and "check_finite" in inspect.signature(model.make_train_step).parameters
        extra = {"check_finite": check_finite} if inside else {}  # its step keeps or drops the update itself
        own = model.make_train_step(loss_fn, optimizer, accum_steps=accum_steps, mesh=mesh, **extra)
        if not isinstance(own, TrainStep):
            raise TypeError(f"{where}: {type(model).__name__}.make_train_step returned {type(own).__name__}; an "
                            "OwnsTrainStep layout's make_train_step must return a spmd.parallel.TrainStep (subclass "
                            "it: __call__, lower, communication, table).")
        return _FiniteChecked(own, check_finite) if check_finite and not inside else own
    return _LayoutStep(as_parallel(model, mesh, where), loss_fn, optimizer, accum_steps, check_finite, batch_norm)


class _LayoutStep(TrainStep):
    """The step of a model laid out by ``parallelize_module`` / ``fully_shard`` (or neither): one compiled
    program per plan (``_build``), each plan's state checked against the model once, before it compiles."""

    def __init__(self, pm: ParallelModule, loss_fn: Callable, optimizer, accum_steps: int,
                 check_finite: bool | str, batch_norm: str = "broadcast"):
        self._pm, self._loss_fn, self._optimizer = pm, loss_fn, optimizer
        self._accum_steps, self._check_finite = accum_steps, check_finite
        self._build = functools.lru_cache(maxsize=4)(lambda plan: _build(pm, loss_fn, optimizer, accum_steps, plan,
                                                                         bool(check_finite), batch_norm))
        self._verified: set = set()  # the plans checked against this step's model (once each)

    def __repr__(self) -> str:
        return f"TrainStep({self._pm!r}, accum_steps={self._accum_steps})"

    def _checked(self, state: TrainState, batch: Any) -> Any:
        """``batch`` as arrays, ``state`` checked against the model (once per plan)."""
        pm = self._pm
        if not isinstance(state, TrainState) or state.plan is None:
            raise TypeError(f"train_step: state={type(state).__name__} must be the TrainState init_train_state(model, "
                            "optimizer, ...) returns.")
        batch = _as_arrays(batch)
        check_batch_leaves("train_step", batch)
        stats = state.batch_stats
        if stats is not None and self._accum_steps > 1:
            raise ValueError(f"train_step: a state with batch_stats and accum_steps={self._accum_steps}: the running "
                             "statistics of micro-batches are not accumulated; use accum_steps=1 (or a larger "
                             "batch).")
        loss_fn = self._loss_fn if stats is None or is_nnx(pm.module) else (lambda p, b: self._loss_fn(p, stats, b))
        key = (state.plan, jax.tree_util.tree_structure(state.opt_state), jax.tree_util.tree_structure(stats))
        if key not in self._verified:
            logical = jax.tree_util.tree_unflatten(
                state.plan.treedef, [jax.ShapeDtypeStruct(e.shape, e.dtype) for e in state.plan.entries])
            if build_plan(pm, logical, stacked_in(state.plan), state.plan.out_cut) != state.plan:
                raise ValueError("train_step: the state was laid out for another model or plan than this step's "
                                 f"({pm!r}); build it with init_train_state on the same model.")
            seen = check_state_params(pm, loss_fn, logical, batch)
            check_opt_state("train_step", self._optimizer, state.params, state.opt_state)
            if pm.tp or set(state.plan.units) - {ROOT}:
                if is_nnx(pm.module):
                    seen = nnx_trace_seen(pm.module, logical, lambda m: loss_fn(m, batch))
                check_unscanned(state.plan, loss_fn, logical, batch, seen=seen, nnx=is_nnx(pm.module))
            self._verified.add(key)
        return batch

    def __call__(self, state: TrainState, batch: Any):
        new, metrics = self._build(state.plan)(state, self._checked(state, batch))
        if self._check_finite is True:
            _raise_nonfinite(state, metrics)
        return new, metrics

    def lower(self, state: TrainState, batch: Any):
        """The jitted step lowered for ``(state, batch)`` (``.compile().as_text()``: its HLO)."""
        built, batch = self._build(state.plan), _as_arrays(batch)
        built.prepare(state, batch)
        return built.jitted.lower(state, batch)

    def communication(self, state: TrainState, batch: Any) -> dict:
        """What one step communicates per device, analytically (``spmd.parallel.cost._comm``), before it runs."""
        return self._build(state.plan).communication(state, _as_arrays(batch))

    def table(self, state: TrainState, batch: Any) -> str:
        """The plan and the step's communication, printable before anything runs."""
        return state.plan.table() + "\n" + format_communication(self.communication(state, batch))


def _keep_finite(old: TrainState, new: TrainState, metrics: dict) -> tuple[TrainState, dict]:
    """``new`` where the step's loss and gradient norm are finite, else ``old``'s params, opt_state and
    batch_stats (its ``step`` advanced); ``metrics["nonfinite"]``: 1.0 where the update was skipped."""
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    params, opt_state, stats = jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                            (new.params, new.opt_state, new.batch_stats),
                                            (old.params, old.opt_state, old.batch_stats))
    return (new.replace(params=params, opt_state=opt_state, batch_stats=stats),
            {**metrics, "nonfinite": (~finite).astype(jnp.float32)})


def _raise_nonfinite(state: TrainState, metrics: dict) -> None:
    """``check_finite=True``: a ``FloatingPointError`` where the step's ``metrics["nonfinite"]`` is set."""
    if bool(metrics["nonfinite"]):
        n = int(jax.device_get(state.step)) + 1
        loss, norm = (float(metrics[k]) for k in ("loss", "grad_norm"))
        raise FloatingPointError(
            f"train_step: step {n} (from state.step={n - 1}) has a non-finite loss ({loss}) or gradient norm "
            f"({norm}); its update was not applied and the state passed in is intact. Look at that step's batch "
            "and the learning rate (or clip the gradients), or use make_train_step(..., check_finite='skip') "
            "to skip such steps' updates and go on.")


class _FiniteChecked(TrainStep):
    """An ``OwnsTrainStep`` layout's step with ``check_finite``: its update kept only where the loss and gradient
    norm are finite (``_keep_finite``, jitted after the step), and with ``True`` a ``FloatingPointError`` on a
    non-finite step; everything else is the step's own (its ``lower``, ``table``, ``schedule``, ...)."""

    def __init__(self, step: TrainStep, check_finite: bool | str):
        self._step, self._check_finite, self._keep = step, check_finite, jax.jit(_keep_finite)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the class or the instance
        if name.startswith("__") or name == "_step":
            raise AttributeError(name)
        return getattr(self._step, name)

    def __repr__(self) -> str:
        return f"{self._step!r} (check_finite={self._check_finite!r})"

    def __call__(self, state: TrainState, batch: Any):
        new, metrics = self._keep(state, *self._step(state, batch))
        if self._check_finite is True:
            _raise_nonfinite(state, metrics)
        return new, metrics

    def lower(self, state, batch):
        return self._step.lower(state, batch)

    def compiled(self, state, batch):
        return self._step.compiled(state, batch)

    def communication(self, state, batch) -> dict:
        return self._step.communication(state, batch)

    def table(self, state, batch) -> str:
        return self._step.table(state, batch)


class _Built:
    """One plan's compiled step (``_build``): ``jitted`` (the jax.jit), ``plan``, ``run(state, batch)`` (the
    batch checked, then the jitted step) and ``communication(state, batch)`` (the analytic table)."""

    def __init__(self, jitted: Callable, plan: ParamPlan, run: Callable, communication: Callable,
                 prepare: Callable):
        self.jitted, self.plan, self._run, self.communication = jitted, plan, run, communication
        self.prepare = prepare  # (state, batch): read the model's heads once, before the step is traced

    def __call__(self, state: TrainState, batch: Any):
        return self._run(state, batch)


def _split_stats(out: Any, stats: Any, where: str) -> tuple[Any, Any]:
    """``(loss output, new batch_stats)`` of a loss that takes ``batch_stats``, its new statistics checked
    against the old (the same tree)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"{where}: the state holds batch_stats, so loss_fn(params, batch_stats, batch) must return "
                         f"(loss, new_batch_stats) or ((loss, aux), new_batch_stats); got {type(out).__name__}.")
    out, new = out
    if isinstance(new, dict) and set(new) == {"batch_stats"} and "batch_stats" not in stats:
        new = new["batch_stats"]  # the `updates` of model.apply(..., mutable=["batch_stats"]) as they came
    if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(stats):
        raise ValueError(f"{where}: loss_fn returned new batch_stats with other paths than the state's "
                         f"({describe_tree(new)} vs {describe_tree(stats)}); return the model's updated "
                         "'batch_stats' collection (model.apply(..., mutable=['batch_stats'])[1]['batch_stats']).")
    return out, new


def _placed(base: list, idx: list[int], values) -> list:
    """``base`` with ``values`` at the positions ``idx``."""
    out = list(base)
    for i, v in zip(idx, values):
        out[i] = v
    return out


def _build(pm: ParallelModule, loss_fn: Callable, optimizer, accum_steps: int, plan: ParamPlan,
           keep_finite: bool = False, batch_norm: str = "broadcast") -> "_Built":
    mesh = pm.mesh
    names = mesh.mesh_dim_names
    sizes = dict(zip(names, mesh.shape))
    tp = pm.tp.mesh_dim if pm.tp else None
    cp = pm.cp
    n_cp = sizes[cp] if cp else 1
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
    positional, whole_seq, seq_of, dotted, cotangents = set(), set(), {}, set(), {}

    def _context(mb, hooks):
        if cp is None:
            return contextlib.nullcontext()
        calls = ContextCalls(mesh.jax_mesh, n_cp, seq_len(mb), cp, gathered=frozenset(whole_seq),
                             tp=(tp, sizes[tp]) if tp else None, seq_of=seq_of)
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
            if fsdp is not None and not gather_flip:  # the first trace (prepare's): which to gather transposed
                found.clear()
                found.extend(e.path for e, f in zip(entries, gathered_dot_grads(closed)) if f)
            (g,) = backward(seed)
            recomputed.clear()
            recomputed.append(recomputed_collectives(closed, sizes))
            recomputed.append(recomputed_collectives(closed, sizes, scope=SYNC_BN))
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
                               for k, v in recomputed_collectives(closed, sizes).items()})
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
    # the fsdp-cut parameters gathered transposed: known from the plan (_grad_layout.output_cut), else read off the
    # backward pass once (_grad_layout.gathered_dot_grads)
    gather_flip: set = set(out_cut_gathers(plan, fsdp))
    found: list = []  # what a trace without them found
    recomputed: list = []  # the collectives a checkpoint's recomputation runs again, and the backward pass's
    # all-reduces of SyncBatchNorm's statistics (filled when traced)
    bn_calls: list = []  # the forward all-reduces of SyncBatchNorm's statistics, bytes each (filled when traced)
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
        if cp is not None:  # the sequence (dim 1 of every leaf of rank 2+) cut over cp, the batch over the data dims
            batch = jax.tree.map(lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh.jax_mesh, P(
                batch_spec[0], *((cp,) if np.ndim(x) >= 2 else ())))), batch)
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

    jitted = jax.jit(step)
    checked = []

    def prepare(state: TrainState, batch: Any) -> None:
        """Once, before the step is traced for good: where the model splits a tp-cut projection into heads
        (``spmd.parallel.step._heads``): a cut that would split a head is refused, and a projection with fewer
        heads than the tp size runs whole over tp."""
        if not checked:
            if fsdp is not None and accum_steps == 1 and plan.out_cut is None:  # which gathers to transpose
                jax.make_jaxpr(lambda s, b: step(s, b))(state, batch)
                gather_flip.update(found)
                traced.clear()
            if tp is not None:
                # a function of its own: jax caches a trace by function, and the step's must see ``whole``
                jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(state, batch).jaxpr
                whole.update(whole_over_tp(head_splits(jaxpr)))
                traced.clear()
            if cp is not None and n_cp > 1:
                _find_gathered(state, batch)
            checked.append(True)

    def _find_gathered(state: TrainState, batch: Any) -> None:
        """A model's own attention (scores over the whole cut sequence): the innermost submodule computing it that
        takes the [batch, seq, ...] sequence runs on it gathered over cp (``ContextCalls.around``), else refused."""
        t = seq_len(batch)
        jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(state, batch).jaxpr  # the state's step, then the parameters
        positional.update(entries[i].path for i in positional_params(jaxpr, jaxpr.invars[1:1 + len(entries)], t))
        dotted.update(entries[i].path for i in dot_params(jaxpr, jaxpr.invars[1:1 + len(entries)]))
        cotangents.update(lookup_cotangents(jaxpr, scopes_of))
        seen, products = attention[0].seen if attention else {}, whole_sequence_products(jaxpr, t)
        products = [p for p in products if CALL_SCOPE not in p[1]]
        if (products or ep_traced or tp is not None) and attention:  # tp: its styles' inputs (TPCalls)
            seen = seq_inputs(lambda b: (jax.make_jaxpr(lambda s, b: step(s, b))(state, b), attention[0])[1],
                              attention[0], batch, t, n_cp, seq_of)
        for _, stack in products:
            mods = [m for m in scopes_of(stack) if m and seen.get(m)]  # a submodule: not the model itself
            if mods and not any(m in whole_seq for m in mods):
                whole_seq.add(mods[-1])
        whole_seq.update(experts_routers(seen, ep_traced))  # an MoE's routing over the sequence: gathered
        if products:  # traced again with the gathers; what is left is refused
            jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(state, batch).jaxpr
            check_whole_sequence(jaxpr, t, n_cp, lambda stack: CALL_SCOPE in stack
                                 or any(m in whole_seq for m in scopes_of(stack)))
        traced.clear()

    def run(state: TrainState, batch: Any):
        batch = _as_arrays(batch)
        _check_batch(batch, n_data, accum_steps, data, sizes)
        if cp is not None:
            check_seq(batch, n_cp)
        prepare(state, batch)
        return jitted(state, batch)

    def communication(state: TrainState, batch: Any) -> dict:
        batch = _as_arrays(batch)
        prepare(state, batch)
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
                                  recomputed=recomputed[0] if recomputed else None, batch_stats=stats)
        if cp is not None and n_cp > 1:
            comm = with_context(comm, plan, attention[0] if attention else None, accum_steps, bool(data),
                                positional, dotted, cotangents)
        if pm.ep is not None:
            comm = with_experts(comm, ep_traced, accum_steps)
        return comm

    return _Built(jitted, plan, run, communication, prepare)


def _as_arrays(batch: Any) -> Any:
    from spmd.tensor import DTensor

    def one(x):
        if isinstance(x, DTensor):
            return x.to_jax() if hasattr(x, "to_jax") else x.full_tensor()
        return x

    return jax.tree.map(one, batch, is_leaf=lambda x: isinstance(x, DTensor))
