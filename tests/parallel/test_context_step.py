"""cp as a mesh dim of the train step: the batch's sequence cut over ``cp``, attention across the cut.

``models.Llama`` (``attn_implementation='sdpa'``: ``jax.nn.dot_product_attention``, causal, GQA) trained under
cp=2, cp=4, dp=2 x cp=4 and fsdp=2 x cp=4 equals 3 SGD steps of one device within 1e-5, the compiled step's collectives
equal to the step's table (the ring's permutes and the zigzag moves, the embedding's gathers, the gradients'
all-reduces); flax's ``dot_product_attention`` with a mask array runs as the all-gather of K/V; the zigzag
moves the step makes give every rank the same causal work (counted from the moved positions, against the
plain cut's); a model's own einsum attention runs on the sequence gathered over cp.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from models import Llama, LlamaConfig
from spmd.parallel import (executed_collectives, init_train_state, make_train_step, unshard_params,
                           zigzag_permutation)
from spmd.parallel.context._calls import from_zigzag, to_zigzag
from tests._one_device import assert_trees_close, train_one_device

T, V = 32, 24  # sequence, vocabulary (apart, so no [.., T, T] product is a logit)
CFG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  attn_implementation="sdpa")


def _batches(n=3, b=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, V, (b, T)).astype(np.int32),
             "labels": rng.integers(0, V, (b, T)).astype(np.int32)} for _ in range(n)]


def _lm_loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


def _train(model, mesh, batches, opt=optax.sgd(0.1)):
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    loss_fn = _lm_loss(model)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    kw = {} if mesh is None else {"mesh": mesh}  # None: the model's own (parallelize_module's)
    state = init_train_state(model, opt, params=params, **kw)
    step = make_train_step(model, loss_fn, opt, **kw)
    table = step.table(state, batches[0])
    comm = step.communication(state, batches[0])
    hlo = executed_collectives(step._build(state.plan).jitted, state, batches[0], scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)
    return table, comm, hlo


def _assert_table_is_hlo(comm, hlo):
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        want = comm["total"].get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), kind
    assert hlo["all-to-all"]["count"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2,), ("cp",)), ((4,), ("cp",)), ((2, 4), ("dp", "cp")),
                                         ((2, 4), ("fsdp", "cp"))],
                         ids=["cp2", "cp4", "dp2-cp4", "fsdp2-cp4"])
def test_llama_under_cp_equals_one_device(shape, names):
    from spmd.parallel import fully_shard

    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = Llama(CFG)
    if "fsdp" in names:  # re-gathering each layer for its backward pass: the zigzag moves are kept, not redone
        model = fully_shard(model, mesh=mesh["fsdp"], units=["layers_*"])
    table, comm, hlo = _train(model, mesh, _batches())
    n = dict(zip(names, shape))["cp"]
    assert table.count("jax.nn.dot_product_attention: ring (zigzag) over cp=") == CFG.num_layers
    # the ring: per layer, K and V make n - 1 hops forward and backward, dK and dV n hops (float32); the zigzag
    # moves q, k, v and the output in two halves each, forward and backward
    b = 4 // (shape[0] if len(shape) == 2 else 1)
    kv = b * (T // n) * CFG.num_kv_heads * (CFG.hidden_size // CFG.num_heads) * 4
    q = kv * CFG.num_heads // CFG.num_kv_heads
    moves = 1 if n == 2 else 2  # at cp=2 the even chunks stay home
    back = 0 if n == 2 else 2 * (n - 1) * kv  # at cp=2 the backward reuses the forward's hop
    per_layer = 2 * (n - 1) * kv + back + 2 * n * kv + moves * (q + kv + kv + q)
    assert comm["context"]["collective-permute"]["bytes"] == CFG.num_layers * per_layer
    _assert_table_is_hlo(comm, hlo)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names,sp", [((2, 2), ("cp", "tp"), False), ((2, 2, 2), ("dp", "cp", "tp"), False),
                                            ((2, 2), ("cp", "tp"), True), ((2, 2, 2), ("dp", "cp", "tp"), True)],
                         ids=["cp2-tp2", "dp2-cp2-tp2", "cp2-tp2-sp", "dp2-cp2-tp2-sp"])
def test_llama_under_cp_and_tp_equals_one_device(shape, names, sp):
    """Megatron's plan on tp beside cp: each device attends with its heads (the ring's region manual over tp
    too), the tp styles' activations hold its positions (1 / cp of their bytes), the gradients' all-reduce over
    cp is of each device's tp block. ``sp``: with sequence parallelism (``SequenceParallel`` norms, the
    projections taking and handing on ``Shard(1)``): the styles' regions manual over cp too, each device's
    (cp, tp) block of the sequence, their gathers and reduce-scatters over tp of its cp block (T / cp)."""
    from placements import Shard
    from spmd.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    col, row = (ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))) if sp else \
        (ColwiseParallel(), RowwiseParallel())
    norms = {"layers_*.input_layernorm": SequenceParallel(), "layers_*.post_attention_layernorm": SequenceParallel()}
    model = parallelize_module(Llama(CFG), mesh["tp"], {
        "layers_*.self_attn.q_proj": col, "layers_*.self_attn.k_proj": col, "layers_*.self_attn.v_proj": col,
        "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
        "layers_*.mlp.down_proj": row, **(norms if sp else {})})
    table, comm, hlo = _train(model, None, _batches())
    assert table.count("ring (zigzag) over cp=2") == CFG.num_layers
    b = 4 // (shape[0] if len(shape) == 3 else 1)
    kv = b * (T // 2) * (CFG.num_kv_heads // 2) * (CFG.hidden_size // CFG.num_heads) * 4  # K of one device
    q = kv * CFG.num_heads // CFG.num_kv_heads
    # per layer at cp=2: K and V one hop forward, dK and dV two (float32), the zigzag moves of q, k, v, out once
    # forward and once backward, each of half the local block
    assert comm["context"]["collective-permute"]["bytes"] == CFG.num_layers * (2 * kv + 4 * kv + (q + kv + kv + q))
    if sp:  # per layer: the norms' outputs gathered over tp forward (once for q, k, v; once for gate, up), the
        # o_proj and down_proj outputs' cotangents backward (their reduce-scatters' transposes): [b, T / cp, d] each
        act = b * (T // 2) * CFG.hidden_size * 4
        assert comm["activations"]["all-gather"] == {"count": 4 * CFG.num_layers, "bytes": 4 * CFG.num_layers * act}
    _assert_table_is_hlo(comm, hlo)


def _llama_with_head(shape, names, **head):
    """``models.Llama`` with Megatron's plan on tp and a column-parallel output head (torchtitan's ``lm_head``):
    the logits cut over tp on the vocabulary (``Shard(-1)``), handed to the loss so."""
    from models._plans import decoder_tp_plan
    from spmd.parallel import ColwiseParallel, parallelize_module

    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = decoder_tp_plan(Llama(CFG))
    plan["lm_head"] = ColwiseParallel(**head)
    return parallelize_module(Llama(CFG), mesh["tp"], plan)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2, 2), ("dp", "cp", "tp")), ((4, 2), ("cp", "tp")),
                                         ((2, 4), ("dp", "tp"))], ids=["dp2-cp2-tp2", "cp4-tp2", "dp2-tp4"])
def test_llama_column_parallel_head_equals_one_device(shape, names):
    """A column-parallel ``lm_head`` beside cp and tp (issue 48: at dp=2,cp=2,tp=2 XLA aborted the process while
    partitioning the loss's ``take_along_axis`` of the labels' logits, cut over tp on the vocabulary and over cp on
    the sequence; the step now runs it as a masked sum): 3 SGD steps equal one device's within 1e-5, and the
    compiled step's collectives equal the table, which counts the loss's three all-reduces over tp (the
    log-sum-exp's max and sum, the label logit), one float32 per position of the device's rows."""
    dims = dict(zip(names, shape))
    table, comm, hlo = _train(_llama_with_head(shape, names), None, _batches())
    rows = 4 // dims.get("dp", 1) * T // dims.get("cp", 1)  # the positions of one device's rows
    assert comm["vocab"]["all-reduce"] == {"count": 3, "bytes": 3 * rows * 4}
    assert table.count("loss over lm_head's output cut on its features") == 3
    _assert_table_is_hlo(comm, hlo)


@pytest.mark.slow
def test_llama_with_fewer_kv_heads_than_tp_under_cp_equals_one_device():
    """2 KV heads at cp=2 x tp=4 (Megatron's plan and a column-parallel head): the k / v projections run whole over
    tp (``spmd.parallel.step._heads``) and the ring attends, manual over tp too, with each device's query head and
    the K / V head it uses (repeated to one per device). Before, the ring ran over every head with tp left to
    GSPMD, the projections' outputs were gathered over cp (their ``Replicate()`` constraint spanned cp too), and
    their kernels' gradients were summed over cp whole: HLO 14 all-gathers / 59 all-reduces against the table's 8 /
    35. 3 SGD steps equal one device's within 1e-5, and the compiled step's collectives equal the table."""
    table, comm, hlo = _train(_llama_with_head((2, 4), ("cp", "tp")), None, _batches())
    assert table.count("ring (zigzag) over cp=2") == CFG.num_layers
    hd = CFG.hidden_size // CFG.num_heads
    kv = 4 * (T // 2) * 1 * hd * 4  # the one K head of a device's positions
    q = kv  # one query head per device
    # per layer at cp=2: K and V one hop forward, dK and dV two (float32), the zigzag moves of q, k, v, out once
    # forward and once backward, each of half the local block
    assert comm["context"]["collective-permute"]["bytes"] == CFG.num_layers * (2 * kv + 4 * kv + (q + kv + kv + q))
    # per layer: the k / v kernels gathered over tp (whole), their outputs' gradients summed within each pair of
    # devices sharing a head ([4, T / cp, 1, hd]), then gathered across the pairs ([4, T / cp, 2, hd])
    k_kernel = CFG.hidden_size * CFG.num_kv_heads * hd * 4
    kv_out = 4 * (T // 2) * CFG.num_kv_heads * hd * 4
    assert comm["activations"]["all-gather"]["bytes"] == CFG.num_layers * 2 * (k_kernel + kv_out)
    _assert_table_is_hlo(comm, hlo)


@pytest.mark.slow
def test_llama_with_fewer_kv_heads_than_tp_under_cp_and_sequence_parallelism_equals_one_device():
    """2 KV heads at cp=2 x tp=4 with sequence parallelism (``SequenceParallel`` norms, the projections taking and
    handing on ``Shard(1)``: each device's (cp, tp) block of the sequence between them), a 2-layer Llama trained
    3 SGD steps: equal to one device's within 1e-5 (losses and parameters), the ring attending per device with its
    query head and the K / V head it uses, the compiled step's collectives equal to the table."""
    from placements import Shard
    from spmd.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("cp", "tp"))
    col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    model = parallelize_module(Llama(CFG), mesh["tp"], {
        "layers_*.input_layernorm": SequenceParallel(), "layers_*.post_attention_layernorm": SequenceParallel(),
        "layers_*.self_attn.q_proj": col, "layers_*.self_attn.k_proj": col, "layers_*.self_attn.v_proj": col,
        "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
        "layers_*.mlp.down_proj": row})
    assert CFG.num_kv_heads < 4 and CFG.num_layers == 2
    table, comm, hlo = _train(model, None, _batches())
    assert table.count("ring (zigzag) over cp=2") == CFG.num_layers
    hd = CFG.hidden_size // CFG.num_heads
    kv = 4 * (T // 2) * 1 * hd * 4  # the one K head of a device's positions
    q = kv  # one query head per device
    # per layer at cp=2: K and V one hop forward, dK and dV two (float32), the zigzag moves of q, k, v, out once
    # forward and once backward, each of half the local block
    assert comm["context"]["collective-permute"]["bytes"] == CFG.num_layers * (2 * kv + 4 * kv + (q + kv + kv + q))
    _assert_table_is_hlo(comm, hlo)


def test_a_gather_of_a_column_parallel_head_under_cp_is_refused_before_xla():
    """A loss that indexes the vocabulary-cut logits with a gather the step does not rewrite (``mode="clip"``)
    on dp x cp x tp is refused with the fixes, before XLA (whose partitioner would abort the process)."""
    model = _llama_with_head((2, 2, 2), ("dp", "cp", "tp"))
    batch = _batches(1)[0]
    params = Llama(CFG).init(jax.random.key(0), batch["tokens"])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        picked = jnp.take_along_axis(logits, b["labels"][..., None], axis=-1, mode="clip")
        return (jax.nn.logsumexp(logits, -1) - picked[..., 0]).mean()

    opt = optax.sgd(0.1)
    state = init_train_state(model, opt, params=params)
    step = make_train_step(model, loss_fn, opt)
    with pytest.raises(ValueError, match=re.escape(
            "the loss indexes 'lm_head''s output, cut over tp on its features (ColwiseParallel's Shard(-1)), with a "
            "gather on mesh dp=2,cp=2,tp=2")) as e:
        step(state, batch)
    assert "jnp.take_along_axis(logits, labels[..., None], axis=-1)" in str(e.value)
    assert "ColwiseParallel(output_layouts=Replicate())" in str(e.value)


def test_masked_take_along_axis_equals_the_gather():
    """The step's masked sum (``spmd.parallel.context._take``) against ``jnp.take_along_axis`` itself: values
    (negative labels wrapped, out-of-bounds ones NaN) and gradients; other forms run the original."""
    from spmd.parallel.context._take import masked_take_along_axis

    take = masked_take_along_axis(jnp.take_along_axis)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
    idx = jnp.asarray(rng.integers(-7, 7, (3, 5, 1)), jnp.int32)
    np.testing.assert_array_equal(take(x, idx, -1), jnp.take_along_axis(x, idx, -1))
    bad = idx.at[0, 0, 0].set(7).at[1, 2, 0].set(-8)
    np.testing.assert_array_equal(take(x, bad, -1), jnp.take_along_axis(x, bad, -1))  # NaN where out of bounds
    assert np.isnan(np.asarray(take(x, bad, -1))[0, 0, 0])
    w = jnp.asarray(rng.normal(size=(3, 5, 1)), jnp.float32)
    np.testing.assert_array_equal(jax.grad(lambda x: (take(x, idx, -1) * w).sum())(x),
                                  jax.grad(lambda x: (jnp.take_along_axis(x, idx, -1) * w).sum())(x))
    wide = jnp.asarray(rng.integers(0, 7, (3, 5, 2)), jnp.int32)  # two per position: the original's gather
    np.testing.assert_array_equal(take(x, wide, -1), jnp.take_along_axis(x, wide, -1))


class _FlaxMasked(nn.Module):
    """A decoder block calling flax's dot_product_attention with a mask array."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, 16)(tokens)
        q, k, v = (nn.DenseGeneral((2, 8), name=n)(x) for n in ("q", "k", "v"))
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
        y = nn.dot_product_attention(q, k, v, mask=mask)
        return nn.Dense(V)(nn.DenseGeneral(16, axis=(-2, -1))(y) + x)


@pytest.mark.slow
def test_flax_masked_attention_gathers_kv():
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    batches = _batches(2)
    table, comm, hlo = _train(_FlaxMasked(), mesh, batches)
    assert "flax dot_product_attention: all-gather K/V over cp=2" in table
    kv = 2 * T * 2 * 8 * 4  # the gathered K (or V) of the device's 2 rows
    assert comm["context"]["reduce-scatter"] == {"count": 2, "bytes": 2 * kv}
    _assert_table_is_hlo(comm, hlo)


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_moves_balance_causal_work(n):
    """The step's zigzag moves (``to_zigzag``) put each rank's tokens where ``zigzag_permutation`` says; the causal
    (query, key) pairs per rank, counted from the moved positions, are equal (max / mean 1.0), against the
    plain cut's imbalance; ``from_zigzag`` moves them back."""
    mesh = spmd.init_device_mesh("cpu", (n,), mesh_dim_names=("cp",)).jax_mesh
    seq = 8 * n
    pos = jnp.arange(seq, dtype=jnp.int32)[None, :, None]

    def f(x):
        z = to_zigzag(x, "cp", n)
        return z, from_zigzag(z, "cp", n)

    z, back = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "cp"), out_specs=(P(None, "cp"), P(None, "cp")),
                                    check_vma=False))(pos)
    np.testing.assert_array_equal(np.asarray(z)[0, :, 0], zigzag_permutation(seq, n))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(pos))

    def work(order):  # the causal pairs each rank's queries keep: a query at position p sees p + 1 keys
        return np.array([(blk + 1).sum() for blk in np.split(np.asarray(order), n)])

    zig, plain = work(np.asarray(z)[0, :, 0]), work(np.arange(seq))
    assert zig.max() / zig.mean() == 1.0
    t = seq // n  # the plain cut's last rank: its t queries see (n - 1) t earlier keys and their own causal block
    assert plain.max() / plain.mean() == pytest.approx((t * (n - 1) * t + t * (t + 1) / 2) / (seq * (seq + 1) / 2 / n))
    assert plain.max() / plain.mean() > 1.4


def test_einsum_attention_under_cp_runs_on_the_gathered_sequence():
    """models.Llama's own einsum attention ("eager"): each layer's attention module runs on the sequence gathered
    over cp (tests/parallel/test_context_gather.py trains such models against one device)."""
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = Llama(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=2))  # the einsum attention ("eager")
    batch = _batches(1)[0]
    params = model.init(jax.random.key(0), batch["tokens"])["params"]
    opt = optax.sgd(0.1)
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, _lm_loss(model), opt, mesh=mesh)
    records = step.communication(state, batch)["attention"]
    assert [(r["method"], r["gathered"]) for r in records] == [("gather sequence", [((4, T, 16), "float32")])]
    assert "gather sequence over cp=2" in step.table(state, batch)


def test_sequence_not_divisible_by_cp_is_refused():
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    model = Llama(CFG)
    batch = {k: v[:, :30] for k, v in _batches(1)[0].items()}
    params = model.init(jax.random.key(0), batch["tokens"])["params"]
    opt = optax.sgd(0.1)
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, _lm_loss(model), opt, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape("the batch's sequence has 30 positions, not divisible by cp=4")):
        step(state, batch)


def test_cp_in_fully_shard_is_refused():
    from spmd.parallel import fully_shard

    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "cp"))
    with pytest.raises(ValueError, match=re.escape("mesh dim 'cp' cuts the batch's sequence")):
        fully_shard(Llama(CFG), mesh=mesh["fsdp", "cp"], units=["layers_*"])


class _CondModel(nn.Module):
    """A causal attention block conditioned on per-example vectors beside the tokens: ``feat`` ``[batch, T]`` (its
    width equal to the sequence length) and, given, ``side`` ``[batch, 5]``, both into a dense layer: no sequence."""

    @nn.compact
    def __call__(self, tokens, feat, side=None):
        cond = jnp.sin(feat) if side is None else jnp.concatenate([jnp.sin(feat), side], -1)
        x = nn.Embed(V, 8)(tokens)
        x = x + nn.Dense(8)(cond)[:, None, :]
        b, t, d = x.shape
        q, k, v = (nn.Dense(d)(x).reshape(b, t, 2, d // 2) for _ in range(3))
        x = x + nn.Dense(d)(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        return nn.Dense(V)(x)


def _cond_loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"], b["feat"], b.get("side"))
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


@pytest.mark.slow
@pytest.mark.parametrize("side", [False, True], ids=["feat", "feat-side"])
def test_batch_vectors_beside_the_sequence_stay_whole_over_cp(side):
    """dp=2 x cp=2 with ``[batch, d]`` batch leaves into a dense layer: ``feat`` with ``d`` equal to the sequence
    length (it was cut over cp by its dim 1: an all-gather of it the table does not count) and ``side`` of another
    width (it was refused: the leaves' dim 1 differs). Which leaves hold the sequence is read from the program
    (``loss_fn`` traced with them at fewer positions), so both stay whole over cp; 2 SGD steps equal one device's
    and the compiled step's collectives equal the table."""
    t = 8
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, t)).astype(np.int32), "feat": rng.normal(size=(4, t)).astype(
        np.float32), "labels": rng.integers(0, V, (4, t)).astype(np.int32),
        **({"side": rng.normal(size=(4, 5)).astype(np.float32)} if side else {})} for _ in range(2)]
    model, opt = _CondModel(), optax.sgd(0.1)
    loss_fn = _cond_loss(model)
    params = model.init(jax.random.key(0), batches[0]["tokens"], batches[0]["feat"], batches[0].get("side"))["params"]
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh)
    comm = step.communication(state, batches[0])
    hlo = executed_collectives(step._build(state.plan).jitted, state, batches[0], scalars=False)
    _assert_table_is_hlo(comm, hlo)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)


def test_a_batch_leaf_the_program_reads_at_any_length_beside_the_sequence_is_refused_by_its_path():
    """Leaves whose dim 1 differs, and ``loss_fn`` runs with either length's leaves at fewer positions (a ``[B, 1,
    T]`` mask only summed, a weight): which is the sequence is ambiguous, refused naming the leaves before anything
    is compiled."""
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = Llama(CFG)
    batch = {"weights": np.ones((4, 6), np.float32), **_batches(1)[0]}
    params = model.init(jax.random.key(0), batch["tokens"])["params"]
    opt = optax.sgd(0.1)

    def loss_fn(p, b):
        return _lm_loss(model)(p, b) * b["weights"].mean()

    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape(
            f"train_step: a mesh with cp=2 cuts the batch's sequence (dim 1 of the leaves the program reads as the "
            f"sequence), and the batch leaves' dim 1 differs: batch['labels'] (4, {T}), batch['tokens'] (4, {T}), "
            f"batch['weights'] (4, 6); loss_fn, traced with the leaves of each length at 2 fewer positions, runs at "
            f"each of 6 and {T}, so which leaves hold the sequence is ambiguous")):
        step(state, batch)


@pytest.mark.parametrize("rows", [1, 4])
def test_side_parameters_are_those_computed_from_a_batch_vector_at_any_batch_size(rows):
    """``step._heads.side_params`` on the gradient's program of ``_CondModel``: the side parameters are the dense
    layer's on the ``[batch, d]`` vectors (``Dense_0``, by the model's construction), joining the sequence once
    (its ``[rows, 1, 8]`` float32 output broadcast into the hidden states). At one row (``rows=1``) the biases of the
    layers on the sequence, broadcast ``[1, 1, d] -> [1, T, d]``, were read as side values too: decided from a
    size-1 batch dim, not from what the value is computed from."""
    from spmd.parallel.step._heads import side_params

    t, rng = 8, np.random.default_rng(0)
    b = {"feat": rng.normal(size=(rows, t)).astype(np.float32), "labels": np.zeros((rows, t), np.int32),
         "side": rng.normal(size=(rows, 5)).astype(np.float32), "tokens": np.zeros((rows, t), np.int32)}
    model = _CondModel()
    params = model.init(jax.random.key(0), b["tokens"], b["feat"], b["side"])["params"]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    jaxpr = jax.make_jaxpr(jax.grad(_cond_loss(model)))(params, b).jaxpr
    n = len(paths)
    feat, labels, side, tokens = jaxpr.invars[n:]  # the batch's leaves, in its dict's (sorted) order
    found, joins = side_params(jaxpr, jaxpr.invars[:n], [labels, tokens], t, [feat, side])
    assert sorted(paths[i] for i in found) == ["['Dense_0']['bias']", "['Dense_0']['kernel']"]
    assert joins == [rows * 8 * 4]
