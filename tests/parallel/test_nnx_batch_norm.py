"""An nnx model with ``nnx.BatchNorm`` (running statistics in ``nnx.BatchStat`` variables) trains data-parallel,
its statistics carried in ``TrainState.batch_stats`` (a dict by path), in torch's two ways, as a linen model's
do (tests/parallel/test_batch_norm.py):

- ``batch_norm="sync"``: 3 SGD steps over dp=8 and dp=2 x fsdp=4 (FSDP units holding the BatchNorms) equal
  1-device training on the global batch (parameters and statistics within 1e-5);
- ``batch_norm="broadcast"``: each rank normalizes by its own rows, the gradients averaged, rank 0's
  statistics kept: equal to a 1-device loop over the 8 ranks' rows doing exactly that.

The communication table equals the compiled step's collectives (the sync statistics' all-reduces counted).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd.parallel import executed_collectives, fully_shard, init_train_state, make_train_step, unshard_params
from tests._one_device import assert_trees_close

OPT = optax.sgd(0.1)
STEPS = 3


class Block(nnx.Module):
    def __init__(self, c, *, rngs):
        self.conv = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(c, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.bn(self.conv(x)))


class Net(nnx.Module):
    def __init__(self, *, rngs):
        self.stem = nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
        self.blocks = nnx.List([Block(4, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(4, 5, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.stem(x)))
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((1, 2)))


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    spread = np.linspace(0.5, 2.0, n)[:, None, None, None]  # the rows' statistics differ from rank to rank
    x = rng.normal(size=(n, 6, 6, 3)) * spread + np.arange(n)[:, None, None, None] / 4
    return {"image": x.astype(np.float32), "label": rng.integers(0, 5, n).astype(np.int32)}


def loss_fn(model, batch):  # what the user writes for one device
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["image"]), batch["label"]).mean()


def _one_device(ranks: int):
    """(losses, params, stats) of STEPS SGD steps on one device, functionally through nnx.split / merge: the
    batch split into ``ranks`` slices each normalized by its own statistics, the gradients averaged, slice 0's
    statistics kept; ``ranks=1``: plain training on the whole batch."""
    graphdef, params, stats = nnx.split(Net(rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    s = OPT.init(params)

    def one(params, stats, rows):
        m = nnx.merge(graphdef, params, stats, copy=True)
        loss = loss_fn(m, rows)
        return loss, nnx.state(m, nnx.BatchStat)

    @jax.jit
    def step(params, stats, s, batch):
        rows = jax.tree.map(lambda x: x.reshape(ranks, -1, *x.shape[1:]), batch)
        (loss, new), g = jax.vmap(jax.value_and_grad(one, has_aux=True), in_axes=(None, None, 0))(params, stats, rows)
        u, s = OPT.update(jax.tree.map(lambda x: x.mean(0), g), s, params)
        return optax.apply_updates(params, u), jax.tree.map(lambda x: x[0], new), s, loss.mean()

    losses = []
    for i in range(STEPS):
        params, stats, s, loss = step(params, stats, s, _batch(i))
        losses.append(float(loss))
    return losses, params.to_pure_dict(), stats.to_pure_dict()


def _train(mesh, batch_norm, fsdp=False):
    model, on = Net(rngs=nnx.Rngs(0)), {"mesh": mesh}
    if fsdp:
        model, on = fully_shard(model, mesh=mesh, units=["blocks.*"]), {}
    state = init_train_state(model, OPT, **on)
    step = make_train_step(model, loss_fn, OPT, batch_norm=batch_norm, **on)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    params = unshard_params(model, state)
    return losses, getattr(params, "to_pure_dict", lambda: params)(), state, step


def _table_is_the_hlo(step, state):
    comm = step.communication(state, _batch(0))
    hlo = executed_collectives(step, state, _batch(0), scalars=False)
    for kind, want in comm["total"].items():
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), (kind, hlo, comm)
    return comm


@pytest.mark.parametrize("shape,names,fsdp", [((8,), ("dp",), False),
                                               pytest.param((2, 4), ("dp", "fsdp"), True, marks=pytest.mark.slow)])
def test_sync_batch_norm_equals_one_device_on_the_global_batch(shape, names, fsdp):
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    losses, params, state, step = _train(mesh, "sync", fsdp)
    ref_losses, ref_params, ref_stats = _one_device(1)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(params, ref_params, atol=1e-5)
    assert_trees_close(state.batch_stats, ref_stats, atol=1e-5)
    _, _, rank0 = _one_device(8)  # rank 0's rows alone give other statistics
    assert np.abs(np.asarray(rank0["norm"]["mean"]) - np.asarray(ref_stats["norm"]["mean"])).max() > 1e-2
    comm = _table_is_the_hlo(step, state)
    # the 3 BatchNorms of 4 channels: mean and mean of squares in float32 in one all-reduce each (fast
    # variance), forward and backward
    assert comm["batch_stats"]["all-reduce"] == {"count": 2 * 3, "bytes": 2 * 3 * 2 * 4 * 4}


@pytest.mark.parametrize("shape,names,fsdp", [((8,), ("dp",), False),
                                               pytest.param((2, 4), ("dp", "fsdp"), True, marks=pytest.mark.slow)])
def test_broadcast_keeps_rank_0s_statistics_and_averages_local_gradients(shape, names, fsdp):
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    losses, params, state, step = _train(mesh, "broadcast", fsdp)
    ref_losses, ref_params, ref_stats = _one_device(8)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(params, ref_params, atol=1e-5)
    assert_trees_close(state.batch_stats, ref_stats, atol=1e-5)
    _, global_params, _ = _one_device(1)  # not the global batch's training
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(global_params)))
    assert diff > 1e-3
    comm = _table_is_the_hlo(step, state)
    assert comm["batch_stats"]["all-reduce"] == {"count": 3 * 2, "bytes": 3 * 2 * 4 * 4}  # rank 0's mean, var


def test_batch_stats_for_an_nnx_model_is_refused_by_name():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    with pytest.raises(TypeError, match=re.escape("init_train_state: batch_stats= is for a linen model; an nnx "
                                                  "model holds its BatchNorm statistics itself")):
        init_train_state(Net(rngs=nnx.Rngs(0)), OPT, mesh=mesh, batch_stats={"norm": {"mean": np.zeros(4)}})
