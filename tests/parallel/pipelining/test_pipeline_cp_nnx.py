"""cp under a pipeline with an nnx model: a user-written nnx decoder (its blocks an ``nnx.List``, each block's
attention module computing einsum scores, a causal mask by position and a softmax itself) pipelined over its
blocks runs each unit's ``attn`` on the sequence gathered over cp, as a linen unit's (``models.Transformer``) does:
the unit's merged copy has its submodules hooked through ``ContextCalls.around`` (``spmd.parallel.pipelining._cp``),
and the embedding lookup before the units is counted as the linen one is. 3 SGD steps equal one device's within
1e-5 (losses and parameters), and every kind's buffers and bytes in the compiled step equal the table's.

Before (GSPMD partitioned the einsums itself, uncounted), at pp=2, cp=2 the step all-gathered 16 buffers (28,928 B)
against the table's 0 and all-reduced 47 (45,088 B) against 41 (31,776 B); now 14 (24,832 B) and 23 (11,296 B),
both equal.

Also: a tied nnx head (``Embed.attend``) under pp x cp; the zoo's nnx MoE under pp x cp x ep (its units' calls
routed through the ep stages' hooks to the same ``ContextCalls.around``); what the table leaves to GSPMD with tp
in the stages, said; and the units' traces held by ``StageLayout.traced``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd.parallel import (executed_collectives, fully_shard, init_train_state, make_train_step, pipeline,
                           unshard_params)
from tests._one_device import assert_trees_close, train_one_device

T, V = 16, 24


class _Attention(nnx.Module):
    """A user's attention: einsum scores, a causal mask by position, a softmax."""

    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, hd), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.out(y.reshape(b, t, d))


class _Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = _Attention(d, heads, rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + jax.nn.gelu(self.mlp(x))


class _Decoder(nnx.Module):
    def __init__(self, rngs, d=16, heads=2, layers=2):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.blocks = nnx.List([_Block(d, heads, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "cp")), ((2, 2, 2), ("pp", "fsdp", "cp")),
                                         ((2, 2, 2), ("dp", "pp", "cp"))],
                         ids=["pp2-cp2", "pp2-fsdp2-cp2", "dp2-pp2-cp2"])
def test_nnx_decoder_pipelined_under_cp_runs_its_attention_on_the_gathered_sequence(shape, names):
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = _Decoder(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["labels"]).mean()

    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), opt)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    inner = fully_shard(model, mesh=mesh["fsdp"]) if "fsdp" in names else model
    pm = pipeline(inner, mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    if names == ("pp", "cp"):  # measured before: 16 all-gathers (28,928 B) in the step, none in the table
        assert (hlo["all-gather"]["buffers"], hlo["all-gather"]["bytes"]) == (14, 24832)
    recs = step.attention(state, batches[0])
    assert {(r["call"], r["method"]) for r in recs} == {("attn", "gather sequence")}
    rows = 4 // 2 // (2 if "fsdp" in names or "dp" in names else 1)  # a micro-batch's rows on a device
    assert all(r["gathered"] == [((rows, T, 16), "float32")] == r["cut"] for r in recs)
    assert "attention 'attn' (a unit's module): gather sequence over cp=2" in step.table(state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)


class _TiedDecoder(_Decoder):
    """The decoder with its output head tied to its embedding (``nnx.Embed.attend``), no head of its own."""

    def __init__(self, rngs):
        super().__init__(rngs)
        del self.head

    def __call__(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.embed.attend(x)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "cp")), ((2, 2, 2), ("dp", "pp", "cp"))],
                         ids=["pp2-cp2", "dp2-pp2-cp2"])
def test_nnx_tied_head_pipelined_under_cp_table_equals_hlo(shape, names):
    """A tied nnx head (``Embed.attend`` after the units) under pp x cp: the table's cp terms count its table's
    gradient as a product's (all-reduced over cp on the last stage), read from the post-unit code's gradient as
    the plain step reads it. Before, the table counted only linen's ``Embed.attend`` there: at pp=2, cp=2 the step
    all-reduced 19 buffers (9,472 B) against the table's 17 (6,400 B). 3 SGD steps equal one device's."""
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    graphdef, params = nnx.split(_TiedDecoder(nnx.Rngs(0)), nnx.Param)

    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["labels"]).mean()

    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), opt)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = pipeline(_TiedDecoder(nnx.Rngs(0)), mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    assert table["cp"]["lookups"] and table["cp"]["lookups"][0]["param"] == "embed/embedding/value"
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    if names == ("pp", "cp"):  # measured before: the table's all-reduces 17 (6,400 B)
        assert (hlo["all-reduce"]["buffers"], hlo["all-reduce"]["bytes"]) == (19, 9472)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)


def test_what_a_units_trace_shows_under_cp_is_held_by_the_layout_once_per_key(monkeypatch):
    """The units' gathered modules and rings (``pipelining._cp``) are traced once per layout and key (the sequence
    length, the activation's shapes, the mesh dims), held by ``StageLayout.traced``, not written into the
    layout's ``__dict__``; another sequence length traces again."""
    from spmd.parallel.pipelining import _cp

    rng = np.random.default_rng(0)
    model = _Decoder(nnx.Rngs(0))
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pm = pipeline(model, mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, optax.sgd(0.1))

    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["labels"]).mean()

    step = make_train_step(pm, loss_fn, optax.sgd(0.1))

    def batch(t):
        return {"tokens": rng.integers(0, V, (4, t)).astype(np.int32), "labels": rng.integers(0, V, (4, t)).astype(np.int32)}

    before = {n for lay in pm._layouts.values() for n in vars(lay)}
    assert step.communication(state, batch(T))["uncounted"] is None  # every collective over cp counted
    traced = []
    for name in ("_find_gathered", "_find_rings"):
        orig = getattr(_cp, name)
        monkeypatch.setattr(_cp, name, lambda *a, _o=orig, _n=name: traced.append((_n, a[2])) or _o(*a))
    step.communication(state, batch(T))
    assert traced == []
    step.communication(state, batch(T // 2))
    assert sorted(traced) == [("_find_gathered", T // 2), ("_find_rings", T // 2)]
    lay = next(iter(pm._layouts.values()))
    assert {n for n in vars(lay)} == before
    assert _cp.unit_gathered(pm, lay, T // 2) == frozenset({"attn"})


def _batches(t=T, vocab=V):
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, vocab, (4, t)).astype(np.int32),
            "labels": rng.integers(0, vocab, (4, t)).astype(np.int32)}


def _ce(m, b):
    return optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["labels"]).mean()


class _SplitAttention(nnx.Module):
    """The decoder's attention with q, k and v projections of their own (column-parallel each: a fused qkv cut over
    tp on its features is split by GSPMD with collective-permutes, across the heads)."""

    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads
        q, k, v = (f(x).reshape(b, t, h, hd) for f in (self.q, self.k, self.v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.out(y.reshape(b, t, d))


class _AttentionBlock(nnx.Module):
    """``x + attn(norm(x))``: the unit's last styled call's output (a row-parallel projection's) added to the residual
    (what ``_comm.tp_terms`` takes as dead in a backward's recompute on a stage that is not the last)."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attn = _SplitAttention(16, 2, rngs)

    def __call__(self, x):
        return x + self.attn(self.norm(x))


def _attention_decoder():
    m = _Decoder(nnx.Rngs(0))
    m.blocks = nnx.List([_AttentionBlock(nnx.Rngs(i + 1)) for i in range(2)])
    return m


@pytest.mark.slow
def test_nnx_own_attention_in_tensor_parallel_stages_under_cp_runs_on_the_gathered_sequence():
    """pp=2 x cp=2 x tp=2, an nnx decoder's own einsum attention (q, k, v column-parallel, out row-parallel): the
    stages' tp hooks route the unit's calls, and their ``around`` hands them to ``ContextCalls.around``
    (``_cp._StageRoute``), so ``attn`` runs on the sequence gathered over cp with its tp styles inside on the whole
    sequence (their records marked ``whole_seq``: not 1 / cp of the bytes). Every kind's buffers and bytes in the
    compiled step equal the table's; 3 SGD steps equal one device's within 1e-5; nothing is said uncounted. Before
    (GSPMD partitioning the attention), the step all-gathered 24 buffers (24,832 B) against the table's 4 (4,352 B)
    and all-reduced 71 (40,352 B) against 63 (32,160 B), the table naming 'attn' not counted; now 14 (24,832 B) and
    31 (39,712 B), equal."""
    from spmd.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    batches = [_batches()] + [{k: np.roll(v, i, axis=1) for k, v in _batches().items()} for i in (1, 2)]
    graphdef, params = nnx.split(_attention_decoder(), nnx.Param)
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: _ce(nnx.merge(graphdef, p), b), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "cp", "tp"))
    plan = {f"blocks.*.attn.{n}": ColwiseParallel() for n in "qkv"} | {"blocks.*.attn.out": RowwiseParallel()}
    pm = pipeline(parallelize_module(_attention_decoder(), mesh["tp"], plan), mesh["pp"], units="blocks.*",
                  num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, _ce, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    assert (hlo["all-gather"]["buffers"], hlo["all-reduce"]["buffers"]) == (14, 31)
    assert table["uncounted"] is None
    assert {(r["call"], r["method"]) for r in step.attention(state, batches[0])} == {("attn", "gather sequence")}
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)


@pytest.mark.slow
def test_zoo_nnx_moe_pipelined_under_cp_and_ep_runs_its_attention_and_moe_on_the_gathered_sequence():
    """The zoo's nnx MoE (einsum attention, a capacity cumsum over the sequence, learned positions looked up on
    ``jnp.arange``) on pp=2 x cp=2 x ep=2: its units' calls go through the stages' ep hooks, whose ``around`` routes
    them through ``ContextCalls.around`` (``pipelining._cp._StageRoute``), so ``attn`` and ``moe`` run on the
    sequence gathered over cp (the experts on the whole sequence's buffers), and the positions' lookup is counted as
    the tokens' is. Every kind's buffers and bytes in the compiled step equal the table's; 3 SGD steps equal one
    device's within 1e-5. Before (the attention and the MoE left to GSPMD), the step all-gathered 32 buffers
    (21,248 B) against the table's 4 (2,176 B) and all-reduced 51 (60,480 B) against 47 (132,160 B)."""
    from spmd.parallel import ExpertParallel, parallelize_module
    from tests.zoo.nnx_moe import MixtralLike

    def model():
        return MixtralLike(vocab=32, rngs=nnx.Rngs(0))

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 32, (4, T)).astype(np.int32),
                "labels": rng.integers(0, 32, (4, T)).astype(np.int32)} for _ in range(3)]
    opt = optax.sgd(0.1)
    graphdef, params = nnx.split(model(), nnx.Param)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: _ce(nnx.merge(graphdef, p), b), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "cp", "ep"))
    pm = pipeline(parallelize_module(model(), mesh["ep"], {"blocks.*.moe.experts": ExpertParallel(token_dim=1,
                                                                                                    experts_dim=0)}),
                  mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, _ce, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (table["all-to-all"]["count"],
                                                                         table["all-to-all"]["bytes"])
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    assert (hlo["all-gather"]["buffers"], hlo["all-gather"]["bytes"]) == (28, 24832)
    assert table["uncounted"] is None
    assert sorted(r["param"] for r in table["cp"]["lookups"]) == ["embed/embedding/value", "pos/embedding/value"]
    assert {(r["call"], r["method"]) for r in step.attention(state, batches[0])} == {("attn", "gather sequence"),
                                                                                    ("moe", "gather sequence")}
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
