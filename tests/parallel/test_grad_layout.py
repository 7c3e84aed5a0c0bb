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
from spmd.parallel.step._grad_layout import equal_grads, transposed_dot_grads, zero_grads


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


class _TwoBiases(nn.Module):
    """Three biases added to a bias-free Dense's output: ``b1`` and ``b2`` get the same gradient by construction
    (the sum's cotangent, summed over the batch: what a residual sum gives two BatchNorm biases), ``2 * b3``
    twice it."""

    @nn.compact
    def __call__(self, x):
        b1, b2, b3 = (self.param(n, nn.initializers.normal(0.1), (5,)) for n in ("b1", "b2", "b3"))
        return jnp.tanh(nn.Dense(5, use_bias=False, name="dense")(x) + b1 + b2 + 2 * b3)


@pytest.mark.parametrize("accum", [1, 2])
def test_equal_gradients_are_reduced_once_and_counted_once(accum):
    """XLA merges the all-reduces of two gradients that are one value (its CSE); the table counts one, read off
    the backward pass. Accumulated over micro-batches (``accum_steps=2``) each is a loop carry of its own,
    reduced and counted apart."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)}
    model = _TwoBiases()
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    value, bwd = jax.vjp(lambda p: loss_fn(p, batch), params)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    same = equal_grads(jax.make_jaxpr(bwd)(jnp.ones_like(value)))
    assert {names[i]: names[j] for i, j in enumerate(same) if j is not None} == {"['b2']": "['b1']"}

    opt = optax.adamw(1e-2)
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh, accum_steps=accum)
    # the kernel (3 x 5), b1 and b3 (and b2 apart under accumulation)
    want = (3, (3 * 5 + 2 * 5) * 4) if accum == 1 else (4, (3 * 5 + 3 * 5) * 4)
    comm = step.communication(state, batch)
    assert (comm["total"]["all-reduce"]["count"], comm["total"]["all-reduce"]["bytes"]) == want
    hlo = executed_collectives(step, state, batch, scalars=False)
    assert (hlo["all-reduce"]["buffers"], hlo["all-reduce"]["bytes"]) == want
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params)


def test_equal_gradients_need_the_same_equation_on_the_same_inputs():
    """``a`` and ``b`` get one value (``cos(a + b)`` times the cotangent); ``c`` the same equations on another
    input; ``d`` and ``e`` twice the cotangent by two equations (``2 * ct``, ``ct + ct``): none of these three is
    taken for another's."""
    def loss(p):
        a, b, c, d, e = p
        return jnp.sum(jnp.sin(a + b)) + jnp.sum(jnp.sin(c)) + jnp.sum(d * 2) + jnp.sum(e + e)

    value, bwd = jax.vjp(loss, [jnp.ones(3)] * 5)
    assert equal_grads(jax.make_jaxpr(bwd)(jnp.ones_like(value))) == [None, 0, None, None, None]


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
    _assert_fsdp_table_is_the_hlos(step, state, batch)
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: unshard_params(sharded, st))


def _assert_fsdp_table_is_the_hlos(step, state, batch) -> None:
    """The printed table's all-gathers and reduce-scatters equal the compiled step's (buffers and bytes)."""
    comm = step.communication(state, batch)["total"]
    got = executed_collectives(step, state, batch, scalars=False)
    for kind in ("all-gather", "reduce-scatter"):
        assert (got[kind]["buffers"], got[kind]["bytes"]) == (comm[kind]["count"], comm[kind]["bytes"]), (kind, got,
                                                                                                          comm)


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
    # no full-size copy or transpose of an output-cut kernel (the dim-0 cut gathered transposed has them)
    assert _relayouts(hlo, {(16, 40), (40, 16), (40, 24), (24, 40)}) == {}, _relayouts(hlo, {(16, 40), (40, 24)})
    # the tables are the HLO's, all-gathers too. The forward pass gathers every buffer: each layer's up and down
    # kernels and its biases (40 + 24), the head's kernel and its bias (6, padded to 8). The backward pass
    # re-gathers only the kernels a gradient reads: no bias (its gradient does not read it), nor the first
    # layer's up/kernel (read only for the gradient of the layer's input, the batch): 3 re-gathers
    forward, backward = 2 * 3 + 2, 3
    comm = step.communication(state, batch)["total"]["all-gather"]
    assert (comm["count"], comm["bytes"]) == (forward + backward, 4 * (2 * (16 * 40 + 40 * 24 + 64) + 16 * 6 + 8 * 1
                                                                        + 2 * 40 * 24 + 16 * 40))
    _assert_fsdp_table_is_the_hlos(step, state, batch)
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: unshard_params(sharded, st))

def _relayouts(hlo: str, shapes: set) -> dict:
    """``{(op, shape): n}``: the copies and transposes (``wrapped_copy`` / ``wrapped_transpose`` fusions, bare
    ``copy`` / ``transpose``) of a shape in ``shapes`` that the compiled step runs: its instructions outside
    fused computations (a loop's body once)."""
    found: dict = {}
    inside = False
    for line in hlo.splitlines():
        if line and not line[0].isspace():
            inside = bool(re.match(r"%?(wrapped_|fused_|[\w.\-]*fusion)", line))
        m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]*)\]\{[\d,]*\} (copy|transpose|fusion)\(", line)
        wrapped = re.search(r"calls=%?(wrapped_copy|wrapped_transpose)", line)
        if inside or not m or (m.group(2) == "fusion" and not wrapped):
            continue
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        if shape in shapes:
            key = (wrapped.group(1) if wrapped else m.group(2), shape)
            found[key] = found.get(key, 0) + 1
    return found


class _ScanBlock(nn.Module):
    """Three Dense layers ``[16, 40]``, ``[40, 24]``, ``[24, 16]`` and a residual: a block as ``nn.scan`` runs it."""

    @nn.compact
    def __call__(self, x, _=None):
        h = jnp.tanh(nn.Dense(24, name="mid")(jnp.tanh(nn.Dense(40, name="up")(x))))
        return x + nn.Dense(16, name="down")(h), None


class _Scanned(nn.Module):
    """Two ``_ScanBlock`` under ``nn.scan``, their parameters stacked on ``axis`` (MaxText's 1), then a head."""
    axis: int = 0
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_ScanBlock, prevent_cse=False) if self.remat else _ScanBlock
        x, _ = nn.scan(block, variable_axes={"params": self.axis}, split_rngs={"params": True}, length=2)(
            name="layers")(x)
        return nn.Dense(6, name="head")(x)


def _nnx_models():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.mid = nnx.Linear(16, 40, rngs=rngs), nnx.Linear(40, 24, rngs=rngs)
            self.down = nnx.Linear(24, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.mid(jnp.tanh(self.up(x)))))

    class Listed(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 6, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)
            self.head = nnx.Linear(16, 6, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            return self.head(run(x, self.blocks))

    return Listed, Scanned


# (model, fully_shard's units, the paths of the three kernels up / mid / down of one layer, their stored dim the
# output-dim cut takes)
_CASES = {
    "nnx_list": ("blocks.*", "blocks/0/{}/kernel/value", 1),
    "nnx_scan": ("blocks", "blocks/{}/kernel/value", 2),
    "linen_scan_axis0": ("layers", "layers/{}/kernel", 2),
    "linen_scan_axis1_remat": ("layers", "layers/{}/kernel", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
def test_nnx_and_scanned_kernels_are_cut_on_their_output_dim(case):
    """An nnx model (its blocks a list, or stacked by ``nnx.vmap`` and run under ``nnx.scan``) and a linen
    ``nn.scan`` stack (layer axis 0, or MaxText's 1 under ``nn.remat``), given the example inputs they are called
    on: each kernel ``[in, out]`` (a scan's ``[L, in, out]``, one layer gathered per iteration) is cut over fsdp
    on its output dim, gathered as its shard's transpose and its gradient reduce-scattered from the
    weight-gradient dot's own ``[out, in]`` output: no dot computes a kernel-shaped (transposed) result and no
    full-size copy of a kernel is made (the dim-0 cut had either: 14 ``wrapped_copy`` of the kernels on
    ``tests/zoo/nnx_mlp``, 7 kernel-shaped weight-gradient dots per layer on ``tests/zoo/linen_scan``); trains
    as 1-device SGD does, the compiled all-gathers and reduce-scatters equal to the table."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 6)).astype(np.float32)}
    units, kernel, dim = _CASES[case]
    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    if case.startswith("nnx"):
        from flax import nnx

        model = _nnx_models()[case == "nnx_scan"](nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(m, b):
            return jnp.mean((m(b["x"]) - b["y"]) ** 2)

        def ref_loss(p, b):
            return loss_fn(nnx.merge(graphdef, p, rest, copy=True), b)

        sharded = fully_shard(model, mesh=mesh, units=[units])
        state = init_train_state(sharded, opt, batch["x"][:2])
    else:
        model = _Scanned(axis=1 if "axis1" in case else 0, remat="remat" in case)
        params = model.init(jax.random.key(0), batch["x"])["params"]

        def loss_fn(p, b):
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        ref_loss = loss_fn
        sharded = fully_shard(model, mesh=mesh, units=[units])
        state = init_train_state(sharded, opt, batch["x"][:2], params=params)
    placed = {e.path: e.placements for e in state.plan.entries}
    for name in ("up", "mid", "down"):
        assert placed[kernel.format(name)] == (Shard(dim),), placed
    step = make_train_step(sharded, loss_fn, opt)
    hlo = step.compiled(state, batch).as_text()
    dots = _dot_shapes(hlo)
    assert {(40, 16), (24, 40), (16, 24)} <= dots and not {(16, 40), (40, 24), (24, 16)} & dots, dots
    kernels = {(16, 40), (40, 24), (24, 16)}
    assert _relayouts(hlo, kernels | {k[::-1] for k in kernels}) == {}
    _assert_fsdp_table_is_the_hlos(step, state, batch)
    assert len(state.plan.entries) == len(jax.tree.leaves(params))
    _assert_trains_as_one_device(step, state, batch, ref_loss, opt, params,
                                 final=lambda st: unshard_params(sharded, st))


class _Unread(nn.Module):
    """A Dense and a parameter the model never reads."""

    @nn.compact
    def __call__(self, x):
        self.param("unread", nn.initializers.normal(0.1), (8, 4))
        return nn.Dense(4, name="dense")(x)


def test_the_fsdp_table_leaves_out_the_gather_of_a_parameter_never_read():
    """XLA drops an all-gather whose result nothing reads (``unread``'s, [8, 4]); the table leaves it out too:
    the dense kernel [8, 4] and the flat buffer of its bias are gathered (once: the root unit)."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
    model = _Unread()
    params = model.init(jax.random.key(0), batch["x"])["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    sharded = fully_shard(model, mesh=mesh)
    state = init_train_state(sharded, opt, params=params)
    step = make_train_step(sharded, loss_fn, opt)
    comm = step.communication(state, batch)["total"]
    assert comm["all-gather"] == {"count": 2, "bytes": (8 * 4 + 4) * 4}, comm
    assert comm["reduce-scatter"] == {"count": 2, "bytes": (8 * 4 + 4) * 4}, comm  # unread's gradient: zero
    _assert_fsdp_table_is_the_hlos(step, state, batch)
    _assert_trains_as_one_device(step, state, batch, loss_fn, opt, params, final=lambda st: unshard_params(sharded, st))
