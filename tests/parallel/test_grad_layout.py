"""The step's gradient-layout rule (``spmd.parallel.step._grad_layout``): which gradients are the transpose of
a dot's output, read off the backward jaxpr, and a DDP step that reduces those transposed equals 1-device
training."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from placements import Shard
from spmd.parallel import executed_collectives, fully_shard, init_train_state, make_train_step, unshard_params
from spmd.parallel.step._grad_layout import transposed_dot_grads, zero_grads


def _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: st.params):
    """3 steps of ``step`` from ``state`` on ``batch``: each step's loss equal to one device's (``opt`` on
    ``loss_fn``'s gradient, from ``params``), then the parameters (``final(state)``) too, within 1e-6."""
    ref, s = params, opt.init(params)
    for _ in range(3):
        state, metrics = step(state, batch)
        value, g = jax.value_and_grad(loss_fn)(ref, batch)
        u, s = opt.update(g, s, ref)
        ref = optax.apply_updates(ref, u)
        np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=0, atol=1e-6)
    for a, b in zip(jax.tree.leaves(final(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


class _TwoWays(nn.Module):
    """A Dense (kernel ``[in, out]``: its gradient is a dot's output transposed) and a torch-style weight
    ``[out, in]`` used as ``x @ w.T`` (its gradient is a dot's output as it comes)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.1), (6, 5))
        h = nn.Dense(5, name="dense")(x)
        return jnp.tanh(h) @ w.T


def _backward(params, x):
    loss = lambda p: jnp.sum(_TwoWays().apply({"params": p}, x) ** 2)  # noqa: E731
    value, bwd = jax.vjp(loss, params)
    return jax.make_jaxpr(bwd)(jnp.ones_like(value)), jax.tree_util.tree_flatten_with_path(params)[0]


def test_only_the_transposed_dot_gradients_are_flagged():
    x = jnp.ones((4, 3))
    params = _TwoWays().init(jax.random.key(0), x)["params"]
    closed, leaves = _backward(params, x)
    got = {jax.tree_util.keystr(k): f for (k, _), f in zip(leaves, transposed_dot_grads(closed))}
    assert got == {"['dense']['bias']": False, "['dense']['kernel']": True, "['w']": False}


def test_flagged_through_a_jit_and_a_dtype_convert():
    def loss(k, x):
        return jnp.sum(jax.jit(lambda k: x @ k.astype(jnp.bfloat16))(k).astype(jnp.float32))

    value, bwd = jax.vjp(lambda k: loss(k, jnp.ones((4, 3), jnp.bfloat16)), jnp.ones((3, 5)))
    assert transposed_dot_grads(jax.make_jaxpr(bwd)(jnp.ones_like(value))) == [True]


def test_ddp_step_with_the_rule_equals_one_device():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
    model = _TwoWays()
    params = model.init(jax.random.key(0), x)["params"]
    opt = optax.adamw(1e-2)

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh)
    _assert_trains_as_one_device(step, state, {"x": x, "y": y}, loss_fn, opt, params)


class _FrozenBias(nn.Module):
    """A Dense, then a bias added under ``stop_gradient`` (BART's ``final_logits_bias``) and one never read."""

    @nn.compact
    def __call__(self, x):
        frozen = self.param("frozen", nn.initializers.normal(0.1), (1, 5))
        self.param("unused", nn.initializers.zeros, (3,))
        return nn.Dense(5, name="dense")(x) + jax.lax.stop_gradient(frozen)


@pytest.mark.parametrize("accum", [1, 2])
def test_zero_gradients_are_flagged_and_neither_reduced_nor_in_the_table(accum):
    """Under accumulation too (``accum_steps=2``: read off one micro-batch's backward pass)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    model = _FrozenBias()
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    value, bwd = jax.vjp(lambda p: loss_fn(p, {"x": x, "y": y}), params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    got = {jax.tree_util.keystr(k): z for (k, _), z in zip(leaves, zero_grads(jax.make_jaxpr(bwd)(jnp.ones_like(value))))}
    assert got == {"['dense']['bias']": False, "['dense']['kernel']": False, "['frozen']": True, "['unused']": True}

    opt = optax.adamw(1e-2)
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh, accum_steps=accum)
    batch = {"x": x, "y": y}
    comm = step.communication(state, batch)
    # the dense kernel and bias alone are averaged: 3 x 5 + 5 floats
    assert comm["total"]["all-reduce"] == {"count": 2, "bytes": (3 * 5 + 5) * 4}
    hlo = executed_collectives(step, state, batch, scalars=False)
    assert (hlo["all-reduce"]["buffers"], hlo["all-reduce"]["bytes"]) == (2, (3 * 5 + 5) * 4)
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params)


class _TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="out")(jnp.tanh(nn.Dense(32, name="hidden")(x)))


def _dot_shapes(hlo: str) -> set:
    return {tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", hlo)}


def test_under_accumulation_the_weight_gradients_stay_in_their_dots_layout_and_equal_one_device():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 6)).astype(np.float32)}
    model = _TwoDense()
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh, accum_steps=2)
    # each kernel's gradient is accumulated as its dot computes it, [out, in] (the kernels are [in, out]):
    # no dot computes a kernel-shaped [in, out] result (the transpose folded into it)
    dots = _dot_shapes(step.compiled(state, batch).as_text())
    assert {(32, 16), (6, 32)} <= dots and not {(16, 32), (32, 6)} & dots, dots
    comm = step.communication(state, batch)["total"]["all-reduce"]
    hlo = executed_collectives(step, state, batch, scalars=False)["all-reduce"]
    assert (hlo["buffers"], hlo["bytes"]) == (comm["count"], comm["bytes"]) == (4, (16 * 32 + 32 + 32 * 6 + 6) * 4)
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(24, name="down")(jnp.tanh(nn.Dense(40, name="up")(x)))[..., :16]


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _Block(name=f"layers_{i}")(x)
        return nn.Dense(6, name="head")(x)


@pytest.mark.slow
def test_fsdp_gathers_flagged_kernels_transposed_so_their_gradients_stay_in_their_dots_layout():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 6)).astype(np.float32)}
    model = _Stack()
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    sharded = fully_shard(model, mesh=mesh, units=["layers_*"])
    state = init_train_state(sharded, opt, params=params)
    step = make_train_step(sharded, loss_fn, opt)
    # each kernel's gradient ([in, out] kernels: up [16, 40], down [40, 24], head [16, 6]) is reduce-scattered
    # from its dot's own [out, in] output: no dot computes a kernel-shaped result
    dots = _dot_shapes(step.compiled(state, batch).as_text())
    assert {(40, 16), (24, 40), (6, 16)} <= dots and not {(16, 40), (40, 24), (16, 6)} & dots, dots
    comm = step.communication(state, batch)["total"]["reduce-scatter"]
    hlo = executed_collectives(step, state, batch, scalars=False)["reduce-scatter"]
    assert (hlo["buffers"], hlo["bytes"]) == (comm["count"], comm["bytes"])
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: unshard_params(sharded, st))


def _gathered_shapes(hlo: str) -> set:
    return {tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} all-gather\(", hlo)}


@pytest.mark.slow
def test_fsdp_with_example_inputs_cuts_flagged_kernels_on_their_output_dim():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 6)).astype(np.float32)}
    model = _Stack()
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    sharded = fully_shard(model, mesh=mesh, units=["layers_*"])
    state = init_train_state(sharded, opt, batch["x"][:2], params=params)  # example inputs: the backward is read
    placed = {e.path: e.placements for e in state.plan.entries}
    # up [16, 40] and down [40, 24] on their output dim (8 divides it); head [16, 6] on dim 0 (8 does not divide 6)
    assert placed["layers_0/up/kernel"] == placed["layers_1/down/kernel"] == (Shard(1),), placed
    assert placed["head/kernel"] == placed["layers_0/up/bias"] == (Shard(0),), placed
    assert sharded.plan(params, batch["x"][:2]) == state.plan
    assert sharded.plan(params).out_cut is None and sharded.plan(params) != state.plan
    step = make_train_step(sharded, loss_fn, opt)
    hlo = step.compiled(state, batch).as_text()
    # each output-cut kernel is gathered as [out, in] (its shard's transpose, on dim 0) and its gradient is
    # reduce-scattered from its dot's own [out, in] output; no dot computes a kernel-shaped result
    assert {(40, 16), (24, 40)} <= _gathered_shapes(hlo) and not {(16, 40), (40, 24)} & _gathered_shapes(hlo)
    dots = _dot_shapes(hlo)
    assert {(40, 16), (24, 40), (6, 16)} <= dots and not {(16, 40), (40, 24), (16, 6)} & dots, dots
    comm = step.communication(state, batch)["total"]["reduce-scatter"]
    got = executed_collectives(step, state, batch, scalars=False)["reduce-scatter"]
    assert (got["buffers"], got["bytes"]) == (comm["count"], comm["bytes"])
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: unshard_params(sharded, st))
