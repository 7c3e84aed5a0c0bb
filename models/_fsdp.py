"""The fully sharded train step: what torch's FSDP2 (``fully_shard``) does, from a placement plan.

``make_fsdp_train_step(loss_fn, optimizer, mesh, plan)`` gives a jitted
``(state, batch) -> (state, metrics)`` with the contract of
``make_train_step``; the state is the one ``shard_train_state`` builds:

- on the ``fsdp`` mesh dim, parameters, gradients and optimizer state are the
  plan's ``Shard`` blocks (padded to the chunk size, uneven like torch.chunk);
- the model all-gathers each unit's parameters right before the unit runs
  (one all-gather per parameter matrix, straight into its own buffer, and one
  flat buffer for the unit's vectors: ``spmd.parallel.gather_unit``):
  ``loss_fn(params, batch, gather)`` hands ``gather`` to the model
  (``model.apply({"params": params}, x, gather=gather)``), and the transformer
  scans its blocks so one block's gathered parameters live at a time;
- ``jax.grad`` of that all-gather is a reduce-scatter: gradients leave the
  backward pass as shards, one reduce-scatter per gathered buffer, never a
  full-size all-reduce;
- on a ``dp`` mesh dim (HSDP) the state is replicated and the sharded
  gradients are averaged by one all-reduce (of the shard bytes);
- the optimizer (any optax transformation, global-norm clipping included)
  runs in global view on the sharded arrays: elementwise updates stay on the
  shards, a global norm costs one scalar all-reduce;
- ``accum_steps=k`` gathers every unit once, accumulates full-size local
  gradients over the k micro-batches and reduce-scatters once per buffer (the
  memory of torch's ``set_requires_gradient_sync(False)``, the
  communication of one step).

``regather=True`` (default) all-gathers each block again for its backward pass
(``jax.checkpoint`` saves the block's matmul outputs, not its gathered parameters): one block's
parameters alive at a time, one more all-gather per buffer. ``regather=False`` keeps the
forward pass's gathered parameters for the backward pass: fewer collectives,
full-size parameter memory.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models._ddp import TrainState, _varying, check_accum_steps, check_optimizer
from models._step_parts import accumulated, check_batch, flat_apply, optimizer_step
from placements import ReduceOp, Replicate, Shard
from spmd import DeviceMesh, all_reduce, spmd
from spmd.parallel import ParamPlan, entry_sharding, gather_unit, map_like_params, path_str, shard_params

__all__ = ["make_fsdp_train_step", "shard_train_state", "state_shardings", "UnitGather", "data_dims"]


def data_dims(mesh: DeviceMesh, plan: ParamPlan, dp: str = "dp") -> tuple[str, ...]:
    """The mesh dims the batch is split over: ``dp`` and ``fsdp`` where the mesh has them."""
    return tuple(n for n in mesh.mesh_dim_names if n in (dp, plan.fsdp))


class UnitGather:
    """The hook a model calls: ``gather(unit, params_of_unit) -> full params of the unit``.

    ``unit`` is a unit name of the plan (``"root"``, ``"block_0"``, ...);
    ``params_of_unit`` its subtree of this device's padded blocks. A model that
    scans its blocks gathers every block with ``"block_0"``'s layout (the step
    checks they are equal). ``regather`` tells the model whether to gather
    again for the backward pass.
    """

    def __init__(self, plan: ParamPlan, regather: bool):
        self.plan = plan
        self.regather = regather
        self._fsdp_index = plan.mesh_dim_names.index(plan.fsdp)

    def __call__(self, unit: str, params: Any) -> Any:
        prefix = "" if unit == "root" else unit + "/"
        kp, treedef = jax.tree_util.tree_flatten_with_path(params)
        entries = [self.plan.entry(prefix + path_str(p)) for p, _ in kp]
        full = gather_unit([x for _, x in kp], entries, self.plan.fsdp, self._fsdp_index)
        return jax.tree_util.tree_unflatten(treedef, full)


def state_shardings(state: TrainState, plan: ParamPlan, mesh: DeviceMesh, optimizer) -> TrainState:
    """The ``NamedSharding`` of every leaf of a sharded state (optimizer moments follow their parameter)."""
    rep = NamedSharding(mesh.jax_mesh, P())
    return TrainState(
        step=rep,
        params=map_like_params(plan, state.params, lambda x, e: entry_sharding(e, mesh)),
        opt_state=map_like_params(plan, state.opt_state, lambda x, e: entry_sharding(e, mesh), optimizer=optimizer,
                                  other=lambda x: rep),
    )


def shard_train_state(state: TrainState, plan: ParamPlan, mesh: DeviceMesh, optimizer) -> TrainState:
    """A replicated (or host) ``TrainState`` placed by ``plan``: each parameter and its optimizer
    moments padded to the chunk size and cut over the fsdp dim."""
    plan.check_params(state.params, "shard_train_state")
    return TrainState(
        step=jax.device_put(state.step, NamedSharding(mesh.jax_mesh, P())),
        params=shard_params(state.params, plan, mesh),
        opt_state=shard_params(state.opt_state, plan, mesh, optimizer=optimizer),
    )


def _check(loss_fn, optimizer, mesh, plan, dp, accum_steps, where: str) -> None:
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn={loss_fn!r} must be callable as loss_fn(params, batch, gather) -> (loss, metrics).")
    check_optimizer(optimizer, where)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh={mesh!r} must be a spmd.DeviceMesh, e.g. init_device_mesh('cpu', (8,), "
                        "mesh_dim_names=('fsdp',)).")
    if not isinstance(plan, ParamPlan):
        raise TypeError(
            f"{where}: plan={plan!r} must be a spmd.parallel.ParamPlan; build it with plan_params(params, mesh).")
    if plan.mesh_dim_names != mesh.mesh_dim_names or plan.mesh_shape != mesh.shape:
        raise ValueError(
            f"{where}: plan was built for the mesh {dict(zip(plan.mesh_dim_names, plan.mesh_shape))}, not "
            f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}; build it again with plan_params(params, mesh)."
        )
    if plan.fsdp not in mesh.mesh_dim_names:
        raise ValueError(
            f"{where}: the plan's fsdp dim {plan.fsdp!r} is not a dim of the mesh {mesh.mesh_dim_names}; build the "
            f"mesh with an {plan.fsdp!r} dim (e.g. mesh_dim_names=('dp', 'fsdp')), or use make_train_step for DDP."
        )
    for name in mesh.mesh_dim_names:
        if name not in (dp, plan.fsdp):
            raise ValueError(
                f"{where}: mesh dim {name!r} is neither the data-parallel dim dp={dp!r} nor the plan's fsdp dim "
                f"{plan.fsdp!r}; this step shards over those two only: name the mesh dims ('dp', 'fsdp')."
            )
    for e in plan.entries:
        for name, p in zip(mesh.mesh_dim_names, e.placements):
            if name != plan.fsdp and not isinstance(p, Replicate):
                raise ValueError(
                    f"{where}: the plan places parameter {e.path!r} as {p} on mesh dim {name!r}; the data-parallel "
                    f"dim {name!r} keeps parameters Replicate(): shard them on {plan.fsdp!r} instead."
                )
    check_accum_steps(accum_steps, where)


def _block_layouts_equal(plan: ParamPlan) -> bool:
    """Whether all ``block_*`` units share block_0's relative paths, shapes and placements."""
    def layout(unit):
        return [(e.path.split("/", 1)[1], e.shape, e.placements) for e in plan.unit_entries(unit)]

    blocks = [u for u in plan.units if u.startswith("block_")]
    return all(layout(u) == layout(blocks[0]) for u in blocks)


def make_fsdp_train_step(
    loss_fn: Callable[[Any, Any, Any], tuple[jax.Array, dict]],
    optimizer: optax.GradientTransformation,
    mesh: DeviceMesh,
    plan: ParamPlan,
    *,
    dp: str = "dp",
    accum_steps: int = 1,
    regather: bool = True,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The fully sharded train step ``(state, batch) -> (state, metrics)`` (see the module doc).

    ``loss_fn(params, batch, gather)``: the mean loss over the local batch and
    a dict of scalar metrics; it passes ``gather`` to the model, which is
    ``None`` when the parameters are already whole (accumulation). The global
    batch (leading dim) must divide by ``dp x fsdp x accum_steps``.
    """
    where = "make_fsdp_train_step"
    _check(loss_fn, optimizer, mesh, plan, dp, accum_steps, where)
    if not _block_layouts_equal(plan):
        raise ValueError(
            f"{where}: the plan gives the blocks different layouts (rules that place block_0 and block_1 apart); "
            "a scanned model runs one program for every block: give all blocks the same placements."
        )
    data = data_dims(mesh, plan, dp)
    fsdp, n_fsdp = plan.fsdp, mesh.size(plan.fsdp)
    fi = mesh.mesh_dim_names.index(fsdp)
    has_dp = dp in mesh.mesh_dim_names and mesh.size(dp) > 1
    entries = plan.entries
    sharded = [e.shard_dim(fi) is not None for e in entries]
    gather = UnitGather(plan, regather)

    def gather_all(leaves):
        out = list(leaves)
        for u in plan.units:
            idx = [i for i, e in enumerate(entries) if e.unit == u]
            got = gather_unit([leaves[i] for i in idx], [entries[i] for i in idx], fsdp, fi)
            for i, g in zip(idx, got):
                out[i] = g
        return out

    def local_grads(params: Any, batch: Any) -> tuple[Any, dict]:
        leaves = jax.tree_util.tree_leaves(params)
        # Local gradients, no implicit psum (the JAX trap): differentiate w.r.t. device-varying copies.
        for d in data:
            leaves = [_varying(x, d) for x in leaves]

        def unflat(ls):
            return jax.tree_util.tree_unflatten(plan.treedef, ls)

        if accum_steps == 1:
            (loss, aux), g = jax.value_and_grad(lambda ls: loss_fn(unflat(ls), batch, gather), has_aux=True)(leaves)
        else:  # step() checked that the local batch splits into accum_steps micro-batches
            grad_fn = jax.value_and_grad(lambda ls, mb: loss_fn(unflat(ls), mb, None), has_aux=True)
            (loss, aux), g = accumulated(grad_fn, gather_all, leaves, batch, accum_steps)
        # Sharded leaves came back reduce-scattered (summed over fsdp): averaged over fsdp leaf by leaf (the
        # division fuses into the next use), over dp with one all-reduce of all shard bytes. Leaves replicated
        # on fsdp: one all-reduce over the data dims.
        g = [x / n_fsdp if s else x for x, s in zip(g, sharded)]
        if has_dp:
            flat_apply(g, (i for i in range(len(g)) if sharded[i]), lambda f: all_reduce(f, ReduceOp.AVG, group=dp))
        flat_apply(g, (i for i in range(len(g)) if not sharded[i]), lambda f: all_reduce(f, ReduceOp.AVG, group=data))
        metrics = jax.tree.map(lambda m: all_reduce(m, ReduceOp.AVG, group=data), {"loss": loss, **aux})
        return unflat(g), metrics

    rep = [Replicate()] * mesh.ndim
    batch_pl = [Shard(0) if n in data else Replicate() for n in mesh.mesh_dim_names]
    placements = plan.placements_tree()
    region = spmd(local_grads, mesh, in_placements=(placements, batch_pl), out_placements=(placements, rep))

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        plan.check_params(state.params, "train_step", sharded=True)
        check_batch(batch, mesh, data, accum_steps)
        grads, metrics = region(state.params, batch)
        return optimizer_step(state, grads, metrics, optimizer)

    return jax.jit(step)
