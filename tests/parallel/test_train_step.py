"""``make_train_step`` returns a ``TrainStep`` for every layout (plain DDP, FSDP, a pipeline): its ``memory`` is
the compiled step's ``memory_analysis()``, its ``table`` prints the plan and the communication; a user's own
``OwnsTrainStep`` layout gets ``init_train_state`` / ``make_train_step`` / ``unshard_params`` handed to it."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import (OwnsTrainStep, StepMemory, TrainState, TrainStep, fully_shard, hlo_executed_collectives,
                           init_train_state, make_train_step, parallelize_module, pipeline, unshard_params)

OPT = optax.adam(1e-2)
WIDTH = 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(WIDTH)(x))


class Tiny(nn.Module):
    """embed, two chained blocks (the units), head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        for i in range(2):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(1, name="head")(x)[:, 0]


def _loss(model):
    return lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((16, 4)).astype(np.float32), "y": rng.standard_normal(16).astype(np.float32)}


def _params():
    return jax.jit(lambda r: Tiny().init(r, _batch()["x"])["params"])(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _laid(layout):
    """``(model as laid out, mesh= for the step)``: plain (DDP on dp=8), FSDP (fsdp=8, units the blocks), a
    pipeline (pp=2 x dp=2, 1F1B over 2 micro-batches)."""
    model = Tiny()
    if layout == "plain":
        return model, spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    if layout == "fsdp":
        mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
        return fully_shard(model, mesh=mesh, units=["layers_*"]), None
    mesh = spmd.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return pipeline(model, mesh["pp"], units="layers_*", num_microbatches=2, schedule="1f1b"), None


@pytest.mark.parametrize("layout", ["plain", "fsdp", "pipeline"])
def test_train_step_memory_table_and_call(layout):
    laid, mesh = _laid(layout)
    step = make_train_step(laid, _loss(Tiny()), OPT, mesh=mesh)
    assert isinstance(step, TrainStep)
    state, batch = init_train_state(laid, OPT, params=_params(), mesh=mesh), _batch()

    # memory: the figures of the step compiled here, read straight off XLA's memory_analysis()
    compiled = step.lower(state, batch).compile()
    m = compiled.memory_analysis()
    want = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                alias=m.alias_size_in_bytes)
    got = step.memory(state, batch)
    assert isinstance(got, StepMemory)
    assert (got.argument, got.output, got.temp, got.alias) == tuple(want.values())
    assert got.peak == want["argument"] + want["output"] + want["temp"] - want["alias"]
    assert got.as_dict() == {**want, "peak": got.peak}

    # table: the plan's table, then the communication, whose parameter collectives the compiled step runs
    comm = step.communication(state, batch)
    table = step.table(state, batch)
    assert table.startswith(state.plan.table() + "\n")
    hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
    if layout == "pipeline":
        # M x (stages - 1) transfers each way: 2 forward, 2 backward, one collective-permute each (unrolled)
        cp = comm["collective-permute"]
        assert cp["pairs"] == {"forward": 2, "backward": 2}
        assert cp["count"] == hlo["collective-permute"]["count"] == 4
        assert str(laid.schedule) in table
        assert "2 activation + 2 gradient transfers" in table and "in 4 collective-permutes" in table
    else:
        kinds = {"plain": ["all-reduce"], "fsdp": ["all-gather", "reduce-scatter"]}[layout]
        total = comm["total"]
        for kind in kinds:  # XLA combines buffers into fewer collectives: count the buffers
            assert (total[kind]["count"], total[kind]["bytes"]) == (hlo[kind]["buffers"], hlo[kind]["bytes"]), kind
            assert total[kind]["count"] > 0
        line = next(ln for ln in table.splitlines() if ln.startswith("step communication per device: "))
        assert line == "step communication per device: " + ", ".join(
            f"{k} x{v['count']} = {v['bytes']:,} B" for k, v in total.items() if v["count"])

    # the call runs the program lowered above: one step, the state advanced
    new, metrics = step(state, batch)
    assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))


# --- a user's own layout: the protocol, written here as a user would ------------------------------------------
class Replicated(OwnsTrainStep):
    """A user's layout owning its step: every parameter whole on every device of a 1-D mesh, the gradient
    averaged by ``jax.jit`` (no library step inside). It records which of its methods ran."""

    def __init__(self, model, mesh):
        self.model, self.mesh, self.calls = model, mesh, []

    def init_train_state(self, optimizer, *init_args, params=None, mesh=None):
        self.calls.append("init_train_state")
        rep = jax.sharding.NamedSharding(self.mesh.jax_mesh, jax.sharding.PartitionSpec())
        params = jax.device_put(params, rep)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    def make_train_step(self, loss_fn, optimizer, *, accum_steps=1, mesh=None):
        self.calls.append("make_train_step")
        return ReplicatedStep(self, loss_fn, optimizer)

    def unshard_params(self, params):
        self.calls.append("unshard_params")
        return params.params if isinstance(params, TrainState) else params


class ReplicatedStep(TrainStep):
    def __init__(self, layout, loss_fn, optimizer):
        self.layout = layout

        def step(state, batch):
            loss, g = jax.value_and_grad(loss_fn)(state.params, batch)
            updates, opt_state = optimizer.update(g, state.opt_state, state.params)
            return (TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                               opt_state=opt_state), {"loss": loss, "grad_norm": optax.tree.norm(g)})

        self.jitted = jax.jit(step)

    def __call__(self, state, batch):
        return self.jitted(state, batch)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch)

    def communication(self, state, batch):
        return {"total": {}}

    def table(self, state, batch):
        return "replicated: no communication"


def test_a_users_own_layout_is_dispatched_to():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    laid = Replicated(Tiny(), mesh)
    loss = _loss(Tiny())
    state = init_train_state(laid, OPT, params=_params())
    step = make_train_step(laid, loss, OPT)
    assert isinstance(step, ReplicatedStep) and step.layout is laid
    state, _ = step(state, _batch())
    got = unshard_params(laid, state)
    assert laid.calls == ["init_train_state", "make_train_step", "unshard_params"]
    # one adam step from the same start on one device, as a reference
    @jax.jit
    def one_step(p0):
        updates, _ = OPT.update(jax.grad(loss)(p0, _batch()), OPT.init(p0), p0)
        return optax.apply_updates(p0, updates)

    want = one_step(_params())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), got, want)
    # memory and compiled come from the user's lower()
    m = step.lower(state, _batch()).compile().memory_analysis()
    assert step.memory(state, _batch()).temp == m.temp_size_in_bytes

    # check_finite wraps the user's step and keeps its own attributes
    checked = make_train_step(laid, loss, OPT, check_finite="skip")
    assert isinstance(checked, TrainStep) and checked.layout is laid
    bad = {**_batch(), "y": np.full(16, np.nan, np.float32)}
    after, metrics = checked(state, bad)
    assert float(metrics["nonfinite"]) == 1.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), after.params, state.params)
    assert checked.table(state, bad) == "replicated: no communication"

    # the transforms refuse it (apply them to the model first), naming the transform
    with pytest.raises(ValueError, match=re.escape("fully_shard: model=") + ".*" + re.escape(
            "apply fully_shard to the plain model first")):
        fully_shard(laid, mesh=mesh)
    with pytest.raises(ValueError, match=re.escape("parallelize_module: model=")):
        parallelize_module(laid, mesh, {})


def test_own_layout_step_must_be_a_train_step():
    class Bad(Replicated):
        def make_train_step(self, loss_fn, optimizer, *, accum_steps=1, mesh=None):
            return lambda state, batch: (state, {})

    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    with pytest.raises(TypeError, match=re.escape("make_train_step: Bad.make_train_step returned function; an "
                                                  "OwnsTrainStep layout's make_train_step must return a "
                                                  "spmd.parallel.TrainStep")):
        make_train_step(Bad(Tiny(), mesh), _loss(Tiny()), OPT)


def test_step_memory_of_a_program_without_memory_analysis_is_a_clear_error():
    class NoAnalysis:
        def memory_analysis(self):
            return None  # what jax.stages.Compiled gives where the backend has none

    with pytest.raises(ValueError, match=re.escape("StepMemory.from_compiled: compiled=NoAnalysis.memory_analysis() "
                                                   "is None: this backend or compiler gives no memory analysis")):
        StepMemory.from_compiled(NoAnalysis())


def test_a_step_is_traced_once_where_prepare_changes_nothing():
    """``prepare`` reads which FSDP gathers to transpose and how the model splits its tp-cut projections into
    heads off one trace of the step; where neither changes the step (8 heads over tp=4, FSDP gathers the plan
    already knows), lowering it and its communication table reuse that trace. The state's check against the
    model (once per plan, as the step's own call does since 523dc71) traces the loss once more: two in all."""
    from models import Transformer
    from models._plans import layout_model

    model = Transformer(vocab_size=8, max_len=4, num_layers=2, d_model=16, num_heads=8, mlp_ratio=2)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("fsdp", "tp"))
    laid = layout_model(model, mesh, sequence_parallel=False)
    tokens = np.random.default_rng(0).integers(0, 8, (8, 4)).astype(np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    params = jax.eval_shape(lambda r: model.init(r, tokens)["params"], jax.random.key(0))
    state = jax.eval_shape(lambda: init_train_state(laid, OPT, tokens, params=params))
    calls = []

    def loss_fn(p, b):
        calls.append(1)
        logits = laid.apply({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    step = make_train_step(laid, loss_fn, OPT)
    step.lower(state, batch)
    step.communication(state, batch)
    assert len(calls) == 2


def _per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays on device 0 (its own shard of each), counted from the arrays."""
    return sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
               for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("layout", ["plain", "fsdp", "pipeline"])
def test_a_donating_step_holds_its_state_once_and_trains_as_the_other(layout):
    """``donate=True``: the step writes its new state into the old one's buffers: ``memory_analysis()``'s alias
    is the state's bytes on a device (parameters, optimizer state, step counter: counted from the arrays), which
    the step that does not donate holds twice (alias 0), and the state passed in is deleted; the training is the
    same, step for step."""
    laid, mesh = _laid(layout)
    kept, donated = (make_train_step(laid, _loss(Tiny()), OPT, mesh=mesh, donate=d) for d in (False, True))
    new = lambda: init_train_state(laid, OPT, params=_params(), mesh=mesh)  # noqa: E731
    s_kept, s_don, batch = new(), new(), _batch()
    state_bytes = _per_device_bytes((s_don.step, s_don.params, s_don.opt_state))
    m_kept, m_don = kept.memory(s_kept, batch), donated.memory(s_don, batch)
    assert m_kept.alias == 0 and m_don.alias == state_bytes > 0, (m_kept, m_don, state_bytes)
    assert m_don.argument == m_kept.argument and m_don.peak == m_don.argument + m_don.output + m_don.temp - m_don.alias
    for _ in range(2):
        before = jax.tree.leaves(s_don.params)
        (s_kept, mk), (s_don, md) = kept(s_kept, batch), donated(s_don, batch)
        assert all(x.is_deleted() for x in before)
        assert float(md["loss"]) == float(mk["loss"])
    for a, b in zip(jax.tree.leaves(s_kept.params), jax.tree.leaves(s_don.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_donate_is_refused_with_check_finite_true_and_off_a_bool():
    laid, mesh = _laid("plain")
    with pytest.raises(ValueError, match=re.escape("make_train_step: donate=True with check_finite=True")):
        make_train_step(laid, _loss(Tiny()), OPT, mesh=mesh, donate=True, check_finite=True)
    with pytest.raises(TypeError, match=re.escape("make_train_step: donate='yes' must be a bool")):
        make_train_step(laid, _loss(Tiny()), OPT, mesh=mesh, donate="yes")
    make_train_step(laid, _loss(Tiny()), OPT, mesh=mesh, donate=True, check_finite="skip")  # the skip is in the step
