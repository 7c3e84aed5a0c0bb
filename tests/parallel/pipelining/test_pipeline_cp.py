"""cp under a pipeline: ``models.Llama`` (``attn_implementation='sdpa'``: ``jax.nn.dot_product_attention``,
causal, GQA) pipelined over its layers (1F1B) with the batch's sequence cut over ``cp``, under pp=2 x cp=2,
pp=2 x fsdp=2 x cp=2 and dp=2 x pp=2 x cp=2, equals 3 SGD steps of one device within 1e-5 (losses and parameters).

A stage runs in a per-rank ``lax.switch`` branch, and XLA:CPU meets every collective-permute of the program over
all its devices in the order each runs them: the stages' attention calls run as the ring (zigzag) all the same,
the branches without a ring (idle, the last stage's forward) running a chunk of their own so that every device
runs the same collective-permutes (``spmd.parallel.pipelining._cp``); the compiled step's collective-permutes
(the pipeline's sends and the rings') and every other kind's buffers and bytes equal the pipeline's table. So with
tp in the stages, and with units of different kinds whose attention calls are alike; where those calls differ
across the stages they stay on the all-gather of K/V, and the plan says why.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from models import Llama, LlamaConfig
from spmd.parallel import (executed_collectives, fully_shard, init_train_state, make_train_step, pipeline,
                           unshard_params)
from tests._one_device import assert_trees_close, train_one_device

T, V = 16, 24
CFG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  attn_implementation="sdpa")


def _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref):
    """``step`` over ``batches`` from ``state``: the losses and the final parameters equal one device's
    (``ref_losses``, ``ref``) within 1e-5; returns the final state."""
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "cp")), ((2, 2, 2), ("pp", "fsdp", "cp")),
                                         ((2, 2, 2), ("dp", "pp", "cp"))],
                         ids=["pp2-cp2", "pp2-fsdp2-cp2", "dp2-pp2-cp2"])
def test_llama_pipelined_under_cp_equals_one_device(shape, names):
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = Llama(CFG)

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)

    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    inner = fully_shard(model, mesh=mesh["fsdp"]) if "fsdp" in names else model
    pm = pipeline(inner, mesh["pp"], units="layers_*", num_microbatches=2)
    assert pm.data_dims == tuple(d for d in names if d in ("dp", "fsdp"))  # cp cuts the sequence, not the batch
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    state = _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)

    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    # every kind's bytes equal to the table: the K/V gathers (forward, and a backward's recompute), the dK / dV
    # reduce-scatters, the stage gradients' all-reduces over cp in each backward, the head's on the last stage,
    # the embedding lookup's gathers of ids and output gradient on the first, the fsdp gathers
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert hlo[kind]["bytes"] == table[kind]["bytes"], kind
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert hlo[kind]["buffers"] == table[kind]["buffers"], kind
    want = table["collective-permute"]
    # 1F1B at pp=2, M=2: 2 sends each way, each a micro-batch's (2 or 1 rows, 16 / cp = 8 positions, 16) float32
    rows = 4 // 2 // (1 if names == ("pp", "cp") else 2)
    sends = 4 * rows * (T // 2) * 16 * 4
    # and the rings of the program's branches. A layer's ring (zigzag) at cp=2: a forward moves K and V one hop
    # and q, k, v in and the output out by one zigzag move each (6 permutes); a backward 14 (the recompute's 6, its
    # one K / V hop shared with the backward's, dK and dV 2 hops each, the 4 zigzag moves' transposes). The ticks'
    # (forward, backward) switches hold {F first, idle}, {F first, F last}: each branch a forward (the idle and
    # the last stage's running a chunk too), 2 x 2 x 6; {idle, B last}, {B first, B last}, {B first, idle}:
    # 3 x 2 x 14. So 24 + 84 = 108, each a local block: K / V [rows, 8, 2, 4] float32 (or halves of q [rows, 8, 4,
    # 4], k / v, out for the zigzag moves), dK / dV float32 alike
    kv = rows * 8 * 2 * 4 * 4
    q = 2 * kv
    fwd, bwd = 2 * kv + (q + kv + kv + q) // 2, 2 * kv + 4 * kv + (q + kv + kv + q)
    assert want["ring"] == {"count": 108, "bytes": 2 * 2 * fwd + 3 * 2 * bwd}
    assert (want["count"], want["bytes"]) == (4 + 108, sends + want["ring"]["bytes"])
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    # the attention calls ran as the ring, zigzag (one record per layer's call in a micro-batch)
    recs = step.attention(state, batches[0])
    assert recs and {r["method"] for r in recs} == {"ring (zigzag)"}
    assert ("jax.nn.dot_product_attention: ring (zigzag) over cp=2 (in a stage's branch: the branches without a ring "
            "run the chunk too)") in step.table(state, batches[0])


@pytest.mark.slow
def test_pp2_cp4_named_dp1_table_equals_hlo():
    """pp=2 x cp=4 with a named dp=1 (8 devices): a size-1 data dim reduces nothing, so the compiled step holds
    no all-reduce over it (the stage gradients' pmean over singleton groups was one more all-reduce of a
    block's 9 gradients, 9,344 B, than the table), and every kind's buffers and bytes equal the table's and
    those of the same step on the mesh without the dp dim."""
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
             "labels": rng.integers(0, V, (4, T)).astype(np.int32)}
    model = Llama(CFG)

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    params = model.init(jax.random.key(0), batch["tokens"])["params"]
    opt = optax.sgd(0.1)
    out = {}
    for shape, names in (((1, 2, 4), ("dp", "pp", "cp")), ((2, 4), ("pp", "cp"))):
        mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
        pm = pipeline(model, mesh["pp"], units="layers_*", num_microbatches=2)
        state = init_train_state(pm, opt, params=params)
        step = make_train_step(pm, loss_fn, opt)
        hlo = executed_collectives(step._build(state, batch).jitted, state, batch, scalars=False)
        out[names] = (hlo, step.communication(state, batch))
    (hlo, table), (ref, _) = out[("dp", "pp", "cp")], out[("pp", "cp")]
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        assert hlo[kind]["bytes"] == table[kind]["bytes"], kind
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (ref[kind]["buffers"], ref[kind]["bytes"]), kind
    for kind in ("all-gather", "reduce-scatter"):
        assert hlo[kind]["buffers"] == table[kind]["buffers"], kind
    assert hlo["collective-permute"]["buffers"] == table["collective-permute"]["count"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_loop_form_under_cp_table_equals_hlo(schedule):
    """The loop form (``unroll=False``) under pp=2 x cp=2, M=4: each tick's send a switch over the direction's
    one pair set and nothing, counted at every tick as the HLO counter counts a loop's body (each trip, each
    branch): 2 x ticks collective-permutes of the pipeline's beside the rings', in the table as in the compiled
    step (the table counted the 2 x M sends that run: 1F1B 8 of 14, GPipe 8 of 18); every kind's buffers and bytes
    equal the table's, and 3 SGD steps equal one device's."""
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = Llama(CFG)

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pm = pipeline(model, mesh["pp"], units="layers_*", num_microbatches=4, schedule=schedule, unroll=False)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"] if kind != "collective-permute"
                                                              else table[kind]["count"], table[kind]["bytes"]), kind
    # pp=2, M=4: 1F1B 7 ticks, GPipe 9 (2 M + pp - 1 = 9; 1F1B's overlap saves 2); each send a micro-batch's
    # activation (1 row, 16 / cp = 8 positions, 16) float32, 512 B
    ticks, one = {"1f1b": 7, "gpipe": 9}[schedule], 1 * 8 * 16 * 4
    want = table["collective-permute"]
    pp_sends = (want["count"] - want["ring"]["count"], want["bytes"] - want["ring"]["bytes"])
    assert pp_sends == (2 * ticks, 2 * ticks * one)
    assert want["sent"] == {"count": 2 * 4, "bytes": 2 * 4 * one}  # what runs: one send a micro-batch each way
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


class _CondBlock(nn.Module):
    """A block taking a per-example vector ``[batch, d]`` beside the hidden states, ``d`` equal to the sequence
    length: no sequence."""

    @nn.compact
    def __call__(self, x, cond):
        x = x + nn.Dense(x.shape[-1])(cond)[:, None, :]
        b, t, d = x.shape
        q, k, v = (nn.Dense(d)(x).reshape(b, t, 2, d // 2) for _ in range(3))
        return x + nn.Dense(d)(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))


class _CondModel(nn.Module):
    @nn.compact
    def __call__(self, tokens, feat, side=None):
        x, cond = nn.Embed(V, 8)(tokens), jnp.sin(feat) if side is None else jnp.concatenate([jnp.sin(feat), side], -1)
        for i in range(2):
            x = _CondBlock(name=f"blocks_{i}")(x, cond)
        return nn.Dense(V)(x)


@pytest.mark.slow
@pytest.mark.parametrize("side", [False, True], ids=["feat", "feat-side"])
def test_a_batch_vector_as_wide_as_the_sequence_stays_whole_over_cp_in_a_pipeline(side):
    """pp=2 x cp=2 with a ``[batch, d]`` batch leaf, ``d`` equal to the sequence length (8): which leaves hold the
    sequence is read from the program (``loss_fn`` traced at fewer positions: this one's dense layer needs its
    width), so it is not cut over cp (it was, by its dim 1: one all-gather of it the table did not count); 2 SGD
    steps equal one device's, and the compiled collectives equal the table's (the all-reduces too: the block's dense
    layer on ``cond`` has its gradients whole over cp and its broadcast's cotangent all-reduced, which the table
    counted as the layer's gradients summed over cp: 47 buffers, 9,760 B, against 43, 8,224 B). With a ``side`` ``[batch, 5]`` leaf too
    (the leaves' dim 1 differs: the sequence is the length the program takes at fewer positions; it was read as
    none, and the attention refused a sequence of 0 positions)."""
    t = 8
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, t)).astype(np.int32),
                "feat": rng.normal(size=(4, t)).astype(np.float32),
                "labels": rng.integers(0, V, (4, t)).astype(np.int32),
                **({"side": rng.normal(size=(4, 5)).astype(np.float32)} if side else {})} for _ in range(2)]
    model = _CondModel()

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"], b["feat"], b.get("side"))
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"], batches[0]["feat"], batches[0].get("side"))["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pm = pipeline(model, mesh["pp"], units="blocks_*", num_microbatches=2)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    # the block's dense layer on cond: its gradients whole over cp (not summed), the [batch, d] cotangent of its
    # broadcast into the sequence all-reduced instead (each B: 9 buffers, 8 + 1, not 10, 1,216 B; 43 / 8,224 B in all
    # with the ring's: the 2 idle backwards beside a B run a block's backward too, 2 x 9 more buffers, 2 x 1,216 B)
    assert (hlo["all-reduce"]["buffers"], hlo["all-reduce"]["bytes"]) == (43 + 2 * 9, 8224 + 2 * 1216)
    state = _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "cp")), ((2, 2, 2), ("pp", "fsdp", "cp")),
                                         ((2, 2, 2), ("dp", "pp", "cp")), ((2, 4), ("pp", "cp"))],
                         ids=["pp2-cp2", "pp2-fsdp2-cp2", "dp2-pp2-cp2", "pp2-cp4"])
def test_einsum_transformer_pipelined_under_cp_table_equals_hlo(shape, names):
    """``models.Transformer`` (its own einsum attention in ``block_*.attn``, a learned position table, a tied head)
    pipelined over its 2 blocks under cp: each unit's ``attn`` runs on the sequence gathered over cp, as in the plain
    step (its input gathered in every forward and recompute, its output's cotangent in every backward; its
    parameters' gradients whole over cp); the position table's gradient is gathered once per step and reduced over
    pp on each device's rows; the tied head's product all-reduced over cp on the last stage. 3 SGD steps equal one
    device's within 1e-5, and every kind's buffers and bytes in the compiled step equal the table's. Before, GSPMD
    partitioned the einsums itself: at pp=2, cp=2 the step all-gathered 17 buffers (29,952 B) against the table's 4
    (4,352 B) and all-reduced 74,368 B against 57,472 B; now 15 (25,856 B) and 40,576 B, both equal."""
    from models import Transformer

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = Transformer(V, T, 2, 16, 2)

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    inner = fully_shard(model, mesh=mesh["fsdp"]) if "fsdp" in names else model
    pm = pipeline(inner, mesh["pp"], units="block_*", num_microbatches=2)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    recs = step.attention(state, batches[0])
    assert {(r["call"], r["method"]) for r in recs} == {("attn", "gather sequence")}
    rows = 4 // 2 // (2 if "fsdp" in names or "dp" in names else 1)  # a micro-batch's rows on a device
    assert all(r["gathered"] == [((rows, T, 16), "float32")] == r["cut"] for r in recs)
    n_cp = dict(zip(names, shape))["cp"]
    assert f"attention 'attn' (a unit's module): gather sequence over cp={n_cp}" in step.table(state, batches[0])
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


class _Block(nn.Module):
    """A causal attention block (``jax.nn.dot_product_attention``); ``squash``: its output through a tanh (the same
    parameters, another kind of unit); ``causal=False``: attending to the whole sequence (another attention call)."""

    squash: bool = False
    causal: bool = True

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (nn.Dense(d)(x).reshape(b, t, 2, d // 2) for _ in range(3))
        y = nn.Dense(d)(jax.nn.dot_product_attention(q, k, v, is_causal=self.causal).reshape(b, t, d))
        return x + (jnp.tanh(y) if self.squash else y)


class _MixedModel(nn.Module):
    causal: bool = True  # the second block's attention

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, 8)(tokens)
        x = _Block(name="blocks_0")(x)
        x = _Block(squash=True, causal=self.causal, name="blocks_1")(x)
        return nn.Dense(V)(x)


def _mixed_step(causal: bool):
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(2)]
    model = _MixedModel(causal=causal)

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pm = pipeline(model, mesh["pp"], units="blocks_*", num_microbatches=2)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    return pm, step, state, batches, ref_losses, ref, hlo, table


@pytest.mark.slow
def test_stages_of_different_kinds_with_alike_attention_run_the_ring():
    """pp=2 x cp=2 over two blocks of different kinds (the second's output through a tanh), each with the same causal
    attention call: each chunk runs a switch over the kinds, each kind's ring with as many collective-permutes
    (``kinds_alike``), so the calls run as the ring; 2 SGD steps equal one device's, and every kind's buffers and
    bytes in the compiled step equal the table's. Before, units of different kinds kept the all-gather of K/V."""
    pm, step, state, batches, ref_losses, ref, hlo, table = _mixed_step(causal=True)
    # each F / B branch holds both kinds' bodies: a body's forward ring (zigzag, cp=2) 6 permutes; its backward 16
    # (14, and the K / V hop of the backward's own switch, which XLA cannot merge with the forward's). 2 ticks x 2
    # forward branches x 2 kinds x 6 + 3 ticks x 2 backward branches x 2 kinds x 16 = 48 + 192; a body's K / V / q
    # [2 rows, 8 positions, 2 heads, 4] float32 (512 B): forward 2 x 512 + 4 halves, backward 4 x 512 + 4 x 512
    # (dK, dV) + 8 halves
    kv = 2 * 8 * 2 * 4 * 4
    assert table["collective-permute"]["ring"] == {"count": 48 + 192, "bytes": 8 * 4 * kv + 12 * 12 * kv}
    assert hlo["collective-permute"]["buffers"] == 4 + 240
    assert {r["method"] for r in step.attention(state, batches[0])} == {"ring (zigzag)"}
    assert ("jax.nn.dot_product_attention: ring (zigzag) over cp=2 (in a stage's branch: the branches without a ring "
            "run the chunk too)") in step.table(state, batches[0])
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


@pytest.mark.slow
def test_stages_of_kinds_with_different_attention_keep_the_all_gather_and_say_why():
    """pp=2 x cp=2 over two blocks whose attention calls differ (the second's not causal: a ring without the zigzag
    moves, fewer collective-permutes): a rank's branches could not run another rank's chunk in its place
    (``ring_blocker``), so the calls stay on the all-gather of K/V, the plan says why, and the compiled step's only
    collective-permutes are the pipeline's 4 sends (as the table); every kind equals the table; 2 SGD steps equal one
    device's."""
    pm, step, state, batches, ref_losses, ref, hlo, table = _mixed_step(causal=False)
    assert table["collective-permute"]["ring"] == {"count": 0, "bytes": 0}
    assert hlo["collective-permute"]["buffers"] == 4
    assert {r["method"] for r in step.attention(state, batches[0])} == {"all-gather K/V"}
    assert ("jax.nn.dot_product_attention: all-gather K/V over cp=2 (a stage's branch: no ring, units of different "
            "kinds across the stages, whose attention calls differ)") in step.table(state, batches[0])
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("gpipe", 1)])
def test_llama_ring_under_other_schedules_equals_one_device(schedule, v):
    """A 4-layer ``models.Llama`` (sdpa, causal) under pp=2 x cp=2 on the interleaved schedule (2 chunks a rank:
    middle stages, a rank's forward beside another's backward) and GPipe: the stages' calls run as the ring, 3 SGD
    steps equal one device's within 1e-5, and every kind's buffers and bytes in the compiled step (the rings'
    collective-permutes among them) equal the table's."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                      attn_implementation="sdpa")
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = Llama(cfg)

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pm = pipeline(model, mesh["pp"], units="layers_*", num_microbatches=2, schedule=schedule, stages_per_rank=v)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    # a tick's switch holds one branch per (direction, role) some rank runs there, each with a layer's ring: 6
    # permutes forward, 14 backward (see test_llama_pipelined_under_cp_equals_one_device). A micro-batch is 2 rows:
    # K / V [2, 8, 2, 4] float32, q twice that
    kv = 2 * 8 * 2 * 4 * 4
    fwd, bwd = 2 * kv + (2 * kv + kv + kv + 2 * kv) // 2, 2 * kv + 4 * kv + (2 * kv + kv + kv + 2 * kv)
    if schedule == "gpipe":
        # GPipe's ticks at pp=2, M=2 are 1F1B's, each stage 2 layers: forward switches {F first, idle}, {F first, F
        # last}; backward {idle, B last}, {B first, B last}, {B first, idle}: 4 forward and 6 backward branches
        f, b = 2 * 2 * 2, 3 * 2 * 2
    else:
        # interleaved, 1 layer a stage (ranks 0: stages 0, 2; 1: stages 1, 3), 9 ticks: forward {F first, idle},
        # {F first, F middle}, {F middle} (both ranks a middle stage: one branch), {F middle, F last}; backward
        # {idle, B last}, {B middle, B last}, {B middle}, {B first, B middle}, {B first, idle}
        f, b = 2 + 2 + 1 + 2, 2 + 2 + 1 + 2 + 2
    assert want["ring"] == {"count": 6 * f + 14 * b, "bytes": f * fwd + b * bwd}
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    assert {r["method"] for r in step.attention(state, batches[0])} == {"ring (zigzag)"}
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("sp,v", [(False, 1), (True, 1), (False, 2)], ids=["megatron", "sp", "megatron-interleaved"])
def test_llama_ring_in_tensor_parallel_stages_equals_one_device(sp, v):
    """pp=2 x cp=2 x tp=2 (``pipeline(parallelize_module(Llama, mesh['tp'], Megatron's plan), mesh['pp'])``, sdpa,
    causal, GQA): the stages' attention calls run as the ring (zigzag), manual over tp too (each device its query head
    pair and its KV head), the branches without a ring running a middle stage's chunk, its tp calls too. 3 SGD steps
    equal one device's within 1e-5, and every kind's buffers and bytes in the compiled step equal the table's. Before,
    tp in the stages kept the all-gather of K/V ("tp in the stages"), and the table counted no cp term under tp.
    ``sp``: with sequence parallelism (``SequenceParallel`` norms, the projections taking and handing on ``Shard(1)``;
    the table's all-gather and reduce-scatter buffers are the non-tp ones, the tp styles' counted apart). ``v=2``: a
    4-layer Llama on the interleaved schedule (2 chunks a rank: middle stages, a rank's forward beside another's
    backward)."""
    from placements import Shard
    from spmd.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (4, T)).astype(np.int32),
                "labels": rng.integers(0, V, (4, T)).astype(np.int32)} for _ in range(3)]
    model = Llama(CFG if v == 1 else LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=4,
                                                 num_heads=4, num_kv_heads=2, attn_implementation="sdpa"))

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, loss_fn, opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "cp", "tp"))
    col, row = (ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))) if sp else \
        (ColwiseParallel(), RowwiseParallel())
    norms = {"layers_*.input_layernorm": SequenceParallel(), "layers_*.post_attention_layernorm": SequenceParallel()}
    plan = {**{f"layers_*.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")},
            "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
            "layers_*.mlp.down_proj": row, **(norms if sp else {})}
    pm = pipeline(parallelize_module(model, mesh["tp"], plan), mesh["pp"], units="layers_*", num_microbatches=2,
                  schedule="1f1b" if v == 1 else "interleaved", stages_per_rank=v)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss_fn, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    assert table["uncounted"] is None  # every collective over cp counted
    tp = table["tp"]["program"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert hlo[kind]["bytes"] == table[kind]["bytes"], kind
        assert hlo[kind]["buffers"] == table[kind]["buffers"] + (tp[kind]["count"] if kind != "all-reduce" else 0), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    # the rings: as at pp=2, cp=2 (108 permutes: 2 x 2 forwards of 6, 3 x 2 backwards of 14), each of a device's
    # heads: K / V [2 rows, 8 positions, 1 KV head, 4] float32, q [2, 8, 2, 4]; the sends [2, 8, 16] float32 (sp: cut
    # over tp too)
    kv, q = 2 * 8 * 1 * 4 * 4, 2 * 8 * 2 * 4 * 4
    fwd, bwd = 2 * kv + (q + kv + kv + q) // 2, 2 * kv + 4 * kv + (q + kv + kv + q)
    if v == 2:  # the interleaved schedule's switches: 7 forward and 9 backward branches with a ring (see
        # test_llama_ring_under_other_schedules_equals_one_device)
        assert want["ring"] == {"count": 6 * 7 + 14 * 9, "bytes": 7 * fwd + 9 * bwd}
    else:
        assert want["ring"] == {"count": 108, "bytes": 2 * 2 * fwd + 3 * 2 * bwd}
        assert (want["count"], want["bytes"]) == (4 + 108, 4 * 2 * 8 * 16 * 4 // (2 if sp else 1)
                                                  + want["ring"]["bytes"])
    if not sp and v == 1:
        # the all-reduces over tp: a unit's forward reduces o_proj's and down_proj's outputs (2), its backward the
        # cotangents of q / k / v's and gate / up's inputs (5), a recompute not on the last stage leaving down_proj's
        # dead (6 in a B); the ticks' switches hold {F first, F middle (idle's shadow)}, {F first, F middle (the
        # last stage's F)}, {B middle (idle's), B last}, {B first, B last}, {B first, B middle (idle's)}: 2 x 4 + 13
        # + 13 + 12 = 46, each a device's positions [2, 8, 16] float32. Over cp: each B's 9 stage gradients (a
        # device's tp block: 4,736 B), 6 B bodies; the last stage's 2 also lm_head's and the norm's (1,600 B); over
        # pp the 3 others (3,136 B)
        assert (hlo["all-reduce"]["buffers"], hlo["all-reduce"]["bytes"]) == (
            46 + 6 * 9 + 2 * 2 + 3, 46 * 2 * 8 * 16 * 4 + 6 * 4736 + 2 * 1600 + 3136)
    recs = step.attention(state, batches[0])
    assert recs and {r["method"] for r in recs} == {"ring (zigzag)"}
    assert ("jax.nn.dot_product_attention: ring (zigzag) over cp=2 (in a stage's branch: the branches without a ring "
            "run the chunk too)") in step.table(state, batches[0])
    _assert_trains_as_one_device(pm, step, state, batches, ref_losses, ref)


@pytest.mark.slow  # ~11 s: the step traced for its table
def test_projections_whole_over_tp_in_the_stages_under_cp_are_said_not_counted():
    """pp=2 x cp=2 x tp=2 with 1 KV head (fewer than tp): the k / v projections run whole over tp
    (``spmd.parallel.step._heads``), and GSPMD makes their outputs whole over cp too, which the table does not count
    (measured: the step all-gathered 62 buffers, 38,144 B, against the table's 24, 9,472 B; it trains as one device).
    The table says so; with 2 KV heads nothing is left out (``test_llama_ring_in_tensor_parallel_stages_...``)."""
    from models._plans import decoder_tp_plan
    from spmd.parallel import parallelize_module

    batch = {"tokens": np.zeros((4, T), np.int32), "labels": np.zeros((4, T), np.int32)}
    model = Llama(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=1, attn_implementation="sdpa"))

    def loss_fn(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "cp", "tp"))
    pm = pipeline(parallelize_module(model, mesh["tp"], decoder_tp_plan(model)), mesh["pp"], units="layers_*",
                  num_microbatches=2)
    state = init_train_state(pm, optax.sgd(0.1), params=model.init(jax.random.key(0), batch["tokens"])["params"])
    step = make_train_step(pm, loss_fn, optax.sgd(0.1))
    said = step.communication(state, batch)["uncounted"]
    assert said.startswith("cp=2 with tp in the stages: the projections run whole over tp (fewer heads than tp: ")
    assert "'layers_0.self_attn.k_proj'" in said and said.endswith(
        "are partitioned over 'cp' by GSPMD, their gathers and reductions over cp not in this table")
