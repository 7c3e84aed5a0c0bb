"""The train step on n-D meshes: ``tp`` (tensor / sequence parallel) with ``fsdp`` and ``dp``.

``make_tp_train_step(model, optimizer, mesh, plan)`` gives a jitted ``(state, batch) -> (state,
metrics)`` with the contract of ``make_fsdp_train_step`` (state from ``shard_train_state``), on a mesh
whose dims are ``dp``, ``fsdp`` and ``tp`` in any subset holding ``tp``:

- ``tp``: the transformer runs on its ``tp`` blocks (``models._tp``: Megatron's layout, vocab-parallel
  embedding and cross-entropy; ``sequence_parallel=True`` keeps the activations between blocks cut on
  the sequence);
- ``fsdp``: each unit's blocks are all-gathered on fsdp right before the unit runs and their gradients
  reduce-scattered (``jax.grad`` of the gather), as in FSDP, on the tp-local blocks (fsdp cuts another
  tensor dim than tp);
- ``dp``: the gradients are averaged by one all-reduce per flat buffer;
- a parameter ``Replicate`` on ``tp`` gets the same gradient on every tp rank without communication;
  under sequence parallelism each rank's is a partial sum over its positions, all summed over ``tp``
  by one all-reduce of one flat buffer;
- ``accum_steps=k``: every unit gathered once, ``k`` micro-batches (each with its tp communication), one
  reduce-scatter per unit.

Flat buffers are per (dtype, whether the leaves are cut on ``tp``): a tp-replicated leaf must stay
replicated over ``tp`` through the gather, or JAX would sum its gradient over ``tp``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from models._ddp import TrainState, _varying, check_accum_steps, check_optimizer
from models._step_parts import accumulated, check_batch, data_size, flat_apply, optimizer_step
from models._fsdp import _block_layouts_equal
from models._tp import TPContext, check_tp_plan, tp_loss
from placements import ReduceOp, Replicate, Shard
from spmd import DeviceMesh, all_reduce, spmd
from spmd._collectives import varying_axes
from spmd.parallel import ParamPlan, gather_unit, path_str

__all__ = ["make_tp_train_step", "TPGather", "tp_parts"]


def _groups(leaves, idx, tp: str) -> list[list[int]]:
    """``idx`` split by (dtype, varying over ``tp``), in first-seen order."""
    out: dict[Any, list[int]] = {}
    for i in idx:
        vma = varying_axes(leaves[i])
        out.setdefault((jnp.dtype(leaves[i].dtype), vma is not None and tp in vma), []).append(i)
    return list(out.values())


class TPGather:
    """``gather(unit, params_of_unit)``: the unit's tp-local blocks made whole on fsdp, by ``gather_unit``
    on each (dtype, tp-cut or not) group of leaves (one all-gather per ``ParamPlan.gather_buffers`` buffer)."""

    def __init__(self, plan: ParamPlan, tp: str, regather: bool):
        self.plan, self.tp, self.regather = plan, tp, regather
        self._fi = plan.mesh_dim_names.index(plan.fsdp)

    def leaves(self, leaves: list, entries: list) -> list:
        out = list(leaves)
        for g in _groups(leaves, range(len(leaves)), self.tp):
            for i, y in zip(g, gather_unit([leaves[i] for i in g], [entries[i] for i in g], self.plan.fsdp,
                                           self._fi)):
                out[i] = y
        return out

    def __call__(self, unit: str, params: Any) -> Any:
        prefix = "" if unit == "root" else unit + "/"
        kp, treedef = jax.tree_util.tree_flatten_with_path(params)
        entries = [self.plan.entry(prefix + path_str(p)) for p, _ in kp]
        return jax.tree_util.tree_unflatten(treedef, self.leaves([x for _, x in kp], entries))


def _check(model, optimizer, mesh, plan, dp, tp, accum_steps, where) -> None:
    check_optimizer(optimizer, where)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh={mesh!r} must be a spmd.DeviceMesh, e.g. init_device_mesh('cpu', (2, 4), "
                        "mesh_dim_names=('dp', 'tp')).")
    if not isinstance(plan, ParamPlan):
        raise TypeError(f"{where}: plan={plan!r} must be a spmd.parallel.ParamPlan; build it with "
                        "plan_params(params, mesh, transformer_tp_rules()).")
    if not all(hasattr(model, a) for a in ("num_layers", "vocab_size", "d_model")):
        raise TypeError(f"{where}: model={model!r} must be a models.Transformer (the tensor-parallel forward pass "
                        "is the transformer's).")
    if plan.mesh_dim_names != mesh.mesh_dim_names or plan.mesh_shape != mesh.shape:
        raise ValueError(
            f"{where}: plan was built for the mesh {dict(zip(plan.mesh_dim_names, plan.mesh_shape))}, not "
            f"{dict(zip(mesh.mesh_dim_names, mesh.shape))}; build it again with plan_params(params, mesh, rules)."
        )
    if tp not in mesh.mesh_dim_names:
        raise ValueError(f"{where}: the mesh {mesh.mesh_dim_names} has no tensor-parallel dim tp={tp!r}; name one "
                         "mesh dim 'tp' (e.g. mesh_dim_names=('dp', 'tp')), or use make_fsdp_train_step.")
    for name in mesh.mesh_dim_names:
        if name not in (dp, plan.fsdp, tp):
            raise ValueError(f"{where}: mesh dim {name!r} is none of dp={dp!r}, fsdp={plan.fsdp!r}, tp={tp!r}; name "
                             "the mesh dims from those three.")
    for e in plan.entries:
        for name, p in zip(mesh.mesh_dim_names, e.placements):
            if name == dp and not isinstance(p, Replicate):
                raise ValueError(f"{where}: the plan places parameter {e.path!r} as {p} on the data-parallel dim "
                                 f"{name!r}, which keeps parameters Replicate(): shard them on fsdp or tp instead.")
    check_tp_plan(plan, tp, where)
    if not _block_layouts_equal(plan):
        raise ValueError(f"{where}: the plan gives the blocks different layouts; the blocks run as one scanned "
                         "program: give all blocks the same placements.")
    check_accum_steps(accum_steps, where)


def make_tp_train_step(model: Any, optimizer: optax.GradientTransformation, mesh: DeviceMesh, plan: ParamPlan, *,
                       dp: str = "dp", tp: str = "tp", sequence_parallel: bool = False, accum_steps: int = 1,
                       regather: bool = True):
    """The step (see the module doc). The batch is ``{"inputs", "targets"[, "mask"]}`` (mean
    cross-entropy, masked when a mask is given); its leading dim must divide by ``dp x fsdp x accum_steps``."""
    where = "make_tp_train_step"
    _check(model, optimizer, mesh, plan, dp, tp, accum_steps, where)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{where}: sequence_parallel={sequence_parallel!r} must be a bool.")
    names = mesh.mesh_dim_names
    data = tuple(n for n in names if n in (dp, plan.fsdp))
    n_data = data_size(mesh, data)
    has_fsdp = plan.fsdp in names
    fi = names.index(plan.fsdp) if has_fsdp else None
    ti = names.index(tp)
    n_fsdp = mesh.size(plan.fsdp) if has_fsdp else 1
    has_dp = dp in names and mesh.size(dp) > 1
    entries = list(plan.entries)
    fsdp_cut = [has_fsdp and e.shard_dim(fi) is not None for e in entries]
    tp_whole = [e.shard_dim(ti) is None for e in entries]
    ctx = TPContext(tp, mesh.size(tp), sequence_parallel, model.dtype)
    gather = TPGather(plan, tp, regather) if has_fsdp else None

    def unflat(ls):
        return jax.tree_util.tree_unflatten(plan.treedef, ls)

    def flat_reduce(g: list, idx: list[int], fn) -> None:
        for grp in _groups(g, idx, tp):
            flat_apply(g, grp, fn)

    def local_grads(params: Any, batch: Any):
        n_local = batch["inputs"].shape[0]
        if n_local % accum_steps:
            raise ValueError(
                f"train_step: the global batch of {n_local * n_data} examples gives {n_local} per rank on {n_data} "
                f"data-parallel ranks, which does not split into accum_steps={accum_steps} micro-batches; use a "
                f"batch size divisible by {n_data * accum_steps}."
            )
        leaves = jax.tree_util.tree_leaves(params)
        for d in data:  # local gradients over the data dims (see models._ddp), reduced once below
            leaves = [_varying(x, d) for x in leaves]
        if sequence_parallel:  # tp-replicated leaves meet sequence shards: partial gradients, summed below
            leaves = [_varying(x, tp) for x in leaves]
        if accum_steps == 1:
            (loss, aux), g = jax.value_and_grad(lambda ls: tp_loss(model, unflat(ls), batch, ctx, gather),
                                                has_aux=True)(leaves)
        else:
            def gather_all(ls):
                if gather is None:
                    return ls
                out = list(ls)
                for u in plan.units:
                    idx = [i for i, e in enumerate(entries) if e.unit == u]
                    for i, y in zip(idx, gather.leaves([ls[i] for i in idx], [entries[i] for i in idx])):
                        out[i] = y
                return out

            grad_fn = jax.value_and_grad(lambda ls, mb: tp_loss(model, unflat(ls), mb, ctx), has_aux=True)
            (loss, aux), g = accumulated(grad_fn, gather_all, leaves, batch, accum_steps)
        g = list(g)
        cut = [i for i in range(len(g)) if fsdp_cut[i]]
        whole = [i for i in range(len(g)) if not fsdp_cut[i]]
        if cut:  # reduce-scattered (summed) over fsdp: the mean, then over dp
            flat_reduce(g, cut, lambda f: all_reduce(f / n_fsdp, ReduceOp.AVG, group=dp) if has_dp else f / n_fsdp)
        if whole and n_data > 1:
            flat_reduce(g, whole, lambda f: all_reduce(f, ReduceOp.AVG, group=data))
        if sequence_parallel:
            flat_reduce(g, [i for i in range(len(g)) if tp_whole[i]], lambda f: all_reduce(f, ReduceOp.SUM, group=tp))
        metrics = {"loss": loss, **aux}
        if data:
            metrics = jax.tree.map(lambda m: all_reduce(m, ReduceOp.AVG, group=data), metrics)
        return unflat(g), metrics

    rep = [Replicate()] * mesh.ndim
    batch_pl = [Shard(0) if n in data else Replicate() for n in names]
    placements = plan.placements_tree()
    region = spmd(local_grads, mesh, in_placements=(placements, batch_pl), out_placements=(placements, rep))

    def step(state: TrainState, batch: Any):
        plan.check_params(state.params, "train_step", sharded=True)
        check_batch(batch, mesh, data, accum_steps)
        grads, metrics = region(state.params, batch)
        return optimizer_step(state, grads, metrics, optimizer)

    return jax.jit(step)


def tp_parts(model: Any, optimizer, mesh: DeviceMesh, sample: Any, *, sequence_parallel: bool = False,
             accum_steps: int = 1, regather: bool = True):
    """``(plan, init, train_step, state_sharding)`` of a training job on a mesh with a ``tp`` dim (the
    transformer's Megatron plan composed with fsdp's default; see ``models._fsdp_run.fsdp_parts``)."""
    from models._fsdp_run import fsdp_parts
    from models._tp import transformer_tp_rules

    if not hasattr(model, "num_heads"):
        raise ValueError(f"models.train: a mesh with a 'tp' dim runs the transformer's tensor-parallel layout; "
                         f"{type(model).__name__} has none: use --model transformer, or a mesh without tp.")
    return fsdp_parts(model, optimizer, None, mesh, sample, accum_steps=accum_steps, regather=regather,
                      rules=transformer_tp_rules(sequence_parallel),
                      make_step=lambda plan: make_tp_train_step(model, optimizer, mesh, plan,
                                                                sequence_parallel=sequence_parallel,
                                                                accum_steps=accum_steps, regather=regather))
