"""A multi-layer perceptron over token sequences (flax.linen)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MLP"]


class MLP(nn.Module):
    """One-hot tokens ``(B, T_in)`` -> logits ``(B, T_out, vocab_size)``.

    The input sequence is one-hot encoded and flattened, passed through
    ``len(hidden)`` ReLU layers, and projected to ``out_len`` positions of
    ``vocab_size`` logits each: the classic fixed-window model (Bengio et al.).
    A plain flax model: the job shards it with ``spmd.parallel.fully_shard``.
    """

    vocab_size: int
    out_len: int
    hidden: Sequence[int] = (256, 256)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.nn.one_hot(tokens, self.vocab_size, dtype=self.dtype)
        x = x.reshape(x.shape[0], -1)
        for i, h in enumerate(self.hidden):
            x = nn.relu(nn.Dense(h, dtype=self.dtype, name=f"hidden_{i}")(x))
        x = nn.Dense(self.out_len * self.vocab_size, dtype=self.dtype, name="out")(x)
        return x.reshape(x.shape[0], self.out_len, self.vocab_size)
