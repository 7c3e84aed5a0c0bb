"""A linen model with ``nn.BatchNorm`` (running statistics in the mutable ``batch_stats`` collection) trains
data-parallel, its statistics carried in ``TrainState.batch_stats``, in torch's two ways:

- ``batch_norm="sync"`` (torch's ``SyncBatchNorm``): the batch statistics of the global batch, so 3 SGD steps
  over dp=8, dp=2 x fsdp=4, FSDP units and checkpointed units holding BatchNorms equal 1-device training on
  the global batch (parameters and running statistics within 1e-5);
- ``batch_norm="broadcast"`` (DDP's ``broadcast_buffers=True``, the default): each rank normalizes with its own
  rows' statistics, the gradients are averaged, and the state keeps rank 0's running statistics; equal to a
  1-device loop over the 8 ranks' rows that does exactly that.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import (activation_checkpointing, executed_collectives, fully_shard, init_train_state,
                           make_train_step, unshard_params)
from tests._one_device import assert_trees_close
from tests.zoo.resnet import ResNet

MODEL = ResNet(stage_sizes=(1, 1), num_filters=4, num_classes=5)
OPT = optax.sgd(0.1)
STEPS = 3


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    # a per-channel offset and scale, so the batch statistics matter and differ from rank to rank
    spread = np.linspace(0.5, 2.0, n)[:, None, None, None]
    x = rng.normal(size=(n, 8, 8, 3)) * spread + np.arange(n)[:, None, None, None] / 4
    return {"image": x.astype(np.float32), "label": rng.integers(0, 5, n).astype(np.int32)}


def loss_fn(params, batch_stats, batch):  # what the user writes for one device
    logits, updates = MODEL.apply({"params": params, "batch_stats": batch_stats}, batch["image"],
                                  mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates["batch_stats"]


def _variables():
    return MODEL.init(jax.random.key(0), _batch()["image"][:2])


def _one_device(ranks: int):
    """(losses, params, batch_stats) of STEPS SGD steps on one device where the batch is split into ``ranks``
    slices, each normalized by its own statistics; the gradients averaged; the running statistics of slice 0
    kept. ``ranks=1``: plain 1-device training on the whole batch."""
    v = _variables()
    params, stats, s = v["params"], v["batch_stats"], OPT.init(v["params"])

    @jax.jit
    def step(params, stats, s, batch):
        rows = jax.tree.map(lambda x: x.reshape(ranks, -1, *x.shape[1:]), batch)
        (loss, new), g = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, None, 0))(
            params, stats, rows)
        u, s = OPT.update(jax.tree.map(lambda x: x.mean(0), g), s, params)
        return optax.apply_updates(params, u), jax.tree.map(lambda x: x[0], new), s, loss.mean()

    losses = []
    for i in range(STEPS):
        params, stats, s, loss = step(params, stats, s, _batch(i))
        losses.append(float(loss))
    return losses, params, stats


def _train(mesh, batch_norm, units=None, **kw):
    """(losses, logical params, state): STEPS steps of MODEL, plain over ``mesh`` (DDP), ``fully_shard`` on the
    blocks (``units="fsdp"``: FSDP units whose BatchNorms update the statistics inside them) or with the
    blocks checkpointed (``"remat"``, DDP)."""
    v = _variables()
    model, on = MODEL, {"mesh": mesh}
    if units == "fsdp":
        model, on = fully_shard(MODEL, mesh=mesh, units=["ResNetBlock_*"]), {}
    elif units == "remat":
        model = activation_checkpointing(MODEL, units=["ResNetBlock_*"])
    state = init_train_state(model, OPT, params=v["params"], batch_stats=v["batch_stats"], **on)
    step = make_train_step(model, loss_fn, OPT, batch_norm=batch_norm, **on, **kw)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, unshard_params(model, state), state


# the 2-D mesh without units repeats the one with (compile-bound): the slow tier
@pytest.mark.parametrize("shape,names,units", [((8,), ("dp",), None),
                                               pytest.param((2, 4), ("dp", "fsdp"), None, marks=pytest.mark.slow),
                                               ((2, 4), ("dp", "fsdp"), "fsdp"), ((8,), ("dp",), "remat")])
def test_sync_batch_norm_equals_one_device_on_the_global_batch(shape, names, units):
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    losses, params, state = _train(mesh, "sync", units)
    ref_losses, ref_params, ref_stats = _one_device(1)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(params, ref_params, atol=1e-5)
    assert_trees_close(state.batch_stats, ref_stats, atol=1e-5)
    # the statistics moved (3 updates at momentum 0.9), and rank 0's slice alone gives other ones
    _, _, rank0_stats = _one_device(8)
    assert not np.allclose(state.batch_stats["bn_init"]["mean"], _variables()["batch_stats"]["bn_init"]["mean"])
    assert np.abs(np.asarray(rank0_stats["bn_init"]["mean"]) - np.asarray(ref_stats["bn_init"]["mean"])).max() > 1e-2


def test_broadcast_keeps_rank_0s_statistics_and_averages_local_gradients():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    losses, params, state = _train(mesh, "broadcast")
    ref_losses, ref_params, ref_stats = _one_device(8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(params, ref_params, atol=1e-5)
    assert_trees_close(state.batch_stats, ref_stats, atol=1e-5)
    _, global_params, _ = _one_device(1)  # not the global batch's training: the local statistics differ
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(global_params)))
    assert diff > 1e-3


def test_init_from_an_rng_carries_the_models_batch_stats():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    state = init_train_state(MODEL, OPT, jax.random.key(0), _batch()["image"][:2], mesh=mesh)
    assert_trees_close(state.batch_stats, _variables()["batch_stats"], atol=0)
    assert state.batch_stats["bn_init"]["var"].sharding.is_fully_replicated


def test_bad_batch_norm_options_are_refused():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=re.escape("make_train_step: batch_norm='global' must be 'broadcast'")):
        make_train_step(MODEL, loss_fn, OPT, mesh=mesh, batch_norm="global")
    v = _variables()
    state = init_train_state(MODEL, OPT, params=v["params"], batch_stats=v["batch_stats"], mesh=mesh)
    step = make_train_step(MODEL, loss_fn, OPT, mesh=mesh, accum_steps=2)
    with pytest.raises(ValueError, match=re.escape("train_step: a state with batch_stats and accum_steps=2")):
        step(state, _batch())
    step = make_train_step(MODEL, lambda p, s, b: loss_fn(p, s, b)[0], OPT, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape("loss_fn(params, batch_stats, batch) must return "
                                                   "(loss, new_batch_stats)")):
        step(state, _batch())


def test_an_nnx_model_with_batch_statistics_is_refused_by_a_pipeline():
    """dp / fsdp train it (tests/parallel/test_nnx_batch_norm.py); a pipeline's micro-batches would each
    normalize by their own statistics, which is not one device's training on the batch."""
    from flax import nnx

    from spmd.parallel import pipeline

    class Net(nnx.Module):
        def __init__(self, *, rngs):
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.layers = nnx.List([nnx.BatchNorm(4, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(4, 5, rngs=rngs)

        def __call__(self, x):
            x = self.conv(x)
            for bn in self.layers:
                x = nnx.relu(bn(x))
            return self.head(x.mean((1, 2)))

    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(Net(rngs=nnx.Rngs(0)), mesh["pp"], units="layers.*", num_microbatches=2)
    with pytest.raises(ValueError, match=re.escape("init_train_state: model=Net holds nnx.BatchStat variables "
                                                   "('layers/0/mean' and 3 more: nnx.BatchNorm's running "
                                                   "statistics), which a pipeline does not carry")):
        init_train_state(pm, OPT)


def test_a_pipeline_refuses_batch_statistics_with_the_reason():
    """A stage sees one micro-batch at a time: its BatchNorms would normalize by a micro-batch's statistics.
    Initialized from an rng, the model's batch_stats collection is not dropped silently."""
    from spmd.parallel import pipeline

    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(MODEL, mesh["pp"], units="ResNetBlock_*", num_microbatches=2)
    reason = re.escape("each micro-batch passes a stage at a tick of its own, so a BatchNorm there would normalize "
                       "by one micro-batch's statistics")
    with pytest.raises(ValueError, match=re.escape("init_train_state: the model holds a 'batch_stats' collection "
                                                   "(nn.BatchNorm's running statistics), which PipelineModule does "
                                                   "not carry: ") + reason):
        init_train_state(pm, OPT, jax.random.key(0), _batch()["image"][:2])
    v = _variables()
    with pytest.raises(ValueError, match=re.escape("init_train_state: batch_stats= is not supported by "
                                                   "PipelineModule (a layout that owns its step): ") + reason):
        init_train_state(pm, OPT, params=v["params"], batch_stats=v["batch_stats"])


def test_a_checkpoint_keeps_the_running_statistics(tmp_path):
    """torch's state_dict holds a BatchNorm's buffers; a saved and restored state holds its batch_stats."""
    from models import Checkpointer
    from models._checkpoint import abstract_like

    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    _, _, state = _train(mesh, "sync")
    moved = state.batch_stats
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, {"step": 3})
        ckpt.wait()
        fresh = init_train_state(MODEL, OPT, params=_variables()["params"], batch_stats=_variables()["batch_stats"],
                                 mesh=mesh)
        restored, _ = ckpt.restore(abstract_like(fresh))
    assert_trees_close(restored.batch_stats, moved, atol=0)
    assert not np.allclose(restored.batch_stats["bn_init"]["mean"], _variables()["batch_stats"]["bn_init"]["mean"])


class _ConvNorm(nn.Module):
    """A convolution, a BatchNorm over its 6 channels (``fast``: flax's one-pass variance), a classifier."""
    fast: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(6, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, use_fast_variance=self.fast, name="bn")(x))
        return nn.Dense(5, name="head")(x.mean((1, 2)))


@pytest.mark.parametrize("fast,batch_norm", [(True, "sync"), (False, "sync"), (True, "broadcast")])
def test_batch_norm_statistics_are_in_the_table_as_compiled(fast, batch_norm):
    model = _ConvNorm(fast=fast)
    v = model.init(jax.random.key(0), _batch()["image"][:2])

    def loss(params, batch_stats, batch):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, batch["image"],
                                      mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates["batch_stats"]

    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    state = init_train_state(model, OPT, params=v["params"], batch_stats=v["batch_stats"], mesh=mesh)
    step = make_train_step(model, loss, OPT, batch_norm=batch_norm, mesh=mesh)
    comm = step.communication(state, _batch())
    # sync: flax averages the mean and the mean of squares of the 6 channels in float32, stacked in one
    # all-reduce (fast variance) or one each, and the backward pass all-reduces their cotangents the same way;
    # broadcast: rank 0's running mean and variance, one all-reduce each
    per_pass = [2 * 6 * 4] if fast else [6 * 4, 6 * 4]
    want = ({"count": 2 * len(per_pass), "bytes": 2 * sum(per_pass)} if batch_norm == "sync"
            else {"count": 2, "bytes": 2 * 6 * 4})
    assert comm["batch_stats"]["all-reduce"] == want
    hlo = executed_collectives(step, state, _batch(), scalars=False)
    for kind, want in comm["total"].items():
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), (kind, hlo, comm)


def test_sync_batch_norm_in_fsdp_units_the_table_is_the_compiled_step():
    # a unit's re-gather recomputes nothing but the gather (torch FSDP's reshard_after_forward): its BatchNorms'
    # all-reduces run once, none again in the backward pass (the table's recomputed term is empty)
    v = _variables()
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))
    model = fully_shard(MODEL, mesh=mesh, units=["ResNetBlock_*"])
    state = init_train_state(model, OPT, params=v["params"], batch_stats=v["batch_stats"])
    step = make_train_step(model, loss_fn, OPT, batch_norm="sync")
    comm = step.communication(state, _batch())
    assert comm["recomputed"]["all-reduce"]["count"] == 0
    # the stem's BatchNorm and the 5 inside the two blocks: their statistics forward, their cotangents backward
    assert comm["batch_stats"]["all-reduce"]["count"] == 2 * 6
    hlo = executed_collectives(step, state, _batch(), scalars=False)
    for kind, want in comm["total"].items():
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), (kind, hlo, comm)
