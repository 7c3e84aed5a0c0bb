"""A small GPT-style decoder (flax.linen): token and position embeddings, pre-norm
blocks of causal multi-head self-attention and an MLP, a final layer norm and a
tied output projection.

``Transformer.__call__(tokens, gather=...)`` runs on sharded parameters
(FSDP): the root parameters are gathered once, then the blocks run under a
``lax.scan`` over their stacked shards, each iteration all-gathering one
block's parameters right before it runs (see ``models._fsdp``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["Transformer"]


class _Attention(nn.Module):
    num_heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.num_heads
        # Head-major kernels, (D, 3, H, D/H) and (H, D/H, D): tensor parallelism cuts the heads dim (models._tp).
        qkv = nn.DenseGeneral((3, h, d // h), dtype=self.dtype, name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, self.dtype))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", attn, v)
        return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name="proj")(y)


class _Block(nn.Module):
    num_heads: int
    mlp_ratio: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x = x + _Attention(self.num_heads, self.dtype, name="attn")(nn.LayerNorm(dtype=self.dtype, name="ln1")(x))
        y = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        y = nn.Dense(self.mlp_ratio * d, dtype=self.dtype, name="fc")(y)
        y = nn.Dense(d, dtype=self.dtype, name="fc_out")(nn.gelu(y))
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

    @staticmethod
    def fsdp_units() -> tuple[str, ...]:
        """The gather units below the root (torch's ``fully_shard`` on each block): path regexes."""
        return (r"block_\d+",)

    @staticmethod
    def fsdp_keep() -> tuple[str, ...]:
        """Units gathered once and held for the backward pass: the root (the blocks re-gather)."""
        return ("root",)

    @nn.compact
    def __call__(self, tokens: jax.Array, gather: Any = None) -> jax.Array:
        """Logits; ``gather`` (from ``models._fsdp``): the parameters are this device's shards,
        and ``gather(unit, params)`` returns a unit's full parameters."""
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
        if gather is not None:
            return self._sharded(tokens, gather)
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=init, dtype=self.dtype, name="embed")
        pos = self.param("pos", init, (self.max_len, self.d_model))
        x = embed(tokens) + pos[:t].astype(self.dtype)
        for i in range(self.num_layers):
            x = _Block(self.num_heads, self.mlp_ratio, self.dtype, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return embed.attend(x)

    def _sharded(self, tokens: jax.Array, gather: Any) -> jax.Array:
        """The same forward pass on parameter shards: root gathered once and held, blocks
        scanned with one gather each (again in the backward pass when ``gather.regather``;
        otherwise the scan is unrolled)."""
        params = self.variables["params"]
        blocks = [params[f"block_{i}"] for i in range(self.num_layers)]
        root = gather("root", {k: v for k, v in params.items() if not k.startswith("block_")})
        embed = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, parent=None)
        t = tokens.shape[1]
        x = embed.apply({"params": root["embed"]}, tokens) + root["pos"][:t].astype(self.dtype)
        block = _Block(self.num_heads, self.mlp_ratio, self.dtype, parent=None)

        def body(x, shards):
            # Every block has block_0's layout (models._fsdp checks it): one program for all.
            return block.apply({"params": gather("block_0", shards)}, x), None

        if gather.regather:
            # Save the matmul outputs (activations), not the gathered parameters (an all-gather's
            # output is no dot): the backward pass gathers the block again (one more all-gather per
            # buffer, one block's parameters alive) and recomputes only the cheap elementwise ops
            # (norms, GELU, softmax). Measured against saving only the block's input and recomputing
            # it all (nothing_saveable): 5-10% less CPU per step with the per-parameter gathers, for
            # a few MiB more of saved activations (benchmarks/fsdp.py sizes).
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
        if blocks:
            # Re-gathering needs the loop (a loop body's gather cannot be merged with the forward one);
            # keeping the gathers, the blocks run unrolled, which XLA:CPU schedules faster.
            x, _ = jax.lax.scan(body, x, jax.tree.map(lambda *b: jnp.stack(b), *blocks), unroll=not gather.regather)
        x = nn.LayerNorm(dtype=self.dtype, parent=None).apply({"params": root["ln_f"]}, x)
        return embed.apply({"params": root["embed"]}, x, method=nn.Embed.attend)
