"""A multi-layer perceptron over token sequences (flax.linen)."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MLP"]


class MLP(nn.Module):
    """One-hot tokens ``(B, T_in)`` -> logits ``(B, T_out, vocab_size)``.

    The input sequence is one-hot encoded and flattened, passed through
    ``len(hidden)`` ReLU layers, and projected to ``out_len`` positions of
    ``vocab_size`` logits each: the classic fixed-window model (Bengio et al.).
    """

    vocab_size: int
    out_len: int
    hidden: Sequence[int] = (256, 256)
    dtype: jnp.dtype = jnp.float32

    @staticmethod
    def fsdp_units() -> tuple[str, ...]:
        """The gather units (torch's ``fully_shard`` on each layer): path regexes."""
        return (r"hidden_\d+", "out")

    @staticmethod
    def fsdp_keep() -> tuple[str, ...]:
        """Units gathered once and held for the backward pass: all (layers of different shapes run
        unrolled, and XLA merges a re-gather with the forward one)."""
        return (".*",)

    @nn.compact
    def __call__(self, tokens: jax.Array, gather: Any = None) -> jax.Array:
        """Logits; with ``gather`` (from ``models._fsdp``) the parameters are this device's
        shards and each layer all-gathers its own right before it runs."""
        x = jax.nn.one_hot(tokens, self.vocab_size, dtype=self.dtype)
        x = x.reshape(x.shape[0], -1)
        params = self.variables.get("params", {}) if gather is not None else None
        for i, h in enumerate(self.hidden):
            x = nn.relu(self._dense(h, f"hidden_{i}", x, params, gather))
        x = self._dense(self.out_len * self.vocab_size, "out", x, params, gather)
        return x.reshape(x.shape[0], self.out_len, self.vocab_size)

    def _dense(self, features: int, name: str, x: jax.Array, params: Any, gather: Any) -> jax.Array:
        if gather is None:
            return nn.Dense(features, dtype=self.dtype, name=name)(x)
        layer = nn.Dense(features, dtype=self.dtype, parent=None)
        return layer.apply({"params": gather(name, params[name])}, x)
