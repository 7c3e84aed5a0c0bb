"""A Mixtral-style mixture-of-experts decoder in flax.linen, plain (no sharding in it).

The Llama decoder (``models._llama``: RMSNorm, rotary attention with grouped key/value heads) with a
mixture of SwiGLU experts in place of the MLP in every ``moe_every``-th block (``moe_every=2``: blocks 1,
3, ...). A router (a linear map d -> E, softmax) picks ``top_k`` experts per token and weighs them by
their renormalised probabilities.

Routing with a capacity, as GShard and Switch write it: each sequence is a routing group, and each
expert takes at most ``capacity = min(t, max(1, ceil(capacity_factor * t * top_k / E)))`` of a group's
``t`` tokens. Places go first to every token's first choice in sequence order, then to every token's
second choice, and so on; an assignment past the capacity is dropped: it adds nothing, and the residual
carries the token. Because a group is one sequence, the drops do not depend on how the batch is cut.

The experts' parameters carry a leading experts dim (``gate_proj`` and ``up_proj`` ``[E, d, f]``,
``down_proj`` ``[E, f, d]``) and the experts run as dense einsums over ``[b, E, capacity, d]`` dispatch
buffers: the form expert parallelism cuts. Each MoE block sows the number of dropped assignments as the
intermediate ``dropped`` and the Switch / Mixtral load-balancing loss as ``load_balancing``
(``model.apply(..., mutable=["intermediates"])``); adding the latter to the training loss is the loss's
business.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from models._llama import MLP, Attention, LlamaConfig, RMSNorm
from spmd.parallel.experts import expert_capacity, expert_places


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """The sizes of a ``MoE``: a ``LlamaConfig`` (vocabulary, width, MLP width, layers, heads, attention) plus the
    experts, their top-k, placement and capacity."""

    num_experts: int = 8
    top_k: int = 2
    moe_every: int = 2  # blocks moe_every-1, 2*moe_every-1, ... hold the experts
    capacity_factor: float = 1.25


def route(logits, top_k: int):
    """Router logits ``[..., E]`` -> (weights, experts) ``[..., top_k]``: softmax, top-k, renormalised."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    return weights / weights.sum(-1, keepdims=True), experts


class Experts(nn.Module):
    """E SwiGLU experts, parameters stacked on a leading experts dim; ``[b, E, c, d] -> [b, E, c, d]``."""

    num_experts: int
    hidden_size: int
    intermediate_size: int

    @nn.compact
    def __call__(self, x):
        e, d, f = self.num_experts, self.hidden_size, self.intermediate_size
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        gate = self.param("gate_proj", init, (e, d, f))
        up = self.param("up_proj", init, (e, d, f))
        down = self.param("down_proj", init, (e, f, d))
        h = nn.silu(jnp.einsum("becd,edf->becf", x, gate)) * jnp.einsum("becd,edf->becf", x, up)
        return jnp.einsum("becf,efd->becd", h, down)


class MoEMLP(nn.Module):
    """Router + experts with capacity routing; ``[b, t, d] -> [b, t, d]``, sows ``dropped``."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, _ = x.shape
        e, k = c.num_experts, c.top_k
        cap = expert_capacity(t, e, k, c.capacity_factor)
        logits = nn.Dense(e, use_bias=False, name="router")(x)
        weights, experts = route(logits, k)
        onehot = jax.nn.one_hot(experts, e, dtype=jnp.int32)                    # [b, t, k, E]
        place = expert_places(experts, e)  # each (token, choice)'s place in its expert's queue  [b, t, k]
        kept = place < cap
        self.sow("intermediates", "dropped", (~kept).sum())
        # Switch / Mixtral load balancing: E * sum over choices and experts of (share of the tokens whose
        # choice is the expert) x (the expert's mean router probability); top_k when routing is even
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        share = onehot.reshape(-1, k, e).mean(0)                                 # [k, E]
        self.sow("intermediates", "load_balancing", e * jnp.sum(share * probs.reshape(-1, e).mean(0)))
        slot = jax.nn.one_hot(jnp.where(kept, place, cap), cap, dtype=x.dtype)  # dropped: an all-zero row
        dispatch = jnp.einsum("btke,btkc->btec", onehot.astype(x.dtype), slot)  # [b, t, E, cap]
        combine = jnp.einsum("btke,btkc,btk->btec", onehot.astype(x.dtype), slot, weights.astype(x.dtype))
        buffers = jnp.einsum("btec,btd->becd", dispatch, x)                     # [b, E, cap, d]
        y = Experts(e, c.hidden_size, c.intermediate_size, name="experts")(buffers)
        return jnp.einsum("btec,becd->btd", combine, y)


class MoEDecoderLayer(nn.Module):
    cfg: MoEConfig
    sparse: bool

    def setup(self):
        self.input_layernorm = RMSNorm(self.cfg.eps)
        self.self_attn = Attention(self.cfg)
        self.post_attention_layernorm = RMSNorm(self.cfg.eps)
        self.mlp = MoEMLP(self.cfg) if self.sparse else MLP(self.cfg)

    def __call__(self, x):
        return _block(self, x)


def _block(layer: MoEDecoderLayer, x):
    """A block's computation, a plain function: the scanned layer runs it without a second ``__call__`` of the
    same module (which module hooks, a pipeline's among them, would see as the layer called twice)."""
    x = x + layer.self_attn(layer.input_layernorm(x))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class ScannedMoELayer(MoEDecoderLayer):
    """An MoE decoder layer as an ``nn.scan`` body: ``(carry, _) -> (carry, None)``."""

    def __call__(self, x, _):
        return _block(self, x), None


class MoE(nn.Module):
    """tokens (b, t) -> logits (b, t, vocab); blocks ``layers_i`` with ``i % moe_every == moe_every - 1``
    hold a mixture of experts (``layers_i.mlp.router``, ``layers_i.mlp.experts``). ``scan_layers=True``
    (``moe_every=1``: every block holds experts): the blocks as one ``nn.scan`` stack ``layers``, its parameters
    stacked on a leading layer axis (``layers.mlp.experts`` ``[L, E, d, f]``), as MaxText scans its MoE blocks."""

    cfg: MoEConfig

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        if c.scan_layers:
            if c.moe_every != 1:
                raise ValueError(f"MoE: scan_layers=True stacks blocks of one shape, but moe_every={c.moe_every} "
                                 "puts experts in one block of every few; give moe_every=1 or scan_layers=False.")
            self.layers = nn.scan(ScannedMoELayer, variable_axes={"params": 0, "intermediates": 0},
                                  split_rngs={"params": True}, length=c.num_layers)(c, True)
        else:
            self.layers = [MoEDecoderLayer(c, i % c.moe_every == c.moe_every - 1) for i in range(c.num_layers)]
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
