"""One train step for every layout: ``make_train_step``.

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
brings its own state, step and inverse: ``make_train_step`` here and ``init_train_state`` /
``unshard_params`` (``spmd.parallel.step._state``) hand it to its methods. One plan's program is built by
``spmd.parallel.step._build``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import optax

from spmd._mesh import DeviceMesh
from spmd.parallel.cost._comm import format_communication
from spmd.parallel.plan._checks import check_batch_leaves, check_opt_state
from spmd.parallel.plan._param_plan import ROOT
from spmd.parallel.plan._scan import check_unscanned, stacked_in
from spmd.parallel.step._build import _build
from spmd.parallel.step._finite import _FiniteChecked, _raise_nonfinite
from spmd.parallel.step._loss_io import _as_arrays
from spmd.parallel.step._model_checks import check_state_params
from spmd.parallel.step._protocol import OwnsTrainStep, TrainStep
from spmd.parallel.step._state import TrainState, _check_optimizer
from spmd.parallel.styles._nnx import is_nnx, nnx_trace_seen
from spmd.parallel.styles._transforms import ParallelModule, as_parallel, build_plan

__all__ = ["make_train_step"]


def make_train_step(model: Any, loss_fn: Callable, optimizer: optax.GradientTransformation, *, accum_steps: int = 1,
                    mesh: DeviceMesh | None = None, check_finite: bool | str = False,
                    batch_norm: str = "broadcast", donate: bool = False) -> TrainStep:
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
    if not isinstance(donate, bool):
        raise TypeError(f"{where}: donate={donate!r} must be a bool (True: the step reuses the state's buffers).")
    if donate and check_finite is True:
        raise ValueError(f"{where}: donate=True with check_finite=True: a non-finite step raises and hands the "
                         "state passed in back intact, which donation deletes; use check_finite='skip' (the "
                         "update dropped inside the step) or donate=False.")
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
        takes = inspect.signature(model.make_train_step).parameters
        inside = check_finite and "check_finite" in takes
        extra = {"check_finite": check_finite} if inside else {}  # its step keeps or drops the update itself
        if donate:
            if "donate" not in takes:
                raise ValueError(f"{where}: donate=True, but {type(model).__name__}.make_train_step takes no donate; "
                                 "leave donate out for this layout.")
            extra["donate"] = True
        own = model.make_train_step(loss_fn, optimizer, accum_steps=accum_steps, mesh=mesh, **extra)
        if not isinstance(own, TrainStep):
            raise TypeError(f"{where}: {type(model).__name__}.make_train_step returned {type(own).__name__}; an "
                            "OwnsTrainStep layout's make_train_step must return a spmd.parallel.TrainStep (subclass "
                            "it: __call__, lower, communication, table).")
        return _FiniteChecked(own, check_finite) if check_finite and not inside else own
    return _LayoutStep(as_parallel(model, mesh, where), loss_fn, optimizer, accum_steps, check_finite, batch_norm,
                       donate)


class _LayoutStep(TrainStep):
    """The step of a model laid out by ``parallelize_module`` / ``fully_shard`` (or neither): one compiled
    program per plan (``_build``), each plan's state checked against the model once, before it compiles."""

    def __init__(self, pm: ParallelModule, loss_fn: Callable, optimizer, accum_steps: int,
                 check_finite: bool | str, batch_norm: str = "broadcast", donate: bool = False):
        self._pm, self._loss_fn, self._optimizer = pm, loss_fn, optimizer
        self._accum_steps, self._check_finite = accum_steps, check_finite
        self._build = functools.lru_cache(maxsize=4)(lambda plan: _build(pm, loss_fn, optimizer, accum_steps, plan,
                                                                         bool(check_finite), batch_norm, donate))
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
                    seen = nnx_trace_seen(pm.module, logical, loss_fn, batch)
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
        built, batch = self._build(state.plan), self._checked(state, batch)
        built.prepare(state, batch)
        return built.jitted.lower(state, batch)

    def communication(self, state: TrainState, batch: Any) -> dict:
        """What one step communicates per device, analytically (``spmd.parallel.cost._comm``), before it runs."""
        return self._build(state.plan).communication(state, self._checked(state, batch))

    def table(self, state: TrainState, batch: Any) -> str:
        """The plan and the step's communication, printable before anything runs."""
        return state.plan.table() + "\n" + format_communication(self.communication(state, batch))
