"""The transformer under tensor (and sequence) parallelism, Megatron-LM's layout, on local blocks.

Runs inside the train step's SPMD region (``models._tp_step``) on each device's blocks of the plan
``transformer_tp_rules`` lays out on the ``tp`` mesh dim:

- attention: ``qkv`` column-parallel with the heads cut (kernel ``(D, 3, H, D/H)`` ``Shard(2)``), each
  device attends with its heads, ``proj`` row-parallel (kernel ``(H, D/H, D)`` ``Shard(0)``): its
  output is ``Partial(sum)`` over ``tp``, reduced once; the MLP: ``fc`` column-, ``fc_out`` row-parallel;
- without sequence parallelism the activations between blocks are ``Replicate`` over ``tp``: one
  all-reduce after attention and one after the MLP in the forward pass; the backward pass all-reduces
  the input gradient of each column-parallel layer (JAX's transpose of the implicit ``pvary`` where a
  replicated activation meets a ``tp``-sharded weight): Megatron's ``f`` and ``g``;
- with sequence parallelism they are ``Shard(1)`` (the sequence) over ``tp``: each all-reduce becomes
  an all-gather before the column-parallel layer and a reduce-scatter after the row-parallel one (their
  transposes in the backward pass), and the norms run on the device's positions;
- the embedding and the tied output projection are cut on the vocabulary (``Shard(0)`` of the table):
  the lookup is a masked local gather then one reduction, and the loss is a vocab-parallel
  cross-entropy (all-reduced max, sum of exponentials and target logit), so full logits never exist.

Heads, MLP width and vocabulary need not divide the tp size: the blocks are ``torch.chunk`` chunks,
padded with zeros, and a zero head, column or vocabulary row contributes nothing and stays zero (its
logits are masked out of the softmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from placements import Replicate, Shard
from spmd.parallel import ColwiseParallel, ParamPlan, RowwiseParallel, SequenceParallel, parallelize_rules

__all__ = ["TPContext", "transformer_tp_rules", "check_tp_plan", "tp_loss", "TP_COMM"]

TP_COMM = "tp_comm"  # checkpoint name of the tp collectives' results (kept, never recomputed)


def transformer_tp_rules(sequence_parallel: bool = False, tp: str = "tp") -> tuple:
    """The Megatron plan of ``models.Transformer`` on mesh dim ``tp`` (compose with fsdp/dp in ``plan_params``)."""
    plan = {
        "embed": RowwiseParallel(),  # vocab-parallel embedding (and the tied output projection)
        r"block_\d+/attn/qkv": ColwiseParallel(dim=-2),  # the heads
        r"block_\d+/attn/proj": RowwiseParallel(),
        r"block_\d+/fc": ColwiseParallel(),
        r"block_\d+/fc_out": RowwiseParallel(),
    }
    if sequence_parallel:
        plan[r"block_\d+/ln[12]|ln_f"] = SequenceParallel()
    return parallelize_rules(plan, tp)


# (path suffix, tp placement the forward pass reads, what it cuts)
_LAYOUT = (
    ("embed/embedding", Shard(0), "the vocabulary rows"),
    ("attn/qkv/kernel", Shard(2), "the heads"),
    ("attn/qkv/bias", Shard(1), "the heads"),
    ("attn/proj/kernel", Shard(0), "the heads"),
    ("fc/kernel", Shard(1), "the MLP width"),
    ("fc/bias", Shard(0), "the MLP width"),
    ("fc_out/kernel", Shard(0), "the MLP width"),
)


def check_tp_plan(plan: ParamPlan, tp: str, where: str) -> None:
    """Refuse a plan whose ``tp`` placements are not the layout the tensor-parallel forward pass reads,
    or that cuts one tensor dim on both ``tp`` and the fsdp dim."""
    ti = plan.mesh_dim_names.index(tp)
    fi = plan.mesh_dim_names.index(plan.fsdp) if plan.fsdp in plan.mesh_dim_names else None
    n = plan.mesh_shape[ti]
    for e in plan.entries:
        got = e.placements[ti]
        want = next((p for suffix, p, _ in _LAYOUT if e.path == suffix or e.path.endswith("/" + suffix)), Replicate())
        what = next((w for suffix, _, w in _LAYOUT if e.path == suffix or e.path.endswith("/" + suffix)), None)
        if got != want:
            fix = (f"cut {what} with Shard({want.dim}) (transformer_tp_rules() does; torch.chunk over tp={n} is "
                   f"fine when {e.shape[want.dim]} does not divide)" if what else "keep it Replicate() on tp")
            cuts = (f"cuts dim {got.dim} (size {e.shape[got.dim]})" if isinstance(got, Shard) else "keeps it whole")
            raise ValueError(
                f"{where}: parameter {e.path!r} of shape {e.shape} is {got} on {tp!r} (tp={n}), which {cuts}; "
                f"the tensor-parallel transformer needs it {want}: {fix}."
            )
        if fi is not None and isinstance(got, Shard) and e.shard_dim(fi) == got.dim:
            raise ValueError(
                f"{where}: parameter {e.path!r} of shape {e.shape} is cut on dim {got.dim} by both {tp!r} and "
                f"{plan.fsdp!r}; let {plan.fsdp!r} cut another dim (plan_params' default does: drop the rule that "
                f"sets Shard({got.dim}) on {plan.fsdp!r})."
            )


@dataclass(frozen=True)
class TPContext:
    """What the forward pass needs to know about the mesh: the tp dim, its size, sequence parallelism."""

    tp: str
    n: int
    sequence_parallel: bool
    dtype: Any = jnp.float32

    def rank(self):
        return lax.axis_index(self.tp)

    def enter(self, x):
        """A column-parallel layer's input: the whole sequence (all-gathered under sequence parallelism)."""
        return checkpoint_name(lax.all_gather(x, self.tp, axis=1, tiled=True), TP_COMM) if self.sequence_parallel else x

    def exit(self, y):
        """A row-parallel layer's ``Partial(sum)`` output reduced once: all-reduce or reduce-scatter on the sequence."""
        if self.sequence_parallel:
            y = lax.psum_scatter(y, self.tp, scatter_dimension=1, tiled=True)
        else:
            y = lax.psum(y, self.tp)
        return checkpoint_name(y, TP_COMM)


def _ln(p, x, ctx):
    return nn.LayerNorm(dtype=ctx.dtype, parent=None).apply({"params": p}, x)


def _block(p: dict, x: jax.Array, ctx: TPContext) -> jax.Array:
    a = p["attn"]
    h = ctx.enter(_ln(p["ln1"], x, ctx))
    qkv = jnp.einsum("btd,dshe->btshe", h, a["qkv"]["kernel"]) + a["qkv"]["bias"]  # this device's heads
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    t, hd = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(hd, ctx.dtype))
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(scores.dtype).min)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + (ctx.exit(jnp.einsum("bqhe,hed->bqd", y, a["proj"]["kernel"])) + a["proj"]["bias"])
    h = ctx.enter(_ln(p["ln2"], x, ctx))
    h = nn.gelu(jnp.einsum("btd,df->btf", h, p["fc"]["kernel"]) + p["fc"]["bias"])
    return x + (ctx.exit(jnp.einsum("btf,fd->btd", h, p["fc_out"]["kernel"])) + p["fc_out"]["bias"])


def _embed(table: jax.Array, pos: jax.Array, tokens: jax.Array, ctx: TPContext) -> jax.Array:
    """Vocab-parallel lookup: rows this device holds, zeros elsewhere, summed over tp once."""
    vc = table.shape[0]
    ids = tokens - ctx.rank() * vc
    ok = (ids >= 0) & (ids < vc)
    e = jnp.where(ok[..., None], jnp.take(table, jnp.clip(ids, 0, vc - 1), axis=0), 0).astype(ctx.dtype)
    t = tokens.shape[1]
    if ctx.sequence_parallel:
        local = t // ctx.n
        return ctx.exit(e) + lax.dynamic_slice_in_dim(pos[:t], ctx.rank() * local, local, axis=0).astype(ctx.dtype)
    return ctx.exit(e) + pos[:t].astype(ctx.dtype)


def _vocab_parallel_ce(x: jax.Array, table: jax.Array, batch: dict, vocab: int, ctx: TPContext):
    """Mean next-token loss and accuracy from this device's vocabulary columns of the logits."""
    logits = jnp.einsum("btd,vd->btv", ctx.enter(x), table)  # the tied output projection, local columns
    vc = table.shape[0]
    off = ctx.rank() * vc
    logits = jnp.where(jnp.arange(vc) + off < vocab, logits.astype(jnp.float32), -jnp.inf)  # padding rows
    local_max = jnp.max(logits, axis=-1)
    m = lax.pmax(lax.stop_gradient(local_max), ctx.tp)
    tgt = batch["targets"] - off
    mine = (tgt >= 0) & (tgt < vc)
    tl = jnp.take_along_axis(logits, jnp.clip(tgt, 0, vc - 1)[..., None], axis=-1)[..., 0]
    se_tl = lax.psum(jnp.stack([jnp.sum(jnp.exp(logits - m[..., None]), axis=-1), jnp.where(mine, tl, 0.0)]), ctx.tp)
    nll = m + jnp.log(se_tl[0]) - se_tl[1]
    # argmax over the whole vocabulary: the smallest index holding the global max (jnp.argmax's first).
    pred = lax.pmin(jnp.where(local_max == m, jnp.argmax(logits, axis=-1) + off, vocab), ctx.tp)
    right = (pred == batch["targets"]).astype(jnp.float32)
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(nll), {"accuracy": jnp.mean(right)}
    total = jnp.sum(mask)
    return jnp.sum(nll * mask) / total, {"accuracy": jnp.sum(right * mask) / total}


def tp_loss(model: Any, params: dict, batch: dict, ctx: TPContext, gather: Any = None) -> tuple[jax.Array, dict]:
    """``(loss, metrics)`` of ``model`` (a ``models.Transformer``) on this device's blocks.

    ``gather(unit, params)`` (FSDP on another mesh dim) makes a unit's tp-local blocks whole on fsdp:
    the root once, each block right before it runs (again for its backward pass when ``gather.regather``).
    """
    tokens = batch["inputs"]
    if ctx.sequence_parallel and tokens.shape[1] % ctx.n:
        raise ValueError(
            f"tp_loss: sequence parallelism cuts the sequence over tp={ctx.n}, but the input has "
            f"{tokens.shape[1]} positions; use a sequence length that is a multiple of {ctx.n}, or "
            "sequence_parallel=False."
        )
    root = {k: v for k, v in params.items() if not k.startswith("block_")}
    if gather is not None:
        root = gather("root", root)
    x = _embed(root["embed"]["embedding"], root["pos"], tokens, ctx)

    def body(x, shards):
        return _block(gather("block_0", shards) if gather is not None else shards, x, ctx), None

    if gather is not None and gather.regather:
        # Re-gather each block's parameters for its backward pass; keep the matmul outputs and the tp
        # collectives' results, so the backward pass repeats no tp communication.
        policy = jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(TP_COMM))
        body = jax.checkpoint(body, policy=policy)
    blocks = [params[f"block_{i}"] for i in range(model.num_layers)]
    if gather is None:  # whole on fsdp already: the blocks unrolled (no stacked copy of their parameters)
        for p in blocks:
            x = _block(p, x, ctx)
    elif blocks:  # scanned: one block gathered at a time; keeping the gathers, unrolled (as models.Transformer:
        # the loop would stack every block's gathered parameters as residuals: 1.15x the CPU per step on
        # dp=2,fsdp=2,tp=2 in benchmarks/tensor_parallel.py's interleaved A/B)
        x, _ = lax.scan(body, x, jax.tree.map(lambda *b: jnp.stack(b), *blocks), unroll=not gather.regather)
    x = _ln(root["ln_f"], x, ctx)
    return _vocab_parallel_ce(x, root["embed"]["embedding"], batch, model.vocab_size, ctx)
