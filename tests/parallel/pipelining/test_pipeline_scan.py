"""Pipeline stages cut from a scanned stack's layer axis: ``pipeline(model, mesh["pp"], units="layers")`` where
``layers`` is one ``nn.scan`` (the layer axis at 0 or at MaxText's 1, with or without ``nn.remat``) or an nnx
``nnx.vmap`` + ``nnx.scan`` stack. Its ``L`` layers go to the ``pp x V`` stages in equal slices, each stage a
scan over its slice (the program does not grow with the depth). 3 SGD steps equal 1-device training within
1e-5 under GPipe, 1F1B, interleaved and looped BFS, with pp alone, pp x dp, pp x fsdp, HSDP and tensor-parallel
stages, in the loop form (``unroll=False``) and with gradient accumulation; the compiled collectives equal the
step's table (each micro-batch crosses each stage boundary once each way); a checkpoint's state is the
model's own tree, the layer axis where the model keeps it."""

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
from spmd._inspect import hlo_collectives
from spmd.parallel import (ColwiseParallel, RowwiseParallel, SplitPoint, fully_shard, hlo_executed_collectives,
                           init_train_state, make_train_step, parallelize_module, pipeline, unshard_params)
from spmd.parallel.pipelining._comm import hlo_permute_pairs
from tests._one_device import assert_trees_close, train_one_device
from tests.third_party.scanned import Block, ScannedMLP, nnx_scanned_mlp

VOCAB = 32
OPT = optax.sgd(0.5)
EXAMPLE = np.zeros((2, 8), np.int32)


def _batch(n=16, t=8):
    tok = np.random.default_rng(0).integers(0, VOCAB, (n, t + 1))
    return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def _ce(logits, b):
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()


def _model(kind: str, depth: int = 4):
    """(model, params or None, the user's loss for a (laid-out) model, the 1-device loss on params)."""
    if kind == "nnx":
        from flax import nnx

        m = nnx_scanned_mlp(vocab=VOCAB, depth=depth)
        graphdef, params = nnx.split(m, nnx.Param)
        return m, None, lambda mod: (lambda mm, b: _ce(mm(b["inputs"]), b)), \
            lambda p, b: _ce(nnx.merge(graphdef, p)(b["inputs"]), b), params
    axis, remat = {"linen0": (0, False), "linen1-remat": (1, True), "linen0-remat": (0, True)}[kind]
    m = ScannedMLP(vocab=VOCAB, depth=depth, axis=axis, remat=remat)
    params = m.init(jax.random.key(0), EXAMPLE)["params"]

    def loss(mod):
        return lambda p, b: _ce(mod.apply({"params": p}, b["inputs"]), b)

    return m, params, loss, loss(m), params


CONFIGS = {  # name: (model kind, mesh dims, schedule, M, stages_per_rank[, {unroll, accum}])
    "linen0-gpipe-pp2dp4": ("linen0", {"pp": 2, "dp": 4}, "gpipe", 2, 1),
    "linen1-remat-1f1b-pp2fsdp4": ("linen1-remat", {"pp": 2, "fsdp": 4}, "1f1b", 2, 1),  # MaxText's axis 1
    "linen0-remat-interleaved-pp2dp4": ("linen0-remat", {"pp": 2, "dp": 4}, "interleaved", 2, 2),
    "linen1-remat-1f1b-pp4": ("linen1-remat", {"pp": 4}, "1f1b", 4, 1),  # pp alone: one layer per stage
    "nnx-1f1b-pp2dp4": ("nnx", {"pp": 2, "dp": 4}, "1f1b", 2, 1),
    "nnx-gpipe-pp2fsdp4": ("nnx", {"pp": 2, "fsdp": 4}, "gpipe", 2, 1),
    "linen0-1f1b-pp2dp2fsdp2": ("linen0", {"pp": 2, "dp": 2, "fsdp": 2}, "1f1b", 2, 1),  # HSDP stages
    # tensor-parallel stages: the layer's up / down cut Megatron's way inside each stage's scan
    "linen1-remat-1f1b-pp2dp2tp2": ("linen1-remat", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 2, 1),
    "linen0-remat-gpipe-pp2fsdp2tp2": ("linen0-remat", {"pp": 2, "fsdp": 2, "tp": 2}, "gpipe", 2, 1),
    "nnx-1f1b-pp2dp2tp2": ("nnx", {"pp": 2, "dp": 2, "tp": 2}, "1f1b", 2, 1),
    # torch's ScheduleLoopedBFS: 2 chunks a rank, GPipe-like
    "linen0-remat-looped_bfs-pp2dp4": ("linen0-remat", {"pp": 2, "dp": 4}, "looped_bfs", 2, 2),
    # the loop form (one fori_loop over the ticks), fsdp and dp
    "linen1-remat-1f1b-pp2fsdp4-loop": ("linen1-remat", {"pp": 2, "fsdp": 4}, "1f1b", 2, 1, {"unroll": False}),
    "linen0-looped_bfs-pp2dp4-loop-accum2": ("linen0", {"pp": 2, "dp": 4}, "looped_bfs", 2, 2,
                                             {"unroll": False, "accum": 2}),
    # gradient accumulation: 2 passes of the schedule a step
    "nnx-1f1b-pp2dp4-accum2": ("nnx", {"pp": 2, "dp": 4}, "1f1b", 2, 1, {"accum": 2}),
    "linen1-remat-gpipe-pp2fsdp4-accum2": ("linen1-remat", {"pp": 2, "fsdp": 4}, "gpipe", 2, 1, {"accum": 2}),
}


def _opts(config) -> tuple[bool, int]:
    """(unroll, accum_steps) of a configuration."""
    extra = CONFIGS[config][5] if len(CONFIGS[config]) > 5 else {}
    return extra.get("unroll", True), extra.get("accum", 1)


def _pipelined(config, opt=OPT):
    kind, dims, sched, m_count, v = CONFIGS[config][:5]
    unroll, accum = _opts(config)
    model, params, loss, _, _ = _model(kind)
    mesh = spmd.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    shard = tuple(d for d in dims if d in ("dp", "fsdp")) if "fsdp" in dims else None  # HSDP: dp and fsdp
    laid = model
    if "tp" in dims:
        laid = parallelize_module(laid, mesh["tp"], {"layers.up": ColwiseParallel(), "layers.down": RowwiseParallel()})
    laid = fully_shard(laid, mesh=mesh[shard], units=["layers"]) if shard else laid
    pm = pipeline(laid, mesh["pp"], units="layers", num_microbatches=m_count, schedule=sched, stages_per_rank=v,
                  unroll=unroll)
    state = init_train_state(pm, opt, EXAMPLE, **({} if params is None else {"params": params}))
    return pm, state, make_train_step(pm, loss(pm), opt, accum_steps=accum)


@functools.lru_cache(maxsize=None)
def _run(config):
    pm, state, step = _pipelined(config)
    batch = _batch()
    text = step.compiled(state, batch).as_text()
    table = step.communication(state, batch)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return dict(pm=pm, losses=losses, params=unshard_params(pm, state), text=text, table=table)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_scanned_stack_stages_equal_one_device_training(config):
    kind, dims, *_ = CONFIGS[config]
    _, _, _, ref_loss, params = _model(kind)
    ref_losses, ref = train_one_device(params, [_batch()] * 3, ref_loss, OPT)
    run = _run(config)
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(run["params"], ref.params, atol=1e-5)  # the model's own tree: the layer axis in place
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it trained
    # the compiled collectives equal the table's; each micro-batch crosses each stage boundary once each way
    unroll, accum = _opts(config)
    got, want = hlo_executed_collectives(run["text"], scalars=False), run["table"]
    for k in ("all-reduce", "all-gather", "reduce-scatter"):
        assert got[k]["bytes"] == want[k]["bytes"], (k, got[k], want[k])
    assert (got["all-gather"]["buffers"], got["reduce-scatter"]["buffers"]) == (
        (want["all-gather"]["buffers"], want["reduce-scatter"]["buffers"]))
    assert (got["all-gather"]["count"] > 0) == ("fsdp" in dims)
    s = run["pm"].schedule
    per_pass = s.num_microbatches * (s.num_stages - 1)
    assert want["collective-permute"]["pairs"] == {"forward": per_pass * accum, "backward": per_pass * accum}
    assert got["collective-permute"]["bytes"] == want["collective-permute"]["bytes"]
    assert got["collective-permute"]["count"] == want["collective-permute"]["count"]
    if unroll:
        n_data = int(np.prod([n for d, n in dims.items() if d != "pp"]))  # each pp group its own pairs (tp too)
        assert hlo_permute_pairs(run["text"], n_data) == 2 * per_pass  # an accumulation's scan: its body once
    else:  # the loop: one permute per direction's distinct pair set, each tick picking its own
        sets = [{tuple(p) for p in s.sends(d) if p} for d in "FB"]
        assert hlo_collectives(run["text"])["collective-permute"]["count"] == sum(map(len, sets))
        assert len(sets[0]) == (2 if s.name == "looped_bfs" else 1)  # a chunk's wrap adds (1, 0) to (0, 1)
        # each counted at every tick (a switch's branches each, a loop's trips each), of every accumulation pass
        assert got["collective-permute"]["count"] == sum(map(len, sets)) * len(s.ticks) * accum


@pytest.mark.slow
def test_a_stage_is_a_scan_over_its_slice():
    """The stages of 4 and of 8 layers lower to programs of one size (each stage scans its slice); the stored
    rows are the layers in stage order, rank-major."""
    sizes = {}
    for depth in (4, 8):
        model = ScannedMLP(vocab=VOCAB, depth=depth, axis=1)
        params = model.init(jax.random.key(0), EXAMPLE)["params"]
        mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="interleaved",
                      stages_per_rank=2)
        state = init_train_state(pm, OPT, EXAMPLE, params=params)
        step = make_train_step(pm, lambda p, b: _ce(model.apply({"params": p}, b["inputs"]), b), OPT)
        text = step.lower(state, _batch()).as_text()
        sizes[depth] = len(re.findall(r"dot_general", text))
        (lay,) = pm._layouts.values()
        per = depth // 4
        # stages 0..3 hold layers [c * per, (c + 1) * per); rank r holds stages r and r + 2
        want = [i for r in range(2) for c in (r, r + 2) for i in range(c * per, (c + 1) * per)]
        assert lay.rows == want and lay.units[:2] == ["layers/0", "layers/1"]
        stored = state.params["stages"]["up/kernel"]
        np.testing.assert_array_equal(np.asarray(stored), np.moveaxis(np.asarray(params["layers"]["up"]["kernel"]),
                                                                       1, 0)[want])
    assert sizes[4] == sizes[8] > 0


@pytest.mark.slow
def test_checkpoint_state_is_the_models_own_tree():
    """``unstack_state`` gives the model's own parameters and AdamW moments (the layer axis at 1, where the
    model stores it), each layer's row as trained; ``stack_state`` lays them out for the pipeline again, bit
    for bit: the checkpoint restores onto an unpipelined layout as any other."""
    opt = optax.adamw(1e-2)
    pm, state, step = _pipelined("linen1-remat-1f1b-pp2fsdp4", opt)
    state, _ = step(state, _batch())
    own = pm.unstack_state(state, opt)
    model, params, *_ = _model("linen1-remat")
    assert jax.tree.map(np.shape, own.params) == jax.tree.map(np.shape, params)
    assert_trees_close(own.params, unshard_params(pm, state), atol=0)
    mu = own.opt_state[0].mu
    assert jax.tree.map(np.shape, mu) == jax.tree.map(np.shape, params)
    # the moment of layer 3 (rank 1's second row) is stored row 3 of the stages
    np.testing.assert_array_equal(np.asarray(mu["layers"]["up"]["kernel"])[:, 3],
                                  np.asarray(state.opt_state[0].mu["stages"]["up/kernel"])[3])
    back = pm.stack_state(own, opt)
    for a, b in zip(jax.tree.leaves((back.params, back.opt_state)), jax.tree.leaves((state.params, state.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the own tree trains on 1 device as the pipeline goes on
    ref_state = optax.adamw(1e-2)
    u, _ = ref_state.update(jax.grad(lambda p: _ce(model.apply({"params": p}, _batch()["inputs"]), _batch()))(
        jax.device_get(own.params)), jax.device_get(own.opt_state), jax.device_get(own.params))
    one = optax.apply_updates(jax.device_get(own.params), u)
    state, _ = step(back, _batch())
    assert_trees_close(unshard_params(pm, state), one, atol=1e-5)


def test_scanned_stack_refusals():
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    model = ScannedMLP(vocab=VOCAB, depth=3, axis=1)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: the scanned stack 'layers' holds L=3 layers, which pp=2 x stages_per_rank=1 = 2 stages do not "
            "divide; each stage runs an equal slice of the layer axis: use a layer count that is a multiple of 2")):
        init_train_state(pipeline(model, mesh["pp"], units="layers", num_microbatches=2), OPT, EXAMPLE, params=params)
    model = ScannedMLP(vocab=VOCAB, depth=4, axis=1)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: units='layers.up' matches 'layers.up', a module of a scanned stack ('layers' runs under nn.scan: "
            "its 4 layers stacked on axis 1 of its parameters); a unit inside a stack is called once per layer. Name "
            "the stack itself (units='layers'")):
        init_train_state(pipeline(model, mesh["pp"], units="layers.up", num_microbatches=2), OPT, EXAMPLE,
                         params=params)
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: split_points={'layers.1': 'SplitPoint.BEGINNING'} with a scanned stack ('layers': 4 layers); its "
            "stages are equal slices of the layer axis")):
        init_train_state(pipeline(model, mesh["pp"], units="layers", num_microbatches=2,
                                  split_points={"layers.1": SplitPoint.BEGINNING}), OPT, EXAMPLE, params=params)
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: units='layers' matches 1 modules (layers), fewer than the 2 stages (pp=2 x stages_per_rank=1); "
            "use fewer stages or a deeper model (a stack under nn.scan or nnx.scan is one module here unless "
            "init_train_state is given the example inputs")):
        init_train_state(pipeline(model, mesh["pp"], units="layers", num_microbatches=2), OPT, params=params)


# --- the layers' other arrays: broadcast into the scan (MaxText's segment ids and positions) ---------------
class _MaskedBlock(nn.Module):
    """A layer as MaxText calls its decoder layers: the activation, then arrays broadcast to every layer."""

    @nn.compact
    def __call__(self, x, mask, pos):
        return x + jnp.tanh(nn.Dense(x.shape[-1], name="dense")(x)) * mask[..., None] + 0.01 * pos[..., None], None


class _MaskedStack(nn.Module):
    per_layer: bool = False  # the positions scanned per layer (in_axes=0) instead of broadcast

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8, name="embed")(tok)
        mask = (tok > 3).astype(jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(tok.shape[1]), tok.shape).astype(jnp.float32)
        if self.per_layer:
            pos = jnp.broadcast_to(pos, (4, *pos.shape))
        x, _ = nn.scan(nn.remat(_MaskedBlock), variable_axes={"params": 1}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, 0 if self.per_layer else nn.broadcast), length=4)(name="layers")(
            x, mask, pos)
        return nn.Dense(VOCAB, name="head")(x)


class _NNXMasked:
    """An nnx stack whose layers take a mask, passed to ``nnx.scan`` broadcast (``in_axes=None``)."""

    @staticmethod
    def build():
        from flax import nnx

        class Block(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(8, 8, rngs=rngs)

            def __call__(self, x, mask):
                return x + jnp.tanh(self.up(x)) * mask[..., None]

        class Stack(nnx.Module):
            def __init__(self, rngs):
                self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)

                @nnx.split_rngs(splits=4)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def make(rngs):
                    return Block(rngs)

                self.layers = make(rngs)
                self.head = nnx.Linear(8, VOCAB, rngs=rngs)

            def __call__(self, tok):
                @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
                def run(x, block, mask):
                    return block(x, mask)

                return self.head(run(self.embed(tok), self.layers, (tok > 3).astype(jnp.float32)))

        return Stack(nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_layers_with_broadcast_arrays_equal_one_device_training(kind):
    """The layers' other arrays (a mask, positions) enter the scan broadcast: each stage computes them again
    from its micro-batch (the scan's inputs in the code before it); 3 SGD steps equal 1-device training."""
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    batch = _batch()
    if kind == "nnx":
        from flax import nnx

        model = _NNXMasked.build()
        graphdef, params = nnx.split(model, nnx.Param)
        ref_losses, ref = train_one_device(params, [batch] * 3, lambda p, b: _ce(nnx.merge(graphdef, p)(b["inputs"]),
                                                                                 b), OPT)
        pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="gpipe")
        state = init_train_state(pm, OPT, EXAMPLE)
        step = make_train_step(pm, lambda mm, b: _ce(mm(b["inputs"]), b), OPT)
    else:
        model = _MaskedStack()
        params = model.init(jax.random.key(0), EXAMPLE)["params"]

        def loss(mod):
            return lambda p, b: _ce(mod.apply({"params": p}, b["inputs"]), b)

        ref_losses, ref = train_one_device(params, [batch] * 3, loss(model), OPT)
        pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="1f1b")
        state = init_train_state(pm, OPT, EXAMPLE, params=params)
        step = make_train_step(pm, loss(pm), OPT)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.05
    (lay,) = pm._layouts.values()
    assert len(lay.calls.side_shapes) == (1 if kind == "nnx" else 2)  # computed again on each stage


def test_a_per_layer_array_is_refused():
    model = _MaskedStack(per_layer=True)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2)
    state = init_train_state(pm, OPT, EXAMPLE, params=params)
    step = make_train_step(pm, lambda p, b: _ce(pm.apply({"params": p}, b["inputs"]), b), OPT)
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: the layers of the scanned stack 'layers' take an array (argument 1 after the activation) that "
            "the scan carries or slices per layer")):
        step.lower(state, _batch())


# --- the user's nn.remat policy inside a stage ----------------------------------------------------------------
class _PolicyStack(nn.Module):
    """A scanned stack whose layers run under ``nn.remat`` with the user's checkpoint policy."""

    policy: object = None
    depth: int = 4

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 16, name="embed")(tok)
        block = nn.remat(Block, prevent_cse=False, policy=self.policy)
        x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth)(
            16, 32, name="layers")(x, None)
        return nn.Dense(VOCAB, name="head")(x)


def _residual_shapes(f, *args) -> list:
    """The shapes of what ``f``'s backward pass saves from its forward, its arguments aside."""
    from jax._src.ad_checkpoint import saved_residuals

    return sorted(tuple(a.shape) for a, why in saved_residuals(f, *args) if not why.startswith("from the argument"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable", "none"])
def test_a_stage_saves_what_the_users_remat_policy_saves(policy):
    """A stage's backward pass runs each layer of its slice under the user's ``nn.remat`` and its policy: the
    chunk saves what the user's own stack of as many layers saves (dots_saveable: each layer's matmul outputs;
    nothing_saveable: only the layers' inputs), not every intermediate of the chunk."""
    pol = {"dots_saveable": jax.checkpoint_policies.dots_saveable,
           "nothing_saveable": jax.checkpoint_policies.nothing_saveable, "none": None}[policy]
    model = _PolicyStack(policy=pol)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="gpipe")
    state = init_train_state(pm, OPT, EXAMPLE, params=params)
    step = make_train_step(pm, lambda p, b: _ce(pm.apply({"params": p}, b["inputs"]), b), OPT)
    st = step._build(state, _batch()).stages
    (lay,) = pm._layouts.values()
    chunk = {rel: jnp.ones((st.lc, *state.params["stages"][rel].shape[1:])) for rel in lay.rel}
    x = jnp.ones(lay.act.shape)
    got = _residual_shapes(lambda p, h: st.chunk(p, 0, 0, h, []), chunk, x)
    # the user's own stack of the chunk's 2 layers, on one device
    own = nn.scan(nn.remat(Block, prevent_cse=False, policy=pol), variable_axes={"params": 0},
                  split_rngs={"params": True}, length=st.lc)(16, 32)
    own_params = own.init(jax.random.key(1), x, None)["params"]
    want = _residual_shapes(lambda p, h: own.apply({"params": p}, h, None)[0], own_params, x)
    assert got == want
    if policy == "dots_saveable":  # each layer's up and down matmul outputs, stacked over the slice's layers
        assert (st.lc, *lay.act.shape[:-1], 32) in got


@pytest.mark.slow
def test_a_remat_policy_stack_equals_one_device_training():
    model = _PolicyStack(policy=jax.checkpoint_policies.dots_saveable)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]

    def loss(mod):
        return lambda p, b: _ce(mod.apply({"params": p}, b["inputs"]), b)

    ref_losses, ref = train_one_device(params, [_batch()] * 3, loss(model), OPT)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="1f1b")
    state = init_train_state(pm, OPT, EXAMPLE, params=params)
    step = make_train_step(pm, loss(pm), OPT)
    losses = []
    for _ in range(3):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params, atol=1e-5)


def test_a_loss_that_never_calls_the_stack_names_the_fix():
    """A loss_fn that never runs the pipelined model's stack (here: its head's weights alone) is refused with
    what to call."""
    model = ScannedMLP(vocab=VOCAB, depth=4)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2)
    state = init_train_state(pm, OPT, EXAMPLE, params=params)
    step = make_train_step(pm, lambda p, b: jnp.mean(p["head"]["kernel"]) * jnp.mean(b["inputs"]), OPT)
    with pytest.raises(ValueError, match=re.escape(
            "pipeline: loss_fn never called the layers of the scanned stack 'layers'; a stage runs the layers "
            "loss_fn calls on the model it is given. Call that model in loss_fn: linen, loss_fn(params, batch) "
            "running model.apply({'params': params}, ...); nnx, loss_fn(model, batch) calling its model argument, "
            "not a model it closes over.")):
        step.lower(state, _batch())


def _nnx_remat_stack(depth: int):
    """An nnx stack whose scan body runs each layer under ``nnx.remat(policy=dots_saveable)``."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)

            self.layers = make(rngs)
            self.head = nnx.Linear(16, VOCAB, rngs=rngs)

        def run_layers(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat(policy=jax.checkpoint_policies.dots_saveable)
            def run(h, layer):
                return layer(h)

            return run(x, self.layers)

        def __call__(self, tok):
            return self.head(self.run_layers(self.embed(tok)))

    return Stack(nnx.Rngs(0))


def test_an_nnx_stage_saves_what_the_users_nnx_remat_policy_saves():
    """``nnx.remat(policy=dots_saveable)`` in the scan's body: a stage's chunk saves what the user's own stack of
    as many layers saves (each layer's matmul outputs), as for linen's ``nn.remat``."""
    from flax import nnx

    model = _nnx_remat_stack(4)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pm = pipeline(model, mesh["pp"], units="layers", num_microbatches=2, schedule="gpipe")
    state = init_train_state(pm, OPT, EXAMPLE)
    step = make_train_step(pm, lambda mm, b: _ce(mm(b["inputs"]), b), OPT)
    st = step._build(state, _batch()).stages
    (lay,) = pm._layouts.values()
    chunk = {rel: jnp.ones((st.lc, *state.params["stages"][rel].shape[1:])) for rel in lay.rel}
    x = jnp.ones(lay.act.shape)
    got = _residual_shapes(lambda p, h: st.chunk(p, 0, 0, h, []), chunk, x)
    own = _nnx_remat_stack(st.lc)  # the user's own stack of the chunk's 2 layers, on one device
    graphdef, own_params = nnx.split(own, nnx.Param)
    want = _residual_shapes(lambda p, h: nnx.merge(graphdef, p).run_layers(h), own_params, x)
    assert got == want == [(st.lc, *lay.act.shape), (st.lc, *lay.act.shape[:-1], 32)]
