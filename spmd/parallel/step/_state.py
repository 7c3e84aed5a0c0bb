"""The train state and its layout: ``TrainState``, ``init_train_state`` (step 0, laid out by the model's
layouts), ``state_shardings`` (where each stored leaf lives) and ``unshard_params`` (the inverse: the logical
parameters, replicated)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd._mesh import DeviceMesh
from spmd.parallel.plan._checks import check_rng, describe_tree, params_hint
from spmd.parallel.plan._param_plan import ParamPlan
from spmd.parallel.plan._scan import find_stacked, trace_seen
from spmd.parallel.plan._shard import entry_sharding, map_like_params, shard_params, unshard_tree
from spmd.parallel.step._batch_norm import BATCH_STATS_REASON
from spmd.parallel.step._model_checks import check_model_params, check_seen, held_params
from spmd.parallel.step._protocol import OwnsTrainStep
from spmd.parallel.styles._nnx import is_nnx, nnx_batch_stats, nnx_params
from spmd.parallel.styles._transforms import ParallelModule, as_parallel, build_plan, out_cut_of, stacked_of

__all__ = ["TrainState", "init_train_state", "unshard_params", "state_shardings"]


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
