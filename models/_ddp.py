"""The data-parallel train step: what ``torch.nn.parallel.DistributedDataParallel`` does.

``make_train_step(loss_fn, optimizer, mesh)`` gives a pure, jitted function
``(state, batch) -> (state, metrics)`` built with ``@spmd(mesh)``:

- ``state`` (parameters, optimizer state, step) is ``Replicate`` on every mesh dim;
- the batch is ``Shard(0)`` on the data-parallel mesh dim (``Replicate`` on the others);
- each rank computes the gradient of its local mean loss; the gradients are
  averaged (``all_reduce(..., AVG)``, the mean, not the sum) over the
  data-parallel dim, then every rank applies the same optax update;
- with ``accum_steps=k`` the local batch is cut into ``k`` micro-batches whose
  gradients are summed locally (torch's ``no_sync``) and all-reduced once per
  step: the number of all-reduces does not grow with ``k``;
- metrics (``loss``, whatever ``loss_fn`` returns, ``grad_norm``) come back
  averaged over the data-parallel dim, ``Replicate``.

The JAX trap: inside ``shard_map`` with ``check_vma=True`` the gradient of a
replicated parameter is already summed over the devices, once per ``grad``
call. The step therefore differentiates with respect to a device-varying copy
of the parameters (``lax.pcast(..., to="varying")``): each rank gets its own
local gradient, and the step reduces it exactly once, with the mean.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from placements import ReduceOp, Replicate, Shard
from spmd import DeviceMesh, all_reduce, spmd
from spmd._collectives import varying_axes

__all__ = ["TrainState", "init_train_state", "make_train_step", "batch_placements"]


@flax.struct.dataclass
class TrainState:
    """Everything a training run carries from step to step (a pytree).

    The data order is a function of ``step`` and the run's seed, so this plus
    the seed is all a resumed run needs.
    """

    step: jax.Array
    params: Any
    opt_state: Any


def init_train_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0: ``params`` and a fresh ``optimizer`` state."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def _check_dp(mesh: Any, dp: str, where: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh={mesh!r} must be a spmd.DeviceMesh, e.g. init_device_mesh('cpu', (8,), mesh_dim_names=('dp',)).")
    if dp not in mesh.mesh_dim_names:
        raise ValueError(
            f"{where}: dp={dp!r} is not a dim of {mesh!r}; name the data-parallel mesh dim, one of "
            f"{mesh.mesh_dim_names}."
        )


def batch_placements(mesh: DeviceMesh, dp: str | tuple[str, ...] = "dp") -> list:
    """``Shard(0)`` on the data-parallel mesh dim (or each of a tuple of them), ``Replicate`` on the others."""
    dims = (dp,) if isinstance(dp, str) else tuple(dp)
    for d in dims:
        _check_dp(mesh, d, "batch_placements")
    return [Shard(0) if n in dims else Replicate() for n in mesh.mesh_dim_names]


def _varying(tree: Any, axis: str) -> Any:
    def one(x):
        vma = varying_axes(x)
        return x if vma is None or axis in vma else lax.pcast(x, (axis,), to="varying")

    return jax.tree.map(one, tree)



def check_optimizer(optimizer: Any, where: str) -> None:
    """A train step's ``optimizer`` must be an optax transformation."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"{where}: optimizer={optimizer!r} must be an optax.GradientTransformation, e.g. optax.adamw(1e-3).")


def check_accum_steps(accum_steps: Any, where: str) -> None:
    """A train step's ``accum_steps`` must be an int >= 1."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"{where}: accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")


def make_train_step(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict]],
    optimizer: optax.GradientTransformation,
    mesh: DeviceMesh,
    *,
    dp: str = "dp",
    accum_steps: int = 1,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The data-parallel train step ``(state, batch) -> (state, metrics)``.

    ``loss_fn(params, batch) -> (loss, metrics)``: the mean loss over the
    (local) batch and a dict of scalar metrics that are means over it too.
    ``batch`` is a pytree of arrays whose leading dim is the global batch; it
    must divide by ``mesh.size(dp) * accum_steps``.
    """
    where = "make_train_step"
    if not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn={loss_fn!r} must be callable as loss_fn(params, batch) -> (loss, metrics).")
    check_optimizer(optimizer, where)
    _check_dp(mesh, dp, where)
    check_accum_steps(accum_steps, where)
    n_dp = mesh.size(dp)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def local_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        leaves = jax.tree.leaves(batch)
        n_local = leaves[0].shape[0]
        if n_local % accum_steps:
            raise ValueError(
                f"train_step: the global batch of {n_local * n_dp} examples gives {n_local} per rank on "
                f"{n_dp} data-parallel ranks, which does not split into accum_steps={accum_steps} micro-batches; "
                f"use a batch size divisible by {n_dp * accum_steps}."
            )
        # Differentiate w.r.t. a device-varying copy: local gradients, no implicit psum.
        params = _varying(state.params, dp)
        if accum_steps == 1:
            (loss, aux), grads = grad_fn(params, batch)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accum_steps, n_local // accum_steps, *x.shape[1:]), batch)

            def one(carry, mb):
                (loss, aux), g = grad_fn(params, mb)
                return jax.tree.map(jnp.add, carry, (loss, aux, g)), None

            first = jax.tree.map(lambda x: x[0], micro)
            rest = jax.tree.map(lambda x: x[1:], micro)
            (loss, aux), g0 = grad_fn(params, first)
            (loss, aux, grads), _ = lax.scan(one, (loss, aux, g0), rest)
            loss, aux, grads = jax.tree.map(lambda x: x / accum_steps, (loss, aux, grads))
        # The one gradient all-reduce of the step (the mean over data-parallel ranks).
        grads = jax.tree.map(lambda g: all_reduce(g, ReduceOp.AVG, group=dp), grads)
        metrics = {"loss": loss, **aux}
        metrics = jax.tree.map(lambda m: all_reduce(m, ReduceOp.AVG, group=dp), metrics)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return new, metrics

    rep = [Replicate()] * mesh.ndim
    return spmd(local_step, mesh, in_placements=(rep, batch_placements(mesh, dp)), out_placements=(rep, rep))
