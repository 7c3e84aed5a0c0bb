"""A small GPT-style decoder (flax.linen): token and position embeddings, pre-norm
blocks of causal multi-head self-attention and an MLP, a final layer norm and a
tied output projection.

A plain flax model: no sharding code. The training job lays it out with
``spmd.parallel`` (``fully_shard`` per ``block_*``, the Megatron plan of
``models._plans.transformer_tp_plan``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["Transformer"]


class _Attention(nn.Module):
    num_heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.num_heads
        # Head-major kernels, (D, 3, H, D/H) and (H, D/H, D): tensor parallelism cuts the heads dim (models._plans).
        qkv = checkpoint_name(nn.DenseGeneral((3, h, d // h), dtype=self.dtype, name="qkv")(x), "qkv_proj")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, self.dtype))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", attn, v)
        return checkpoint_name(nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name="proj")(y), "out_proj")


class _Block(nn.Module):
    num_heads: int
    mlp_ratio: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x = x + _Attention(self.num_heads, self.dtype, name="attn")(nn.LayerNorm(dtype=self.dtype, name="ln1")(x))
        y = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        y = checkpoint_name(nn.Dense(self.mlp_ratio * d, dtype=self.dtype, name="fc")(y), "mlpwi")
        y = checkpoint_name(nn.Dense(d, dtype=self.dtype, name="fc_out")(nn.gelu(y)), "mlpwo")
        return x + y


class Transformer(nn.Module):
    """Decoder-only transformer: tokens ``(B, T)`` -> next-token logits ``(B, T, vocab_size)``.

    Sized by ``num_layers``, ``d_model``, ``num_heads`` (must divide
    ``d_model``), ``mlp_ratio`` and ``max_len`` (the longest sequence).
    """

    vocab_size: int
    max_len: int
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    mlp_ratio: int = 4
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"Transformer: d_model={self.d_model!r} is not divisible by num_heads={self.num_heads!r}; "
                "pick num_heads that divides d_model."
            )
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(
                f"Transformer: the input has {t} positions but max_len={self.max_len!r}; "
                "build the model with a larger max_len."
            )
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=init, dtype=self.dtype, name="embed")
        pos = self.param("pos", init, (self.max_len, self.d_model))
        x = embed(tokens) + pos[:t].astype(self.dtype)
        for i in range(self.num_layers):
            x = _Block(self.num_heads, self.mlp_ratio, self.dtype, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return embed.attend(x)
