"""Blocks as a scanned stack, as large JAX models write them to keep compile time flat: linen ``nn.scan``
(the layer axis at any ``variable_axes`` position, MaxText stacks on 1; optionally ``nn.remat``)."""

from __future__ import annotations

import flax.linen as nn
import jax


class Block(nn.Module):
    """A residual MLP block as an ``nn.scan`` body: ``(carry, _) -> (carry, None)``."""

    width: int
    hidden: int

    @nn.compact
    def __call__(self, x, _):
        h = jax.nn.gelu(nn.Dense(self.hidden, name="up")(nn.LayerNorm(name="norm")(x)))
        return x + nn.Dense(self.width, name="down")(h), None


class ScannedMLP(nn.Module):
    """tokens (b, t) -> logits (b, t, vocab); the blocks one ``nn.scan`` named ``layers``, their parameters
    stacked on axis ``axis``, each block under ``nn.remat`` if ``remat``."""

    vocab: int = 32
    width: int = 16
    hidden: int = 32
    depth: int = 2
    axis: int = 0
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
        block = nn.remat(Block, prevent_cse=False) if self.remat else Block
        x, _ = nn.scan(block, variable_axes={"params": self.axis}, split_rngs={"params": True},
                       length=self.depth)(self.width, self.hidden, name="layers")(x, None)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="norm")(x))


def nnx_scanned_mlp(vocab: int = 32, width: int = 16, hidden: int = 32, depth: int = 2, seed: int = 0):
    """The same residual MLP in flax.nnx, its blocks created under ``nnx.vmap`` (parameters stacked on axis 0) and
    run under ``nnx.scan``, as flax's "scan over layers" guide writes it."""
    from flax import nnx

    class NNXBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, width, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    class NNXScannedMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: nnx.Rngs):
                return NNXBlock(rngs)

            self.layers = make(rngs)
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.head = nnx.Linear(width, vocab, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            return self.head(self.norm(run(self.embed(tokens), self.layers)))

    return NNXScannedMLP(nnx.Rngs(seed))
