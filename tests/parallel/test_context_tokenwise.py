"""``token_wise``: which module programs keep positions apart (run on a device's part of a sequence cut over cp),
read from the jaxpr: a projection, a norm and an activation do; a running count, a product over the sequence and
a sort along it do not."""

import jax
import jax.numpy as jnp
import pytest

from spmd.parallel.context._tokenwise import token_wise

X = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
W = jnp.ones((16, 4))


@pytest.mark.parametrize("fn,want", [
    (lambda x: x @ W, True),  # a router's projection
    (lambda x: jax.nn.softmax(x @ W, axis=-1), True),
    (lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), True),  # RMSNorm
    (lambda x: jax.lax.top_k(x @ W, 2)[1], True),  # top-k over the experts, per token
    (lambda x: jnp.cumsum(x @ W, axis=1), False),  # a running count over the sequence
    (lambda x: jnp.einsum("btd,bsd->bts", x, x), False),  # attention scores
    (lambda x: jnp.sort(x, axis=1), False),
    (lambda x: x.sum(1), False),  # the output has no sequence dim
    (lambda x: jnp.swapaxes(x, 0, 1), False),  # the sequence moved off dim 1
])
def test_token_wise(fn, want):
    assert token_wise(jax.make_jaxpr(fn)(X), [True]) is want
