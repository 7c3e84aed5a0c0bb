"""A Llama-style decoder in flax.linen, written the way model code is written outside this project.

RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention (``num_kv_heads`` key/value heads
shared by ``num_heads`` query heads), an untied LM head, and the blocks as a Python list set up in
``setup`` (linen names them ``layers_0``, ``layers_1``, ...). Attention reshapes by the *global* head
counts, as every such model does. Nothing in it knows about meshes or sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a ``Llama``: vocabulary, width, MLP width, layers, query and key/value heads."""

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-5
    scan_layers: bool = False  # the blocks as one nn.scan (parameters stacked by layer), as MaxText offers
    # Hugging Face's switch: "eager" (the einsum below), "sdpa" (jax.nn.dot_product_attention, which a mesh
    # with cp runs across the sequence cut) or "flash_attention_2" (the same call with implementation="cudnn":
    # cuDNN's fused flash attention, GPUs only)
    attn_implementation: str = "eager"

    def __post_init__(self):
        if self.attn_implementation not in ("eager", "sdpa", "flash_attention_2"):
            raise ValueError(f"LlamaConfig: attn_implementation={self.attn_implementation!r} is not 'eager', "
                             "'sdpa' or 'flash_attention_2'.")


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * w


def rotary(x, theta):
    """x: (b, t, heads, head_dim) -> x rotated by position."""
    t, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    cfg: LlamaConfig

    def setup(self):
        c = self.cfg
        self.head_dim = c.hidden_size // c.num_heads
        self.q_proj = nn.Dense(c.num_heads * self.head_dim, use_bias=False)
        self.k_proj = nn.Dense(c.num_kv_heads * self.head_dim, use_bias=False)
        self.v_proj = nn.Dense(c.num_kv_heads * self.head_dim, use_bias=False)
        self.o_proj = nn.Dense(c.hidden_size, use_bias=False)

    def __call__(self, x):
        c = self.cfg
        b, t, _ = x.shape
        # the projections named as MaxText names them (activation checkpointing's named policies keep them)
        q = checkpoint_name(self.q_proj(x), "query_proj").reshape(b, t, c.num_heads, self.head_dim)
        k = checkpoint_name(self.k_proj(x), "key_proj").reshape(b, t, c.num_kv_heads, self.head_dim)
        v = checkpoint_name(self.v_proj(x), "value_proj").reshape(b, t, c.num_kv_heads, self.head_dim)
        q, k = rotary(q, c.rope_theta), rotary(k, c.rope_theta)
        if c.attn_implementation != "eager":  # grouped-query heads as they are
            fused = "cudnn" if c.attn_implementation == "flash_attention_2" else None
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=fused)
            return checkpoint_name(self.o_proj(y.reshape(b, t, c.num_heads * self.head_dim)), "out_proj")
        rep = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return checkpoint_name(self.o_proj(y.reshape(b, t, c.num_heads * self.head_dim)), "out_proj")


class MLP(nn.Module):
    cfg: LlamaConfig

    def setup(self):
        self.gate_proj = nn.Dense(self.cfg.intermediate_size, use_bias=False)
        self.up_proj = nn.Dense(self.cfg.intermediate_size, use_bias=False)
        self.down_proj = nn.Dense(self.cfg.hidden_size, use_bias=False)

    def __call__(self, x):
        h = nn.silu(checkpoint_name(self.gate_proj(x), "mlpwi")) * checkpoint_name(self.up_proj(x), "mlpwi")
        return checkpoint_name(self.down_proj(h), "mlpwo")


class DecoderLayer(nn.Module):
    cfg: LlamaConfig

    def setup(self):
        self.input_layernorm = RMSNorm(self.cfg.eps)
        self.self_attn = Attention(self.cfg)
        self.post_attention_layernorm = RMSNorm(self.cfg.eps)
        self.mlp = MLP(self.cfg)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ScannedLayer(DecoderLayer):
    """A decoder layer as an ``nn.scan`` body: ``(carry, _) -> (carry, None)``."""

    def __call__(self, x, _):
        return super().__call__(x), None


class Llama(nn.Module):
    """tokens (b, t) -> logits (b, t, vocab)."""

    cfg: LlamaConfig

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        if c.scan_layers:
            self.layers = nn.scan(ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                                  length=c.num_layers)(c)
        else:
            self.layers = [DecoderLayer(c) for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.eps)
        self.lm_head = nn.Dense(c.vocab_size, use_bias=False)

    def __call__(self, tokens):
        x = self.embed_tokens(tokens)
        if self.cfg.scan_layers:
            x, _ = self.layers(x, None)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.lm_head(self.norm(x))
