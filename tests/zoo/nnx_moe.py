"""A Mixtral-like mixture-of-experts decoder in flax.nnx, as its users write it (no sharding in it).

The MoE block follows the dense-matmul layout public JAX MoE code uses (MaxText's ``moe.py``, GShard): a gate
(``nnx.Linear`` d -> E), the top-k of its logits with a softmax over the k chosen (Mixtral), a capacity per
sequence ``ceil(capacity_factor * S * k / E)`` filled token by token (each token's k choices in turn), one-hot
dispatch and combine masks ``[B, S, E, C]``, the tokens gathered into experts-first buffers with the einsum
``BSM,BSEC->EBCM``, the experts run on their buffers as stacked weights (``[E, M, H]`` and ``[E, H, M]``,
``EBCM,EMH->EBCH``), and the outputs put back with ``EBCM,BSEC->BSM``; each block sows its count of assignments
over capacity (``nnx.Intermediate`` ``dropped``). Attention is causal multi-head einsum
attention with learned positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class Experts(nnx.Module):
    """E SwiGLU experts stacked on a leading dim; ``[E, B, C, M] -> [E, B, C, M]``."""

    def __init__(self, num_experts: int, dim: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.wi_0 = nnx.Param(init(rngs.params(), (num_experts, dim, hidden)))
        self.wi_1 = nnx.Param(init(rngs.params(), (num_experts, dim, hidden)))
        self.wo = nnx.Param(init(rngs.params(), (num_experts, hidden, dim)))

    def __call__(self, x):
        h = jax.nn.silu(jnp.einsum("EBCM,EMH->EBCH", x, self.wi_0[...]))
        h = h * jnp.einsum("EBCM,EMH->EBCH", x, self.wi_1[...])
        return jnp.einsum("EBCH,EHM->EBCM", h, self.wo[...])


class SparseMoE(nnx.Module):
    """Gate, top-k, capacity masks, experts; ``[B, S, M] -> [B, S, M]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float, *,
                 rngs: nnx.Rngs):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.gate = nnx.Linear(dim, num_experts, use_bias=False, rngs=rngs)
        self.experts = Experts(num_experts, dim, hidden, rngs=rngs)

    def masks(self, x):
        """(dispatch, combine) ``[B, S, E, C]`` of one-hot slots; combine holds the chosen experts' weights."""
        b, s, _ = x.shape
        e, k = self.num_experts, self.top_k
        logits = self.gate(x)
        top_logits, top_idx = jax.lax.top_k(logits, k)                                # [B, S, K]
        weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1)
        capacity = max(1, math.ceil(self.capacity_factor * s * k / e))
        chosen = jax.nn.one_hot(top_idx, e, dtype=jnp.int32).reshape(b, s * k, e)     # token by token
        position = (jnp.cumsum(chosen, axis=1) * chosen).reshape(b, s, k, e)          # 1-based queue place
        fits = (position > 0) & (position <= capacity)
        self.sow(nnx.Intermediate, "dropped", (position > capacity).sum())  # assignments over capacity
        slot = jax.nn.one_hot(position - 1, capacity, dtype=x.dtype) * fits[..., None]  # [B, S, K, E, C]
        dispatch = slot.sum(2)
        combine = jnp.einsum("BSKEC,BSK->BSEC", slot, weights.astype(x.dtype))
        return dispatch, combine

    def __call__(self, x):
        dispatch, combine = self.masks(x)
        buffers = jnp.einsum("BSM,BSEC->EBCM", x, dispatch)
        return jnp.einsum("EBCM,BSEC->BSM", self.experts(buffers), combine)


class Attention(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, m = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * self.heads, m // self.heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(m // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.out(o.reshape(b, s, m))


class Block(nnx.Module):
    def __init__(self, dim, heads, hidden, num_experts, top_k, capacity_factor, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = Attention(dim, heads, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.moe = SparseMoE(dim, hidden, num_experts, top_k, capacity_factor, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MixtralLike(nnx.Module):
    """tokens (B, S) -> logits (B, S, vocab): embeddings, ``depth`` blocks with a sparse MoE each, a head."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, hidden: int = 32, depth: int = 2,
                 num_experts: int = 4, top_k: int = 2, capacity_factor: float = 1.0, max_len: int = 16, *,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, num_experts, top_k, capacity_factor, rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
