"""``positional_params`` (the learned position tables a cp step cuts on their rows) reads a table broadcast over the
batch and added to the ``[batch, seq, ...]`` activations, not a parameter whose dim equals the sequence length that
the optimizer updates in place (an expert ``[E, d, f]`` with ``d == seq``: it was taken for a position table, its
cp reduction left out of the table)."""

import jax
import jax.numpy as jnp

from spmd.parallel.step._heads import positional_params

T = 16


def test_position_tables_found_and_an_updated_expert_is_not():
    params = (jnp.zeros((T, 8)), jnp.zeros((1, T, 8)), jnp.zeros((4, T, 8)))  # tables [T, d], [1, T, d]; experts
    x = jnp.zeros((2, T, 8))

    def step(params, x):
        pos, pos3, experts = params
        h = x + pos[None, :T] + pos3[:, :T]  # [B, T, d]: two learned position tables added row by row
        y = jnp.einsum("btd,etf->bef", h, experts).sum()
        return y, experts - 0.1 * jnp.ones_like(experts) * y  # an [E, T, f] parameter updated: [E, T, f] - [E, T, f]

    jaxpr = jax.make_jaxpr(step)(params, x).jaxpr
    assert positional_params(jaxpr, jaxpr.invars[:3], T) == {0, 1}
