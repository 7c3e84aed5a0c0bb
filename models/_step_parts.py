"""What the sharded train steps (``models._fsdp``, ``models._tp_step``) share.

Inside a region: gradient accumulation over micro-batches with one gather /
reduce-scatter per step, and reducing many gradient leaves as one flat buffer
(one collective per buffer). Outside: the global batch check and the optimizer
update in global view.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models._ddp import TrainState
from spmd import DeviceMesh, DTensor


def data_size(mesh: DeviceMesh, data: Sequence[str]) -> int:
    """How many data-parallel ranks the mesh dims ``data`` make (1 for none)."""
    n = 1
    for d in data:
        n *= mesh.size(d)
    return n


def accumulated(grad_fn: Callable, gather_all: Callable, leaves: list, batch: Any, accum_steps: int):
    """``(loss, aux), grads`` over ``accum_steps`` micro-batches of the local ``batch``.

    ``gather_all(leaves)`` makes the parameters whole once; ``grad_fn(full, micro_batch)`` gives
    ``(loss, aux), full-size grads``; the grads are summed locally over the micro-batches (torch's
    ``no_sync``) and sent back through the gather's transpose once (one reduce-scatter per gathered buffer).
    """
    n_local = jax.tree.leaves(batch)[0].shape[0]
    full, scatter = jax.vjp(gather_all, leaves)
    micro = jax.tree.map(lambda x: x.reshape(accum_steps, n_local // accum_steps, *x.shape[1:]), batch)

    def one(carry, mb):
        (loss, aux), gf = grad_fn(full, mb)
        return jax.tree.map(jnp.add, carry, (loss, aux, gf)), None

    (loss, aux), gf = grad_fn(full, jax.tree.map(lambda x: x[0], micro))
    (loss, aux, gf), _ = lax.scan(one, (loss, aux, gf), jax.tree.map(lambda x: x[1:], micro))
    loss, aux = jax.tree.map(lambda x: x / accum_steps, (loss, aux))
    (g,) = scatter([x / accum_steps for x in gf])
    return (loss, aux), g


def flat_apply(g: list, idx: Iterable[int], fn: Callable[[jax.Array], jax.Array]) -> None:
    """Replace the leaves ``g[i]``, ``i`` in ``idx``, by ``fn`` of them as one flat buffer (in place)."""
    idx = list(idx)
    if not idx:
        return
    flat = fn(jnp.concatenate([g[i].reshape(-1) for i in idx]))
    off = 0
    for i in idx:
        g[i] = flat[off:off + g[i].size].reshape(g[i].shape)
        off += g[i].size


def check_batch(batch: Any, mesh: DeviceMesh, data: Sequence[str], accum_steps: int) -> None:
    """The global batch (leading dim) must split over the data-parallel ranks and the micro-batches."""
    n = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, DTensor))[0].shape[0]
    n_data = data_size(mesh, data)
    if n % (n_data * accum_steps):
        split = " x ".join(f"{d}={mesh.size(d)}" for d in data) or "1"
        raise ValueError(
            f"train_step: the batch has {n} examples, not divisible by the data-parallel size {split} = {n_data}"
            + (f" times accum_steps={accum_steps}" if accum_steps > 1 else "")
            + f"; use a batch size that is a multiple of {n_data * accum_steps}."
        )


def optimizer_step(state: TrainState, grads: Any, metrics: dict, optimizer) -> tuple[TrainState, dict]:
    """The optax update in global view (on sharded arrays: elementwise on the shards; a global norm
    costs one scalar all-reduce), and the gradient norm as a metric."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return new, metrics
