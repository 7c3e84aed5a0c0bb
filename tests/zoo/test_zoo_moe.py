"""The zoo's mixture of experts (``tests/zoo/nnx_moe.py``: a Mixtral-like flax.nnx decoder written as MaxText's
dense-matmul MoE block is, independently of ``models.MoE``) under expert parallelism: ``ExpertParallel`` on its
experts module, whose buffers are experts-first (``[E, B, C, M]``: ``experts_dim=0``, ``token_dim=1``), under
ep=2, dp=2 x ep=2 and fsdp=2 x ep=2 equals 10 AdamW steps of one device within 1e-5 (losses, parameters and the
optimizer state, as ``test_zoo.assert_state_matches`` compares them), the
compiled step's collectives equal to the step's table, and the drops the blocks sow (also inside fully_shard units)
equal a NumPy count from the gate's logits; pipelined over its blocks with its experts over ep inside the stages
(pp=2 x ep=2, pp=2 x dp=2 x ep=2) it equals one device too, its collectives equal to the pipeline's table, and
the drops its blocks sow reach the step's metrics by unit (``metrics['intermediates/blocks/0/moe/dropped']``), equal to the NumPy count. The style given dims the model's buffers do not have is
refused naming them (never run on the wrong dims), also where the wrong dim has the experts' size."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import (ExpertParallel, fully_shard, hlo_executed_collectives, init_train_state, make_train_step,
                           parallelize_module, unshard_params, unshard_tree)
from tests._one_device import train_one_device
from tests.zoo.test_zoo import OPT, STEPS, assert_state_matches

V, S = 32, 8
EP = ExpertParallel(token_dim=1, experts_dim=0)  # the model's buffers: [E, B, C, M]


def _model():
    from flax import nnx

    from tests.zoo.nnx_moe import MixtralLike

    return MixtralLike(vocab=V, rngs=nnx.Rngs(0))


def _batch(n=8):
    toks = np.random.default_rng(0).integers(0, V, (n, S + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def _loss(m, b):
    return optax.softmax_cross_entropy_with_integer_labels(m(b["inputs"]), b["targets"]).mean()


def _loss_drops(m, b):
    from flax import nnx

    loss = _loss(m, b)
    sown = nnx.pop(m, nnx.Intermediate)
    return loss, {"dropped": sum(jnp.sum(jnp.asarray(x)) for x in jax.tree.leaves(sown)).astype(jnp.float32)}


def _numpy_drops(model, tokens) -> int:
    """The assignments over capacity: each block's gate logits on one device (the blocks run in turn), then a
    NumPy loop per sequence, token by token, each token's top-k choices in order."""
    x = model.embed(tokens) + model.pos(jnp.arange(tokens.shape[1]))
    total = 0
    for block in model.blocks:
        x = x + block.attn(block.attn_norm(x))
        h = block.moe_norm(x)
        logits = np.asarray(block.moe.gate(h), np.float64)
        x = x + block.moe(h)
        e, k = logits.shape[-1], block.moe.top_k
        cap = int(np.ceil(block.moe.capacity_factor * tokens.shape[1] * k / e))
        for seq in logits:
            load = np.zeros(e, int)
            for row in seq:
                for expert in np.argsort(-row, kind="stable")[:k]:
                    load[expert] += 1
                    total += load[expert] > cap
    return total


@functools.lru_cache(maxsize=None)
def _reference():
    from flax import nnx

    graphdef, params = nnx.split(_model(), nnx.Param)
    return train_one_device(params, [_batch()] * STEPS, lambda p, b: _loss(nnx.merge(graphdef, p), b), OPT)


def _laid_out(dims: dict, style=EP):
    mesh = spmd.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    m = parallelize_module(_model(), mesh["ep"], {"blocks.*.moe.experts": style})
    if "fsdp" in dims:
        m = fully_shard(m, mesh=mesh["fsdp"], units=["blocks.*"])
    return m


@pytest.mark.slow
@pytest.mark.parametrize("dims", [{"ep": 2}, {"dp": 2, "ep": 2}, {"fsdp": 2, "ep": 2}],
                         ids=["ep2", "dp2-ep2", "fsdp2-ep2"])
def test_zoo_moe_under_ep_equals_one_device(dims):
    ref_losses, ref = _reference()
    m = _laid_out(dims)
    state = init_train_state(m, OPT)
    step = make_train_step(m, _loss_drops, OPT)
    batch = _batch()
    comm = step.communication(state, batch)
    hlo = hlo_executed_collectives(step.compiled(state, batch).as_text(), scalars=False)
    losses, drops = [], []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        drops.append(float(metrics["dropped"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    n_data = dims.get("dp", 1) * dims.get("fsdp", 1) * dims["ep"]  # the step averages the metric over them
    assert drops[0] * n_data == _numpy_drops(_model(), batch["inputs"]) > 0
    assert ref_losses[-1] < ref_losses[0]
    assert_state_matches(unshard_params(m, state), unshard_tree(state.opt_state, state.plan, optimizer=OPT), ref)
    # per device, each block: buffers [E=4, B, C=4, M=16] float32 cut to [2, B, 4, 16] on the way in and out
    rows = 8 // (dims.get("dp", 1) * dims.get("fsdp", 1) * dims["ep"])
    assert comm["experts"]["all-to-all"] == {"count": 8, "bytes": 8 * 4 * rows * 4 * 16 * 4}
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (comm["total"]["all-to-all"]["count"],
                                                                         comm["total"]["all-to-all"]["bytes"])


def test_zoo_moe_with_the_wrong_experts_dim_is_refused():
    """The default dims ([groups, E, C, d]) on the model's [E, B, C, M] buffers: dim 1 (2 local rows) is not the
    experts'."""
    m = _laid_out({"dp": 2, "ep": 2}, ExpertParallel())
    state = init_train_state(m, OPT)
    with pytest.raises(ValueError, match=re.escape(
            "on 'blocks.0.moe.experts': the module's input has shape (4, 2, 4, 16) on this device, and its experts "
            "dim 1 (experts_dim=1) must hold one slot per expert, 4 (the module's parameters' leading dim over "
            "ep=2)")):
        make_train_step(m, _loss, OPT)(state, _batch())


def test_zoo_moe_with_a_wrong_dim_of_the_experts_size_is_refused():
    """16 rows over dp=2 x ep=2: 4 local rows, as many as the experts, on the dim the default style takes for
    theirs; the exchange would cut the rows: refused on the model's own code, which does not run there."""
    m = _laid_out({"dp": 2, "ep": 2}, ExpertParallel())
    state = init_train_state(m, OPT)
    with pytest.raises(ValueError, match=re.escape(
            "on 'blocks.0.moe.experts': the module does not run on its local experts' tokens, shape (8, 2, 4, 16) "
            "on this device (dim 1, experts_dim=1, exchanged over ep)")):
        make_train_step(m, _loss, OPT)(state, _batch(16))


@pytest.mark.slow
@pytest.mark.parametrize("dims", [{"pp": 2, "ep": 2}, {"pp": 2, "dp": 2, "ep": 2}], ids=["pp2-ep2", "pp2-dp2-ep2"])
def test_zoo_moe_pipeline_with_experts_over_ep_equals_one_device(dims):
    """The zoo's nnx MoE pipelined over its blocks (one block a stage, 1F1B over 2 micro-batches) with its experts
    cut over ep inside the stages: equal to 10 AdamW steps of one device within 1e-5, every collective equal to the
    pipeline's table (the all-to-alls per tick: a forward 2 per block, a backward 4)."""
    from spmd.parallel import pipeline

    ref_losses, ref = _reference()
    mesh = spmd.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    m = pipeline(parallelize_module(_model(), mesh["ep"], {"blocks.*.moe.experts": EP}), mesh["pp"],
                 units="blocks.*", num_microbatches=2, schedule="1f1b")
    state = init_train_state(m, OPT)
    step = make_train_step(m, _loss, OPT)
    batch = _batch()
    comm = step.communication(state, batch)
    hlo = hlo_executed_collectives(step.compiled(state, batch).as_text(), scalars=False)
    losses, sown = [], []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        sown.append({k: v for k, v in metrics.items() if k.startswith("intermediates/")})
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    own = m.unstack_state(state, OPT)
    assert_state_matches(own.params, own.opt_state, ref)
    # the drops each block sows (an nnx.Intermediate) reach the step's metrics by unit, averaged over the data
    # ranks and the 2 micro-batches as the loss
    assert sorted(sown[0]) == ["intermediates/blocks/0/moe/dropped", "intermediates/blocks/1/moe/dropped"]
    n = dims.get("dp", 1) * dims["ep"] * 2
    assert sum(float(v) for v in sown[0].values()) * n == _numpy_drops(_model(), batch["inputs"]) > 0
    # per device and micro-batch: buffers [E=4, rows, C=4, M=16] float32; rank 0: 2 F + 2 B, rank 1: 2 B
    rows = 8 // (dims.get("dp", 1) * dims["ep"] * 2)
    nbytes = 4 * rows * 4 * 16 * 4
    assert comm["all-to-all"] == {"count": 20, "bytes": 20 * nbytes}
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (20, 20 * nbytes)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        assert hlo[kind]["bytes"] == comm[kind]["bytes"], kind
