"""The reference the sharded-training tests compare with: plain training on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from spmd.parallel import TrainState


def train_one_device(params, batches, loss_fn, optimizer, *, has_aux: bool = False):
    """``(losses, final state)`` of ``len(batches)`` steps of ``optimizer`` on ``loss_fn(params, batch)``
    over the whole batch on one device (``has_aux``: ``loss_fn`` returns ``(loss, aux)``)."""

    @jax.jit
    def step(state, b):
        out, g = jax.value_and_grad(lambda p: loss_fn(p, b), has_aux=has_aux)(state.params)
        updates, opt_state = optimizer.update(g, state.opt_state, state.params)
        loss = out[0] if has_aux else out
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), loss

    state, losses = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params)), []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    return losses, state


def assert_trees_close(got, ref, *, atol: float = 1e-5) -> None:
    """``got`` and ``ref`` hold the same paths, each leaf equal within ``atol`` (and the same relative tolerance)."""
    import numpy as np

    flat, want = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(ref)
    assert [k for k, _ in flat] == [k for k, _ in want]
    for (k, a), (_, b) in zip(flat, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=atol, atol=atol, err_msg=jax.tree_util.keystr(k))
