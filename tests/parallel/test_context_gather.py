"""A model's own attention under cp: the module computing it runs on the sequence gathered over cp.

``models.Transformer`` (linen, einsum attention with a causal ``tril`` mask, a learned position table, a tied
output head) and a small user-written nnx decoder (einsum attention with RoPE computed inside the attention
module from ``arange(T)``) trained under cp equal 3 SGD steps on one device within 1e-5 (losses and
parameters); the table names each gathered module and its all-gathers equal the compiled step's (HLO == table);
attention outside any submodule taking the sequence is refused, naming the fix. A user's nnx decoder calling
``nnx.dot_product_attention`` with a causal mask array (``nnx.make_causal_mask``: each device builds its rows, nothing
moves) runs as the all-gather of K/V, equal to one device, HLO equal to the table.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flax.linen as nn
import spmd
from models import Transformer
from spmd.parallel import executed_collectives, init_train_state, make_train_step, unshard_params
from tests._one_device import assert_trees_close, train_one_device

T, V = 16, 24
OPT = optax.sgd(0.1)


def _batches(n=3, b=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, V, (b, T)).astype(np.int32),
             "labels": rng.integers(0, V, (b, T)).astype(np.int32)} for _ in range(n)]


def _xent(logits, b):
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()


def _assert_table_is_hlo(comm, hlo):
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        want = comm["total"].get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), kind


def _run(model, loss_fn, params, mesh, batches, ref_losses, ref_params):
    state = init_train_state(model, OPT, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, OPT, mesh=mesh)
    table = step.table(state, batches[0])
    comm = step.communication(state, batches[0])
    hlo = executed_collectives(step._build(state.plan).jitted, state, batches[0], scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref_params)
    _assert_table_is_hlo(comm, hlo)
    return table, comm


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2,), ("cp",)), ((2, 4), ("dp", "cp"))], ids=["cp2", "dp2-cp4"])
def test_einsum_transformer_runs_its_attention_on_the_gathered_sequence(shape, names):
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    n = dict(zip(names, shape))["cp"]
    b_local = 4 // (shape[0] if len(shape) == 2 else 1)
    model = Transformer(V, T, 2, 16, 2)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]

    def loss_fn(p, b):
        return _xent(model.apply({"params": p}, b["tokens"]), b)

    ref_losses, ref = train_one_device(params, batches, loss_fn, OPT)
    table, comm = _run(model, loss_fn, params, mesh, batches, ref_losses, ref.params)
    for layer in (0, 1):
        assert (f"attention 'block_{layer}.attn': gather sequence over cp={n} (in [{b_local}, {T}, 16] float32; "
                "its output cut back") in table
    # per layer: the block's normed input gathered forward, the attention output's cotangent backward
    gathers = comm["attention"]
    assert [r["call"] for r in gathers] == ["block_0.attn", "block_1.attn"]
    assert all(r["gathered"] == [((b_local, T, 16), "float32")] == r["cut"] for r in gathers)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "sp"])
def test_einsum_transformer_under_cp_and_tp_equals_one_device(sp):
    """Megatron's plan on tp beside cp: the styles' regions outside the gathered attention take the sequence cut
    over cp (manual over cp too: the ids of the vocabulary-parallel lookup, the blocks' MLPs, the tied head), the
    attention module's own on the gathered sequence; the HLO equal to the table. With sequence parallelism
    (``sp``) the attention module's input arrives cut over cp and tp: it is gathered over both in one all-gather
    (its output cut back over both, its cotangent gathered so), and its projections' styles take the whole
    sequence (their ``Shard(1)`` read as ``Replicate``: an all-reduce over tp each way); before, GSPMD gathered the
    input over tp first and the K/V over cp inside, 28 all-gathers (73,728 B) against the table's 16."""
    from models._plans import transformer_tp_plan
    from spmd.parallel import parallelize_module

    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = Transformer(V, T, 2, 16, 2)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]

    def loss_fn(p, b):
        return _xent(laid.apply({"params": p}, b["tokens"]), b)

    laid = parallelize_module(model, mesh["tp"], transformer_tp_plan(sp, vocab_size=V, tp_size=2))
    ref_losses, ref = train_one_device(params, batches, lambda p, b: _xent(model.apply({"params": p}, b["tokens"]), b),
                                       OPT)
    table, comm = _run(laid, loss_fn, params, mesh, batches, ref_losses, ref.params)
    assert [r["call"] for r in comm["attention"]] == ["block_0.attn", "block_1.attn"]


class _Attention(nnx.Module):
    """A user's attention: einsum scores, RoPE from arange(T) computed here, a causal mask by position."""

    def __init__(self, d, heads, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, hd), 3, axis=2)
        pos = jnp.arange(t)[:, None] / 10000 ** (jnp.arange(hd // 2) / (hd // 2))
        cos, sin = jnp.cos(pos)[None, :, None], jnp.sin(pos)[None, :, None]

        def rope(z):
            z1, z2 = z[..., : hd // 2], z[..., hd // 2:]
            return jnp.concatenate([z1 * cos - z2 * sin, z1 * sin + z2 * cos], axis=-1)

        s = jnp.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / np.sqrt(hd)
        s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.out(y.reshape(b, t, d))


class _Decoder(nnx.Module):
    def __init__(self, rngs, d=16, heads=2, layers=2):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.norms = nnx.List([nnx.LayerNorm(d, rngs=rngs) for _ in range(layers)])
        self.attns = nnx.List([_Attention(d, heads, rngs) for _ in range(layers)])
        self.mlps = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for norm, attn, mlp in zip(self.norms, self.attns, self.mlps):
            x = x + attn(norm(x))
            x = x + jax.nn.gelu(mlp(x))
        return self.head(x)


@pytest.mark.slow
def test_a_user_written_nnx_decoder_runs_its_attention_on_the_gathered_sequence():
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _Decoder(nnx.Rngs(0))
    batches = _batches()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(m, b):
        return _xent(m(b["tokens"]), b)

    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), OPT)
    table, comm = _run(model, loss_fn, None, mesh, batches, ref_losses, ref.params)
    assert [r["call"] for r in comm["attention"]] == ["attns.0", "attns.1"]
    assert "attention 'attns.1': gather sequence over cp=2 (in [2, 16, 16] float32" in table


class _CondAttention(_Attention):
    """The user's attention taking a per-example conditioning vector beside the hidden states: ``[batch, d]`` with
    ``d`` equal to the sequence length (16), no sequence."""

    def __call__(self, x, cond):
        return super().__call__(x + cond[:, None, :])


class _CondDecoder(nnx.Module):
    def __init__(self, rngs, d=T):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.attn = _CondAttention(d, 2, rngs)
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        cond = jnp.broadcast_to(jnp.sin(jnp.arange(x.shape[-1], dtype=x.dtype)), (x.shape[0], x.shape[-1]))
        return self.head(x + self.attn(x, cond))


@pytest.mark.slow
def test_a_gathered_module_gathers_only_its_sequence_inputs_not_a_vector_as_wide_as_the_sequence():
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = _CondDecoder(nnx.Rngs(0))
    batches = _batches(2)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(m, b):
        return _xent(m(b["tokens"]), b)

    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), OPT)
    table, comm = _run(model, loss_fn, None, mesh, batches, ref_losses, ref.params)
    # read from the program (the step traced at another length): the hidden states follow the sequence, the
    # [4, 16] conditioning vector keeps its width
    (rec,) = comm["attention"]
    assert (rec["call"], rec["gathered"], rec["cut"]) == ("attn", [((4, T, T), "float32")], [((4, T, T), "float32")])
    assert f"attention 'attn': gather sequence over cp=2 (in [4, {T}, {T}] float32; its output" in table


class _Inline(nn.Module):
    """Attention written inline in the model's own __call__: no submodule takes the sequence."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, 16)(tokens)
        s = jnp.einsum("bqd,bkd->bqk", x, x)
        return nn.Dense(V)(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), x))


def test_attention_outside_any_submodule_is_refused_naming_the_fix():
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model, batch = _Inline(), _batches(1)[0]
    params = model.init(jax.random.key(0), batch["tokens"])["params"]

    def loss_fn(p, b):
        return _xent(model.apply({"params": p}, b["tokens"]), b)

    state = init_train_state(model, OPT, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, OPT, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape(f"attention scores [.., {T}, {T}] of its own einsum) outside any "
                                                   "submodule taking the [batch, seq, ...] sequence")
                       + ".*" + re.escape("Compute the attention in a submodule called on the hidden states")):
        step(state, batch)


class _SdpaDecoder(nnx.Module):
    """A user's nnx decoder calling nnx.dot_product_attention with a causal mask array (intercepted: the
    all-gather of K/V)."""

    def __init__(self, rngs, d=16, heads=2):  # a width equal to the sequence's 16: its projections are no scores
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.qkv = nnx.LinearGeneral(d, (3, heads, d // heads), rngs=rngs)
        self.out = nnx.LinearGeneral((heads, d // heads), d, axis=(-2, -1), rngs=rngs)
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        qkv = self.qkv(x)
        mask = nnx.make_causal_mask(tokens)
        y = nnx.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=mask)
        return self.head(x + self.out(y))


@pytest.mark.slow
def test_an_nnx_decoder_calling_nnx_dot_product_attention_under_cp():
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _SdpaDecoder(nnx.Rngs(0))
    batches = _batches()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(m, b):
        return _xent(m(b["tokens"]), b)

    ref_losses, ref = train_one_device(params, batches, lambda p, b: loss_fn(nnx.merge(graphdef, p), b), OPT)
    # nnx.make_causal_mask(tokens) builds each device's rows where it stands (left to GSPMD, its broadcast arange is
    # cut like the tokens and gathered over cp for the keys: one all-gather the table would not count)
    table, comm = _run(model, loss_fn, None, mesh, batches, ref_losses, ref.params)
    assert [(r["call"], r["method"]) for r in comm["attention"]] == [("flax dot_product_attention", "all-gather K/V")]
    assert "flax dot_product_attention: all-gather K/V over cp=2" in table


class _BadKeyword(_SdpaDecoder):
    def __call__(self, tokens):
        qkv = self.qkv(self.embed(tokens))
        return nnx.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)


def test_an_attention_keyword_flax_does_not_take_is_named_under_cp():
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = _BadKeyword(nnx.Rngs(0))
    batch = _batches(1)[0]
    state = init_train_state(model, OPT, mesh=mesh)
    step = make_train_step(model, lambda m, b: _xent(m(b["tokens"]), b), OPT, mesh=mesh)
    with pytest.raises(TypeError, match=re.escape("flax dot_product_attention under cp=2 (intercepted to run across "
                                                  "the sequence cut): keyword argument causal=True is not one of "
                                                  "flax.nnx.nn.attention.dot_product_attention's (")
                       + ".*" + re.escape("pass only those (or leave it out).")):
        step(state, batch)


@pytest.mark.slow
@pytest.mark.parametrize("names", [("dp", "cp"), ("fsdp", "cp")], ids=["dp2-cp2", "fsdp2-cp2"])
def test_one_row_per_device_keeps_the_biases_gradients_reduced_over_cp(names):
    """models.Transformer at a global batch of 2 over 2 data ranks: one row per device. A dense layer's bias on the
    sequence, broadcast ``[1, 1, d] -> [1, T, d]`` there, was read as a ``[batch, d]`` side vector joining the
    sequence (``step._heads.side_params`` decided by the size-1 batch dim), so the table dropped the all-reduce over
    cp of 18 parameters' gradients; the side values are now those computed from a batch leaf whole over cp. 3 SGD
    steps equal one device's within 1e-5 and the compiled step's collectives equal the table."""
    from spmd.parallel import fully_shard

    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = Transformer(V, T, 2, 16, 2)
    batches = _batches(b=2)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]

    def loss_fn(p, b):
        return _xent(model.apply({"params": p}, b["tokens"]), b)

    ref_losses, ref = train_one_device(params, batches, loss_fn, OPT)
    laid = fully_shard(model, mesh=mesh["fsdp"], units=["block_*"]) if "fsdp" in names else model
    _, comm = _run(laid, loss_fn, params, mesh, batches, ref_losses, ref.params)
    assert comm["attention"][0]["gathered"] == [((1, T, 16), "float32")]
