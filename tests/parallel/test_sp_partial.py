"""A sequence-parallel plan that covers the blocks alone (``layers_*``: ``SequenceParallel`` norms, column- and
row-parallel projections with sequence layouts), the embedding, final norm and head left out: those modules run
whole over tp (``TPCalls.run_whole``) and the step's table equals the compiled step's collectives.

Left to GSPMD, the sequence cut ran on through the final norm and the head (their weight gradients summed over
tp: an all-reduce of the head's ``V x D`` kernel and of the norm's weight) and back into the embedding's lookup
(its ids and its output's gradient gathered in the backward pass), none of it in the table: Llama d16, V 24,
8 sequences of 8 on fsdp=2 x tp=2 compiled 45 all-gathers / 40,640 B and 6 all-reduce buffers / 1,856 B where
the table said 43 / 38,464 B and 4 / 256 B. Now the blocks' output is all-gathered before the final norm
(forward) and the embedding's output gradient after the first block (backward): one ``[rows, 8, 16]`` float32
activation each.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import spmd
from spmd import Shard
from spmd.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, activation_checkpointing,
                           fully_shard, hlo_executed_collectives, init_train_state, make_train_step,
                           parallelize_module, unshard_params)
from tests._one_device import assert_trees_close, train_one_device

LLAMA = dict(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
BATCH, SEQ, STEPS = 8, 8, 2
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _blocks_plan() -> dict:
    """torchtitan's sequence-parallel plan of the blocks alone: no ``embed_tokens``, ``norm`` or ``lm_head``."""
    col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    return {f"layers_*.self_attn.{p}_proj": col for p in "qkv"} | {
        "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
        "layers_*.mlp.down_proj": row, "layers_*.input_layernorm": SequenceParallel(),
        "layers_*.post_attention_layernorm": SequenceParallel()}


@functools.lru_cache(maxsize=None)
def _setup():
    from models import Llama, LlamaConfig

    net = Llama(LlamaConfig(**LLAMA))
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 24, (BATCH, SEQ)).astype(np.int32),
                "labels": rng.integers(0, 24, (BATCH, SEQ)).astype(np.int32)} for _ in range(STEPS)]
    params = net.init(jax.random.key(0), batches[0]["tokens"])["params"]

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    ref_losses, ref = train_one_device(params, batches, loss, optax.sgd(0.1))
    return net, batches, params, loss, ref_losses, ref


def _model(net, case: str):
    """``case``: ``dp4-tp2`` (no fsdp), ``dp2-fsdp2-tp2`` (re-gathering units), ``...-keep`` (kept), ``...-dots``
    (re-gathering, "dots" checkpointing)."""
    if case == "dp4-tp2":
        mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        return parallelize_module(net, mesh["tp"], _blocks_plan())
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    m = parallelize_module(net, mesh["tp"], _blocks_plan())
    if case.endswith("-dots"):
        m = activation_checkpointing(m, units=["layers_*"], policy="dots")
    return fully_shard(m, mesh=mesh["dp", "fsdp"], units=["layers_*"], reshard_after_forward=not case.endswith("-keep"))


@pytest.mark.parametrize("case", ["dp4-tp2", pytest.param("dp2-fsdp2-tp2", marks=pytest.mark.slow), pytest.param("dp2-fsdp2-tp2-keep", marks=pytest.mark.slow), pytest.param("dp2-fsdp2-tp2-dots", marks=pytest.mark.slow)])
def test_blocks_only_sp_plan_table_is_the_hlo_and_trains_as_one_device(case):
    """2 SGD steps equal one device's within 1e-5; the table's collectives (buffers and bytes per kind) are the
    compiled step's; its activation terms hold the two boundary gathers (one activation each, ``A``) and no
    all-reduce but the 4 ``SequenceParallel`` norms' weight gradients (16 float32 each)."""
    net, batches, params, loss, ref_losses, ref = _setup()
    model = _model(net, case)
    opt = optax.sgd(0.1)
    state = init_train_state(model, opt, params=params)
    step = make_train_step(model, loss, opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.lower(state, batches[0]).compile().as_text(), scalars=False)
    for kind in KINDS:
        want = comm["total"].get(kind, {"count": 0, "bytes": 0})
        got = hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]
        assert got == (want["count"], want["bytes"]), (kind, hlo[kind], want)
    rows = BATCH // 4  # the batch over the data dims: dp=4, or dp=2 x fsdp=2
    act = rows * SEQ * LLAMA["hidden_size"] * 4
    boundary = [r for r in comm["modules"] if r["style"] == "whole outside the plan"
                or (r["module"] == "layers_0.input_layernorm" and not r["region"])]
    assert [(r["module"], r.get("gathered_input", False), r["in_bytes"] or r["out_bytes"]) for r in boundary] == [
        ("layers_0.input_layernorm", False, act), ("norm", True, act)], boundary
    norms = 2 * LLAMA["num_layers"]
    assert comm["activations"]["all-reduce"] == {"count": norms, "bytes": norms * LLAMA["hidden_size"] * 4}
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)


def _scanned_plan() -> dict:
    """``_blocks_plan`` for the blocks as one ``nn.scan`` stack, ``layers``."""
    return {k.replace("layers_*", "layers"): v for k, v in _blocks_plan().items()}


@functools.lru_cache(maxsize=None)
def _scanned_setup():
    from models import Llama, LlamaConfig

    net = Llama(LlamaConfig(**LLAMA, scan_layers=True))
    _, batches, _, _, _, _ = _setup()
    params = net.init(jax.random.key(0), batches[0]["tokens"])["params"]

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, b["tokens"]),
                                                               b["labels"]).mean()

    ref_losses, ref = train_one_device(params, batches, loss, optax.sgd(0.1))
    return net, batches, params, loss, ref_losses, ref


@pytest.mark.parametrize("case", [pytest.param("dp4-tp2", marks=pytest.mark.slow), "dp2-fsdp2-tp2"])
def test_blocks_only_sp_plan_on_scanned_blocks_table_is_the_hlo_and_trains_as_one_device(case):
    """The same plan on the blocks as one ``nn.scan`` (``layers``): the blocks' input enters the sequence cut once,
    before the loop (its gradient all-gathered once after the loop's backward pass, not once per layer), and leaves
    it once before the final norm; the table equals the compiled step's collectives (the loop's times its trip
    count) and 2 SGD steps equal one device's within 1e-5. (It crashed with an IndexError in ``_local_shape``
    when the state was laid out without example inputs, and its table missed the entry's gather.)"""
    net, batches, params, loss, ref_losses, ref = _scanned_setup()
    if case == "dp4-tp2":
        mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(net, mesh["tp"], _scanned_plan())
    else:
        mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
        model = fully_shard(parallelize_module(net, mesh["tp"], _scanned_plan()), mesh=mesh["dp", "fsdp"],
                            units=["layers"])
    opt = optax.sgd(0.1)
    state = init_train_state(model, opt, batches[0]["tokens"], params=params)
    step = make_train_step(model, loss, opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.lower(state, batches[0]).compile().as_text(), scalars=False)
    for kind in KINDS:
        want = comm["total"].get(kind, {"count": 0, "bytes": 0})
        got = hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]
        assert got == (want["count"], want["bytes"]), (kind, hlo[kind], want)
    act = BATCH // 4 * SEQ * LLAMA["hidden_size"] * 4
    boundary = [(r["module"], r.get("calls", 1), r["in_bytes"] or r["out_bytes"]) for r in comm["modules"]
                if r["style"] == "whole outside the plan" or (r["module"] == "layers.input_layernorm"
                                                              and not r["region"])]
    assert boundary == [("layers.input_layernorm", 1, act), ("norm", 1, act)], boundary
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref.params)


def test_scanned_blocks_laid_out_without_example_inputs_are_refused_by_communication():
    """``communication()`` checks the state as the step does: a scanned model's state laid out without example
    inputs (no stacked axis known) is refused naming the fix, not an IndexError inside the trace."""
    net, batches, params, loss, _, _ = _scanned_setup()
    mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(net, mesh["tp"], _scanned_plan())
    state = init_train_state(model, optax.sgd(0.1), params=params)
    step = make_train_step(model, loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"runs under nn\.scan.*pass example inputs.*init_train_state"):
        step.communication(state, batches[0])
