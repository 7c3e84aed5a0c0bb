"""Tensor-parallel pipeline stages: ``pipeline(parallelize_module(model, mesh["tp"], plan), mesh["pp"], ...)``.

On ``pp=2, dp=2, tp=2`` with the project's ``models.Transformer`` and its Megatron plan (and the
sequence-parallel one), 20 AdamW steps equal 1-device training within 1e-5 (f32), under 1f1b, gpipe with
accumulation and the interleaved schedule; the compiled step's collectives equal the step's table (the
pipeline's collective-permutes plus the tp terms of every branch the program holds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from models._plans import transformer_tp_plan
from spmd.parallel import (fully_shard, hlo_executed_collectives, init_train_state, make_train_step, parallelize_module, pipeline,
                           unshard_params)
from spmd.parallel.pipelining._comm import hlo_permute_pairs

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1, eps=1e-6))
STEPS = 20
VOCAB, T, D = 32, 8, 16


def _batch(n=32, seed=0):
    tok = np.random.default_rng(seed).integers(0, VOCAB, (n, T + 1))
    return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def _loss(mod):
    def loss_fn(params, batch):
        logits = mod.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


@functools.lru_cache(maxsize=None)
def _model():
    from models import Transformer

    m = Transformer(vocab_size=VOCAB, max_len=T, num_layers=4, d_model=D, num_heads=2, mlp_ratio=2)
    return m, m.init(jax.random.key(1), jnp.zeros((2, T), jnp.int32))["params"]


@functools.lru_cache(maxsize=None)
def _reference():
    m, params = _model()
    batch = _batch()

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(_loss(m))(p, batch)
        u, s = OPT.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    p, s, losses = params, OPT.init(params), []
    for _ in range(STEPS):
        p, s, value = step(p, s)
        losses.append(float(value))
    return losses, p


CONFIGS = {  # name: (sequence parallel, schedule, M, v, accum_steps, the data dim)
    "megatron-1f1b": (False, "1f1b", 2, 1, 1, "dp"),
    "sp-gpipe-accum": (True, "gpipe", 2, 1, 2, "dp"),
    "megatron-interleaved": (False, "interleaved", 2, 2, 1, "dp"),
    "megatron-fsdp-1f1b": (False, "1f1b", 2, 1, 1, "fsdp"),  # the stages cut over fsdp and tp on two dims
}


@functools.lru_cache(maxsize=None)
def _run(config):
    sp, sched, m_count, v, accum, data = CONFIGS[config]
    model, params = _model()
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", data, "tp"))
    tpm = parallelize_module(model, mesh["tp"], transformer_tp_plan(sp))
    if data == "fsdp":
        tpm = fully_shard(tpm, mesh=mesh["fsdp"])
    pm = pipeline(tpm, mesh["pp"], units="block_*", num_microbatches=m_count, schedule=sched, stages_per_rank=v)
    state = init_train_state(pm, OPT, params=params)
    step = make_train_step(pm, _loss(pm), OPT, accum_steps=accum)
    batch = _batch()
    text = step.compiled(state, batch).as_text()
    table = step.communication(state, batch)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return dict(pm=pm, state=state, losses=losses, params=unshard_params(pm, state), text=text, table=table,
                accum=accum)


def _cases():
    return [pytest.param(c, id=c, marks=pytest.mark.xdist_group("pptp-" + c)) for c in CONFIGS]


@pytest.mark.parametrize("config", _cases())
def test_equals_one_device_training(config):
    run = _run(config)
    ref_losses, ref_params = _reference()
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-5, atol=1e-5)
    flat, ref = jax.tree_util.tree_leaves_with_path(run["params"]), jax.tree_util.tree_leaves_with_path(ref_params)
    assert [k for k, _ in flat] == [k for k, _ in ref]
    for (k, a), (_, b) in zip(flat, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=str(k))
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it trained


@pytest.mark.parametrize("config", _cases())
def test_stage_parameters_carry_the_tp_cut(config):
    state = _run(config)["state"]
    plan = state.plan
    mesh = dict(zip(plan.mesh_dim_names, plan.mesh_shape))
    qkv = plan.entry("stages/attn/qkv/kernel")  # (stages, D, 3, H, D/H): heads cut over tp, stages over pp
    assert (str(qkv.placements[0]), str(qkv.placements[2])) == ("S(0)", "S(3)")
    fsdp = CONFIGS[config][-1] == "fsdp"  # fsdp cuts the largest dim tp does not: D
    assert str(qkv.placements[1]) == ("S(1)" if fsdp else "R")
    assert qkv.local_shape == (qkv.shape[0] // mesh["pp"], D // 2 if fsdp else D, 3, 1, D // 2)
    emb = plan.entry("rest/embed/embedding")  # vocabulary-parallel, replicated over pp
    assert (str(emb.placements[0]), str(emb.placements[2])) == ("R", "S(0)")
    arr = state.params["stages"]["attn/qkv/kernel"]
    assert arr.addressable_shards[0].data.shape == qkv.local_shape  # stored as the plan says


@pytest.mark.parametrize("config", _cases())
def test_hlo_collectives_equal_table(config):
    run = _run(config)
    got = hlo_executed_collectives(run["text"], scalars=False)
    want, s = run["table"], run["pm"].schedule
    # the pipeline's own: one collective-permute per tick with sends each way, one pair per micro-batch and
    # boundary (a sequence-parallel activation crosses cut over tp: half the bytes)
    assert got["collective-permute"]["count"] == want["collective-permute"]["count"]
    assert got["collective-permute"]["bytes"] == want["collective-permute"]["bytes"]
    per_pass = s.num_microbatches * (s.num_stages - 1)
    assert hlo_permute_pairs(run["text"], 4) == 2 * per_pass  # 4 pipelines: dp x tp
    cut = want["tp"]["activation_cut"]
    assert cut == (2 if CONFIGS[config][0] else 1)
    assert want["collective-permute"]["bytes"] == want["collective-permute"]["count"] * want["activation_bytes"] // cut
    # the tp terms: every styled call of every branch the program holds, fwd and bwd (see tp_terms); its
    # all-reduces, branch by branch: Megatron, a block: 2 forward (attn.proj, fc_out), 2 backward (the qkv and
    # fc input gradients); the first stage's embedding 1 forward, the last's head input gradient 1; a backward
    # recomputes its stage's forward, whose last fc_out is dead but on the last stage. Sequence parallel: none
    # forward; a block 6 backward (ln1's and ln2's scale and bias, the attn.proj and fc_out biases), the last
    # stage's ln_f 2. The model's 4 blocks over pp=2, M=2 micro-batches.
    def megatron(k):  # F(first), F(mid), B(first), B(mid), B(last) of k blocks a stage
        return 1 + 2 * k, 2 * k, 1 + 2 * k - 1 + 2 * k, 2 * k - 1 + 2 * k, 2 * k + 1 + 2 * k

    f_first, _, b_first, _, b_last = megatron(2)  # 1f1b, gpipe: 2 blocks a stage, rank 0 F/B(first), rank 1 B(last)
    # interleaved: 1 block a stage, rank 0 stages 0 and 2 (first, mid), rank 1 stages 1 and 3 (mid, last); in one
    # tick both ranks run F(mid), in another B(mid): the program holds those branches once
    i_ff, i_fm, i_bf, i_bm, i_bl = megatron(1)
    assert want["tp"]["program"]["all-reduce"]["count"] == {
        "megatron-1f1b": 2 * (f_first + b_first + b_last),
        "megatron-fsdp-1f1b": 2 * (f_first + b_first + b_last),
        "sp-gpipe-accum": 2 * 2 * (2 * 6 + (2 * 6 + 2)),  # accum_steps=2 passes of B(first) and B(last)
        "megatron-interleaved": 2 * (i_ff + i_fm + i_bf + i_bm) + 2 * (i_fm + i_bm + i_bl) - i_fm - i_bm,
    }[config]
    if not CONFIGS[config][0]:  # Megatron: every kind exact
        for kind in ("all-reduce", "all-gather", "reduce-scatter"):
            assert got[kind]["bytes"] == want[kind]["bytes"], kind
        # the tp gathers, plus (fsdp) one gather per stage parameter cut over fsdp, once per step
        assert got["all-gather"]["count"] == want["tp"]["program"]["all-gather"]["count"] + want["all-gather"]["buffers"]
        assert want["all-gather"]["buffers"] == (11 if CONFIGS[config][-1] == "fsdp" else 0)
    else:  # sequence parallel: exact but for the position table's gradient (whole over tp, read on the
        # device's positions in global view): GSPMD reduces its position-cut half over pp x dp and gathers it
        # over tp once per pass, which the table (its whole gradient in the all-reduce) does not model
        pos = 4 * T * D
        assert got["reduce-scatter"]["bytes"] == want["reduce-scatter"]["bytes"]
        assert got["all-reduce"]["bytes"] == want["all-reduce"]["bytes"] - pos // 2
        assert got["all-gather"]["bytes"] == want["all-gather"]["bytes"] + pos * run["accum"]


@pytest.mark.xdist_group("pptp-megatron-1f1b")
def test_table_prints_tp_terms_and_per_rank_work():
    run = _run("megatron-1f1b")
    tp = run["table"]["tp"]
    # 1f1b, pp=2, M=2, two units a stage: rank 0 runs F(first) and B(first) twice, rank 1 B(last) twice; a
    # unit's forward all-reduces 2 (attn.proj, fc_out), its backward 2 (the qkv and fc inputs' gradients);
    # the embedding 1 forward; the tied head: its input's gradient (1), its logits gathered and scattered
    unit_f, unit_b = 2, 2
    f_first = 1 + 2 * unit_f
    b_first = 1 + 2 * unit_f - 1 + 2 * unit_b  # the recomputed chunk's last all-reduce (fc_out) is dead
    b_last = 2 * unit_f + 1 + 2 * unit_b
    assert [t["all-reduce"]["count"] for t in tp["per_rank"]] == [2 * (f_first + b_first), 2 * b_last]
    assert tp["program"]["all-reduce"]["count"] == 2 * (f_first + b_first + b_last)  # pp=2: ranks' branches differ
    assert [t["all-gather"]["count"] for t in tp["per_rank"]] == [0, 2]
    text = make_train_step(run["pm"], _loss(run["pm"]), OPT).table(run["state"], _batch())
    assert "tp in the program: all-reduce x44" in text and "per rank: all-reduce x26 | all-reduce x18" in text



def _sp_1f1b():
    model, params = _model()
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pm = pipeline(parallelize_module(model, mesh["tp"], transformer_tp_plan(True)), mesh["pp"], units="block_*",
                  num_microbatches=2, schedule="1f1b")
    return init_train_state(pm, OPT, params=params), make_train_step(pm, _loss(pm), OPT)


def _half(batch):
    return {k: v[:, :T // 2] for k, v in batch.items()}


def test_table_per_batch_shape_after_a_build_for_another():
    """A step built for sequences of T, then of T/2, gives for T the table a fresh step gives for T alone, and for
    T/2 a fresh step's for T/2 (half the activation): the layout's unit calls are kept per micro-batch shape (it
    held only the last, and the T table failed on a broadcast of (8, 8, 1) with (8, 4, 1))."""
    batch = _batch()
    state, step = _sp_1f1b()
    fresh = step.communication(state, batch)
    state, step = _sp_1f1b()
    fresh_half = step.communication(state, _half(batch))
    state, step = _sp_1f1b()
    step.communication(state, batch)
    assert step.communication(state, _half(batch)) == fresh_half
    assert step.communication(state, batch) == fresh
    assert fresh_half["activation_bytes"] * 2 == fresh["activation_bytes"]


@pytest.mark.slow
def test_step_for_a_batch_shape_compiled_after_a_build_for_another_trains_as_one_device():
    """Built (its table) for T, then for T/2, the step for T compiles on T's unit calls: its first loss is one
    device's."""
    state, step = _sp_1f1b()
    step.communication(state, _batch())
    step.communication(state, _half(_batch()))
    _, metrics = step(state, _batch())
    np.testing.assert_allclose(float(metrics["loss"]), _reference()[0][0], rtol=1e-5)
