"""Every layout on blocks under ``nn.scan`` (linen) and ``nnx.vmap`` + ``nnx.scan`` (nnx), the model unchanged:
tensor and sequence parallelism inside the scan (each block's cut one dim past the stacked layer axis, at
any ``variable_axes`` position, with or without ``nn.remat``), DDP, FSDP per layer, HSDP and 3-D train equal
to 1-device training, and the communication table equals the compiled loop's collectives times its trip
count."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from flax import nnx
from placements import Replicate, Shard
from spmd.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                           executed_collectives, fully_shard, init_train_state, make_train_step, parallelize_module,
                           unshard_params)
from tests._one_device import assert_trees_close, train_one_device
from tests.third_party.scanned import ScannedMLP, nnx_scanned_mlp

VOCAB, STEPS = 32, 3
OPT = optax.sgd(0.1)
EXAMPLE = jnp.zeros((2, 8), jnp.int32)
MODELS = {"axis0": {"axis": 0}, "axis1": {"axis": 1}, "remat": {"axis": 0, "remat": True}}


def _batch(seed):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (8, 9))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def _loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


def _tp_plan(sp: bool) -> dict:
    if not sp:
        return {"layers.up": ColwiseParallel(), "layers.down": RowwiseParallel()}
    return {"embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "layers.norm": SequenceParallel(), "layers.up": ColwiseParallel(input_layouts=Shard(1)),
            "layers.down": RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def _layout(model, spec: str):
    if spec == "fsdp":
        return fully_shard(model, mesh=spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",)), units=["layers"])
    if spec == "hsdp":
        mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))
        return fully_shard(model, mesh=mesh["dp", "fsdp"], units=["layers"])
    sp = spec.endswith("+sp")
    if spec.startswith("tp"):
        mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        return parallelize_module(model, mesh["tp"], _tp_plan(sp))
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    return fully_shard(parallelize_module(model, mesh["tp"], _tp_plan(sp)), mesh=mesh["dp", "fsdp"], units=["layers"])


@functools.lru_cache(maxsize=None)
def _reference(name):
    model = ScannedMLP(vocab=VOCAB, **MODELS[name])
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    losses, state = train_one_device(params, [_batch(i) for i in range(STEPS)], _loss(model), OPT)
    return params, losses, state.params


def test_the_tp_cut_is_one_dim_past_the_layer_axis_which_nothing_cuts():
    for axis, up, down in ((0, (1, 2), (2, 1)), (1, (0, 2), (2, 0))):
        model = ScannedMLP(vocab=VOCAB, axis=axis)
        pm = _layout(model, "3d")
        plan = pm.plan(model.init(jax.random.key(0), EXAMPLE)["params"], EXAMPLE)
        # (fsdp, tp) cut dims of the stacked kernels: Colwise cuts the block's [16, 32] kernel on its columns,
        # Rowwise on its rows; fsdp takes the block's other dim; the layer axis stays whole
        for path, (fsdp_dim, tp_dim) in (("layers/up/kernel", up), ("layers/down/kernel", down)):
            e = plan.entry(path)
            assert (e.shard_dim(1), e.shard_dim(2)) == (fsdp_dim, tp_dim), (axis, path, e.placements)
            assert axis not in (e.shard_dim(1), e.shard_dim(2))


CASES = [("axis0", "tp"), ("axis1", "tp"), ("remat", "tp"), ("axis1", "tp+sp"), ("axis0", "tp+sp"),
         ("remat", "tp+sp"), ("axis1", "hsdp"), ("axis0", "3d"), ("axis1", "3d"), ("remat", "3d"), ("axis0", "3d+sp"),
         ("remat", "fsdp")]
# the README's tier keeps each model on tp and axis0 on every layout; the rest repeat those (compile-bound)
SLOW = {("axis1", "tp+sp"), ("remat", "tp+sp"), ("axis1", "hsdp"), ("axis1", "3d"), ("remat", "3d")}


@pytest.mark.parametrize("name,spec", [pytest.param(m, s, id=f"{m}-{s}", marks=[pytest.mark.slow] if (m, s) in SLOW
                                                    else []) for m, s in CASES])
def test_scanned_blocks_train_equal_to_one_device_and_the_table_is_the_loops_collectives(name, spec):
    params, ref_losses, ref_params = _reference(name)
    model = _layout(ScannedMLP(vocab=VOCAB, **MODELS[name]), spec)
    state = init_train_state(model, OPT, EXAMPLE, params=params)
    step = make_train_step(model, _loss(model), OPT)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref_params)
    hlo = executed_collectives(step, state, _batch(0), scalars=False)
    comm = step.communication(state, _batch(0))
    table = comm["total"]
    # the user's own nn.remat (no policy) recomputes the block's forward pass in the backward pass, the
    # all-gathers whose results that needs included (an FSDP unit's parameters, a sequence-parallel input): the
    # table's "recomputed" term
    if name == "remat" and spec != "tp":
        assert comm["recomputed"]["all-gather"]["count"] > 0, comm["recomputed"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), (kind, hlo,
                                                                                                             table)
    # the styled calls inside the scan count once per layer
    calls = {r["module"]: r.get("calls", 1) for r in comm["modules"]}
    if spec not in ("hsdp", "fsdp"):
        assert calls["layers.up"] == calls["layers.down"] == 2


@pytest.mark.parametrize("spec", [pytest.param("tp+sp", marks=pytest.mark.slow), "3d"])
def test_a_users_remat_under_accumulation_trains_equal_to_one_device_and_its_table_is_the_compiled_step(spec):
    # each micro-batch's backward pass recomputes the blocks (under sequence parallelism: their input gathers)
    params, ref_losses, ref_params = _reference("remat")
    model = _layout(ScannedMLP(vocab=VOCAB, **MODELS["remat"]), spec)
    state = init_train_state(model, OPT, EXAMPLE, params=params)
    step = make_train_step(model, _loss(model), OPT, accum_steps=2)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref_params)
    hlo = executed_collectives(step, state, _batch(0), scalars=False)
    comm = step.communication(state, _batch(0))
    if spec == "tp+sp":
        assert comm["recomputed"]["all-gather"]["count"] == 2 * 2  # 2 layers, 2 micro-batches
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        want = comm["total"][kind]
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), (kind, hlo, comm["total"])


def _nnx_loss(m, batch):
    return optax.softmax_cross_entropy_with_integer_labels(m(batch["inputs"]), batch["targets"]).mean()


@functools.lru_cache(maxsize=None)
def _nnx_reference():
    graphdef, params = nnx.split(nnx_scanned_mlp(vocab=VOCAB), nnx.Param)
    losses, state = train_one_device(params, [_batch(i) for i in range(STEPS)],
                                     lambda p, b: _nnx_loss(nnx.merge(graphdef, p), b), OPT)
    return losses, state.params


NNX = ["dp", "fsdp", "hsdp", "tp", "tp+sp", "3d"]


# the README's tier: dp and 3d (fsdp and tp at once); the others in the slow tier
@pytest.mark.parametrize("spec", [pytest.param(s, marks=[pytest.mark.slow] if s not in ("dp", "3d") else [])
                                  for s in NNX])
def test_nnx_scanned_blocks_train_equal_to_one_device_and_the_table_is_the_loops_collectives(spec):
    ref_losses, ref_params = _nnx_reference()
    model = nnx_scanned_mlp(vocab=VOCAB)
    kw = {"mesh": spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))} if spec == "dp" else {}
    model = model if spec == "dp" else _layout(model, spec)
    state = init_train_state(model, OPT, EXAMPLE, **kw)  # the inputs it is called on: nnx.scan's layer axis
    if spec != "dp":
        assert dict(state.plan.scans) == {"layers": 2}
    step = make_train_step(model, _nnx_loss, OPT, **kw)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(model, state), ref_params)
    hlo = executed_collectives(step, state, _batch(0), scalars=False)
    table = step.communication(state, _batch(0))["total"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), (kind, hlo,
                                                                                                             table)


def test_an_nnx_scan_laid_out_without_example_inputs_is_a_clear_error_at_the_first_step():
    model = _layout(nnx_scanned_mlp(vocab=VOCAB), "fsdp")
    step = make_train_step(model, _nnx_loss, OPT)
    with pytest.raises(ValueError, match=re.escape(
            "train_step: module 'layers' runs under nnx.scan (parameter 'layers/down/bias/value' is stacked along "
            "axis 0), but the state was laid out without knowing it; pass example inputs the model is called on "
            "when you build it: init_train_state(model, optimizer, *example_inputs).")):
        step(init_train_state(model, OPT), _batch(0))
