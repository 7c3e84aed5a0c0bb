"""A flax.nnx model as its users write it: modules holding their parameters, layers in an ``nnx.List``."""

from __future__ import annotations

import jax
from flax import nnx


class Block(nnx.Module):
    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TokenMLP(nnx.Module):
    """tokens (b, t) -> logits (b, t, vocab): an embedding, residual MLP blocks, a projection."""

    def __init__(self, vocab: int = 32, width: int = 32, hidden: int = 64, depth: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, hidden, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
