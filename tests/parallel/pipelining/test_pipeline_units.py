"""Pipeline units that differ by a static attribute (a local-attention window on every other block, GPT-Neo's
alternating global / local attention) run as themselves: the step never substitutes one unit's module for
another's. Each trains equal to 1-device training within 1e-5 (its compiled collectives equal to the
table); what cannot run so is refused, naming both units and the attribute."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from placements import Replicate
from spmd.parallel import (ColwiseParallel, RowwiseParallel, hlo_executed_collectives, init_train_state,
                           make_train_step, parallelize_module, pipeline, unshard_params)
from tests._one_device import assert_trees_close, train_one_device

VOCAB = 32


class Block(nn.Module):
    """Causal attention; ``window``: each position sees only the last ``window`` positions (GPT-Neo's local
    attention), a static attribute that changes the program, not the parameters."""
    window: int | None = None

    @nn.compact
    def __call__(self, x):
        t = x.shape[1]
        q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
        i, j = np.arange(t)[:, None], np.arange(t)[None]
        mask = (j <= i) & ((i - j < self.window) if self.window is not None else True)
        a = jax.nn.softmax(jnp.where(mask, q @ k.swapaxes(1, 2), -1e9), -1)
        return x + a @ v


class Net(nn.Module):
    windows: tuple

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8)(tok)
        for i, w in enumerate(self.windows):
            x = Block(w, name=f"layers_{i}")(x)
        return nn.Dense(VOCAB)(x)


def _batch(n=8, t=8):
    tok = np.random.default_rng(0).integers(0, VOCAB, (n, t + 1))
    return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def _setup(windows, **kw):
    m = Net(windows)
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(m.apply({"params": p}, b["inputs"]), b["targets"]).mean()

    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(m, mesh["pp"], units="layers_*", num_microbatches=2, **kw)
    return m, params, loss, pm


@pytest.mark.slow
@pytest.mark.parametrize("windows", [(None, 2, None, 2),  # each stage slot holds one kind on every rank
                                     (None, None, 2, 2)])  # slot 0: global on rank 0, local on rank 1 (a switch)
def test_units_that_differ_train_equal_to_one_device(windows):
    m, params, loss, pm = _setup(windows)
    opt = optax.sgd(0.5)
    batches = [_batch()] * 3
    ref_losses, ref = train_one_device(params, batches, loss, opt)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss, opt)
    got = hlo_executed_collectives(step.compiled(state, _batch()).as_text(), scalars=False)
    want = step.communication(state, _batch())
    for kind in ("collective-permute", "all-reduce", "all-gather", "reduce-scatter"):
        assert got[kind]["bytes"] == want[kind]["bytes"], kind
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it trained
    # a stage running the first unit's module for every unit is off by far more than the tolerance
    uniform_losses, _ = train_one_device(params, batches, lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
        Net((windows[0],) * 4).apply({"params": p}, b["inputs"]), b["targets"]).mean(), opt)
    assert abs(uniform_losses[-1] - ref_losses[-1]) > 1e-3


class _Repeat(nn.Module):
    """A block that applies its one projection ``times`` times: the same parameters, other tp calls."""
    times: int = 1

    @nn.compact
    def __call__(self, x):
        up = nn.Dense(8, name="up")
        for _ in range(self.times):
            x = x + up(x)
        return x


class _RepeatNet(nn.Module):
    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8)(tok)
        for i, t in enumerate((1, 2, 1, 2)):
            x = _Repeat(t, name=f"layers_{i}")(x)
        return nn.Dense(VOCAB)(x)


def test_tp_stages_of_units_that_differ_in_their_tp_calls_are_refused():
    m = _RepeatNet()
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    tm = parallelize_module(m, mesh["tp"], {"layers_*.up": ColwiseParallel(output_layouts=Replicate())})
    pm = pipeline(tm, mesh["pp"], units="layers_*", num_microbatches=2)
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, lambda p, b: m.apply({"params": p}, b["inputs"]).mean(), opt)
    with pytest.raises(ValueError, match=re.escape("units 'layers_0' and 'layers_1' differ (times=1 vs 2) and make "
                                                   "other tensor-parallel calls")):
        step.communication(state, _batch())


def test_units_with_other_parameters_are_refused():
    class Wide(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(VOCAB, 8)(tok)
            x = x + nn.Dense(8, name="layers_0")(x)
            x = x + nn.Dense(8, use_bias=False, name="layers_1")(x)
            return x.sum()

    m = Wide()
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(m, mesh["pp"], units="layers_*", num_microbatches=2)
    with pytest.raises(ValueError, match=re.escape("unit 'layers_1' has other parameters than 'layers_0'")):
        init_train_state(pm, optax.sgd(0.1), params=params)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [False, True])
def test_hf_gpt_neo_alternating_global_and_local_attention_equals_one_device(tp):
    """Hugging Face's Flax GPT-Neo (random init, no download): its blocks differ by ``layer_id`` (global and
    local attention alternate), two kinds; interleaved, rank 0 holds the global blocks and rank 1 the local
    (each stage slot a switch over both). With tp (``pp=2,dp=2,tp=2``, Megatron's MLP cut): the program holds
    the unit's styled calls once per kind, and the table counts them so."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=16, hidden_size=16, num_layers=4,
                                    num_heads=2, attention_types=[[["global", "local"], 2]], window_size=2,
                                    intermediate_size=32, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
    hf = transformers.FlaxGPTNeoForCausalLM(cfg, seed=0)

    def loss(mod):
        return lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
            mod(b["inputs"], params=p).logits, b["targets"]).mean()

    opt = optax.sgd(0.5)
    batches = [_batch()] * 3
    ref_losses, ref = train_one_device(hf.params, batches, loss(hf), opt)
    if tp:
        mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        model = parallelize_module(hf, mesh["tp"], {"transformer.h.*.mlp.c_fc": ColwiseParallel(),
                                                    "transformer.h.*.mlp.c_proj": RowwiseParallel()})
    else:
        mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        model = hf
    pm = pipeline(model, mesh["pp"], units="transformer.h.*", num_microbatches=2, schedule="interleaved",
                  stages_per_rank=2)
    state = init_train_state(pm, opt, params=hf.params)
    step = make_train_step(pm, loss(pm), opt)
    got = hlo_executed_collectives(step.compiled(state, _batch()).as_text(), scalars=False)
    want = step.communication(state, _batch())
    for kind in ("collective-permute", "all-reduce", "all-gather", "reduce-scatter"):
        assert got[kind]["bytes"] == want[kind]["bytes"], kind
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.05


@pytest.mark.slow
def test_nnx_units_that_differ_train_equal_to_one_device():
    """An nnx model whose blocks differ by a static attribute (the activation's name): relu, gelu, relu, gelu."""
    from flax import nnx

    class MlpBlock(nnx.Module):
        def __init__(self, act: str, *, rngs):
            self.act = act
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return x + self.down(getattr(jax.nn, self.act)(self.up(x)))

    class Mlp(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
            self.blocks = nnx.List([MlpBlock(a, rngs=rngs) for a in ("relu", "gelu", "relu", "gelu")])
            self.head = nnx.Linear(8, VOCAB, rngs=rngs)

        def __call__(self, tok):
            x = self.embed(tok)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def ce(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    m = Mlp(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m, nnx.Param)
    opt = optax.sgd(0.5)
    batches = [_batch()] * 3
    ref_losses, ref = train_one_device(params, batches, lambda p, b: ce(nnx.merge(graphdef, p)(b["inputs"]), b), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(m, mesh["pp"], units="blocks.*", num_microbatches=2, schedule="interleaved", stages_per_rank=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, lambda mod, b: ce(mod(b["inputs"]), b), opt)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    assert next(iter(pm._layouts.values())).calls.kind_of == [0, 1, 0, 1]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.05


def test_batch_leaves_without_a_common_leading_dim_are_refused_by_path():
    _, params, loss, pm = _setup((None,) * 4)
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss, opt)
    batch = {**_batch(), "mask": np.ones((8,), np.float32)[None]}  # [1, 8]: one row for all
    with pytest.raises(ValueError, match=re.escape("train_step: batch['mask'] has shape (1, 8), and batch['inputs'] "
                                                   "(8, 8); a pipelined step cuts every batch leaf")):
        step.lower(state, batch)


def test_nnx_units_that_differ_by_a_private_attribute_run_as_themselves():
    """Blocks that differ only by an attribute whose name starts with '_' (a private scale, 1.0 / 0.5 / 1.0 / 0.5)
    are still different units: the grouping reads the units' graph definitions, not their public names."""
    from flax import nnx

    class ScaledBlock(nnx.Module):
        def __init__(self, scale: float, *, rngs):
            self._scale = scale
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return x + self._scale * self.down(jax.nn.relu(self.up(x)))

    class Mlp(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
            self.blocks = nnx.List([ScaledBlock(s, rngs=rngs) for s in (1.0, 0.5, 1.0, 0.5)])
            self.head = nnx.Linear(8, VOCAB, rngs=rngs)

        def __call__(self, tok):
            x = self.embed(tok)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def ce(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    m = Mlp(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m, nnx.Param)
    opt = optax.sgd(0.5)
    batches = [_batch()] * 3
    ref_losses, ref = train_one_device(params, batches, lambda p, b: ce(nnx.merge(graphdef, p)(b["inputs"]), b), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(m, mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, lambda mod, b: ce(mod(b["inputs"]), b), opt)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    assert next(iter(pm._layouts.values())).calls.kind_of == [0, 1, 0, 1]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
