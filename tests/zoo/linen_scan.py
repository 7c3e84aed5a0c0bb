"""A decoder as MaxText writes its layers (linen): one ``DecoderLayer`` under ``nn.remat`` and ``nn.scan``,
the parameters stacked on axis 1 (MaxText's ``param_scan_axis``), RMSNorm, causal attention, a gated MLP."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class DecoderLayer(nn.Module):
    width: int
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x, _=None):
        b, t, d = x.shape
        hd = d // self.heads
        h = nn.RMSNorm(name="pre_attention_norm")(x)
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(h).reshape(b, t, self.heads, hd)
                   for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False, name="out")(a)
        h = nn.RMSNorm(name="pre_mlp_norm")(x)
        gate = nn.Dense(self.hidden, use_bias=False, name="wi_0")(h)
        up = nn.Dense(self.hidden, use_bias=False, name="wi_1")(h)
        return x + nn.Dense(d, use_bias=False, name="wo")(jax.nn.silu(gate) * up), None


class ScannedDecoder(nn.Module):
    """tokens (b, t) -> logits (b, t, vocab)."""
    vocab: int = 64
    width: int = 32
    heads: int = 4
    hidden: int = 64
    depth: int = 2
    scan_axis: int = 1

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, name="token_embedder")(tokens)
        stack = nn.scan(nn.remat(DecoderLayer, prevent_cse=False), variable_axes={"params": self.scan_axis},
                        split_rngs={"params": True}, length=self.depth)
        x, _ = stack(self.width, self.heads, self.hidden, name="layers")(x)
        x = nn.RMSNorm(name="decoder_norm")(x)
        return nn.Dense(self.vocab, use_bias=False, name="logits_dense")(x)
