"""A flax.nnx model whose blocks are one stacked module: created under ``nnx.vmap`` and run under ``nnx.scan``,
as flax's "scan over layers" guide writes it (how nnx models keep their compile time flat in depth)."""

from __future__ import annotations

from flax import nnx

from tests.zoo.nnx_mlp import Block


class ScannedMLP(nnx.Module):
    """tokens (b, t) -> logits (b, t, vocab): an embedding, ``depth`` residual MLP blocks stacked on axis 0, a
    projection."""

    def __init__(self, vocab: int = 32, width: int = 32, hidden: int = 64, depth: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs):
            return Block(width, hidden, rngs=rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(self.embed(tokens), self.blocks))
