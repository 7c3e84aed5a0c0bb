"""The state is the model's: init_train_state, the step and unshard_params check the parameters against the
model and the optimizer state against the optimizer before anything compiles; every bad input to the
training API is a message naming the function, the argument, the value and the fix (linen and nnx)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from models import MLP
from spmd.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, fully_shard, init_train_state,
                           make_train_step, parallelize_module, unshard_params)
from tests.third_party.nnx_mlp import TokenMLP

OPT = optax.adamw(1e-2)
KEY = jax.random.key(0)
X = jnp.asarray(np.random.default_rng(0).integers(0, 8, (8, 4)), jnp.int32)
Y = jnp.asarray(np.random.default_rng(1).integers(0, 8, (8, 2)), jnp.int32)
BATCH = {"x": X, "y": Y}


def owned(*parts: str) -> str:
    """The parts of a message the project writes, in order, anything between them."""
    return "(?s)" + ".*".join(re.escape(p) for p in parts)


@pytest.fixture(scope="module")
def mesh():
    return spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))


def _mlp(depth: int, width: int = 16) -> MLP:
    return MLP(8, 2, hidden=(width,) * depth)


def _loss(model):
    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"]).mean()
    return loss


def _fs(model, mesh):
    return fully_shard(model, mesh=mesh["fsdp"], units=["hidden_*"])


# --- the state is the model's (linen) --------------------------------------------------------------------
def test_a_state_of_a_deeper_model_is_refused_by_the_step(mesh):
    m2, m3 = _mlp(2), _mlp(3)
    state3 = init_train_state(_fs(m3, mesh), OPT, KEY, X)
    step = make_train_step(_fs(m2, mesh), _loss(m2), OPT)
    with pytest.raises(ValueError, match=owned(
            "train_step: state.params is not the parameters of this step's model (its init on the inputs loss_fn "
            "gives it: MLP): at 'hidden_2/bias' the model has nothing, state.params has float32[16] (2 paths differ).",
            "Build the state with init_train_state(model, optimizer, ...) for this step's model")):
        step(state3, BATCH)


@pytest.mark.parametrize("params, path, want, got", [
    ({"width": 32}, "hidden_0/bias", "float32[16]", "float32[32]"),  # flax: ScopeParamShapeError
    ({"drop": "hidden_1"}, "hidden_1/bias", "float32[16]", "nothing"),  # flax: ScopeParamNotFoundError
])
def test_parameters_of_another_width_or_missing_a_module_are_named(mesh, params, path, want, got):
    m2 = _mlp(2)
    p = _mlp(2, params.get("width", 16)).init(KEY, X)["params"]
    if "drop" in params:
        p = {k: v for k, v in p.items() if k != params["drop"]}
    model = fully_shard(m2, mesh=mesh["fsdp"])
    state = init_train_state(model, OPT, params=p)  # no example inputs: the step checks at its first call
    with pytest.raises(ValueError, match=owned(f"train_step: state.params is not the parameters of this step's "
                                               f"model", f"at {path!r} the model has {want}, state.params has {got}",
                                               "init_train_state checks params= at once when it is given the model's "
                                               "example inputs (init_train_state(model, optimizer, x, "
                                               "params=params)): a linen model's parameter shapes follow from its "
                                               "inputs.")):
        make_train_step(model, _loss(m2), OPT)(state, BATCH)
    with pytest.raises(ValueError, match=owned("init_train_state: params= is not this MLP's parameters (MLP.init on "
                                               f"the example inputs): at {path!r} the model has {want}, params= has "
                                               f"{got}", "Pass the parameters of this model")):
        init_train_state(model, OPT, X, params=p)  # with example inputs: checked at once


def test_init_and_unshard_refuse_another_models_tree_once_the_model_is_known(mesh):
    m2, m3 = _mlp(2), _mlp(3)
    fs2 = _fs(m2, mesh)
    state2 = init_train_state(fs2, OPT, KEY, X)  # fs2's parameters are known from here on
    state3 = init_train_state(_fs(m3, mesh), OPT, KEY, X)
    p3 = m3.init(KEY, X)["params"]
    with pytest.raises(ValueError, match=owned("init_train_state: params= is not the parameters of this MLP",
                                               "at 'hidden_2/bias' the model has nothing, params= has float32[16]")):
        init_train_state(fs2, OPT, params=p3)
    with pytest.raises(ValueError, match=owned("unshard_params: params is not the parameters of this MLP",
                                               "at 'hidden_2/bias' the model has nothing, params has float32[16]",
                                               "Pass the state (or its .params) built for this model.")):
        unshard_params(fs2, state3)
    # the model's own state still unshards to the values its init gives (independent: model.init on one device)
    want = m2.init(KEY, X)["params"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 unshard_params(fs2, state2), want)


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_unshard_params_of_a_linen_model_never_initialised_checks_on_example_inputs(mesh, layout):
    """A fresh linen model (no init_train_state, no step: no tree known) checks a state against its init on the
    example inputs unshard_params is given; the model's own state unshards to its init's values."""
    m2, m3 = _mlp(2), _mlp(3)
    dp = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    lay = (lambda m: _fs(m, mesh)) if layout == "fsdp" else (lambda m: m)
    kw = {} if layout == "fsdp" else {"mesh": dp}
    state3 = init_train_state(lay(m3), OPT, KEY, X, **kw)
    with pytest.raises(ValueError, match=owned("unshard_params: params is not this MLP's parameters (MLP.init on the "
                                               "example inputs): at 'hidden_2/bias' the model has nothing, params "
                                               "has float32[16]", "Pass the state (or its .params) built for this "
                                               "model.")):
        unshard_params(lay(_mlp(2)), state3, X)
    state2 = init_train_state(lay(m2), OPT, KEY, X, **kw)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 unshard_params(lay(_mlp(2)), state2, X), m2.init(KEY, X)["params"])


@pytest.mark.slow
def test_a_hugging_face_model_checks_params_at_init_against_the_params_it_holds(mesh):
    """A Hugging Face Flax model holds its parameters (.params): init_train_state(params=...) and unshard_params
    compare with them at once, no example inputs needed; the model's own parameters go through unchanged."""
    transformers = pytest.importorskip("transformers")

    def gpt2(layers):
        cfg = transformers.GPT2Config(vocab_size=8, n_positions=8, n_embd=16, n_layer=layers, n_head=2)
        return transformers.FlaxGPT2LMHeadModel(cfg, seed=0)

    h2, h3 = gpt2(2), gpt2(3)
    fs2 = fully_shard(h2, mesh=mesh["fsdp"], units=["transformer.h.*"])
    with pytest.raises(ValueError, match=owned("init_train_state: params= is not this FlaxGPT2LMHeadModel's "
                                               "parameters (its .params): at 'transformer/h/2/", "the model has "
                                               "nothing, params= has float32[")):
        init_train_state(fs2, OPT, params=h3.params)
    state3 = init_train_state(fully_shard(h3, mesh=mesh["fsdp"], units=["transformer.h.*"]), OPT, params=h3.params)
    with pytest.raises(ValueError, match=owned("unshard_params: params is not this FlaxGPT2LMHeadModel's parameters "
                                               "(its .params): at 'transformer/h/2/")):
        unshard_params(fully_shard(gpt2(2), mesh=mesh["fsdp"], units=["transformer.h.*"]), state3)
    state2 = init_train_state(fs2, OPT, params=h2.params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 unshard_params(fs2, state2), h2.params)


def test_unshard_params_of_a_pipeline_takes_no_example_inputs():
    from spmd.parallel import pipeline

    pp = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    pm = pipeline(_mlp(2), pp, units="hidden_*", num_microbatches=2)
    with pytest.raises(TypeError, match=re.escape("unshard_params: PipelineModule checks the parameters against its "
                                                  "own layouts; give it no example inputs")):
        unshard_params(pm, {}, X)


def test_an_optimizer_other_than_the_states_is_refused(mesh):
    m2 = _mlp(2)
    model = _fs(m2, mesh)
    state = init_train_state(model, OPT, KEY, X)
    step = make_train_step(model, _loss(m2), optax.chain(optax.clip(1.0), optax.adamw(1e-2)))
    with pytest.raises(ValueError, match=owned(
            "train_step: state.opt_state was not made by this step's optimizer (at '0/count' optimizer.init(params) "
            "gives nothing, state.opt_state has int32[]); build the state with init_train_state(model, optimizer, "
            "...) given the same optimizer as make_train_step.")):
        step(state, BATCH)


def test_the_model_check_runs_once_per_plan(mesh, monkeypatch):
    from spmd.parallel.step import _model_checks

    calls = []
    real = _model_checks.traced_model_params
    monkeypatch.setattr(_model_checks, "traced_model_params", lambda *a: calls.append(1) or real(*a))
    m2 = _mlp(2)
    model = fully_shard(m2, mesh=mesh["fsdp"])
    state = init_train_state(model, OPT, KEY, X)
    step = make_train_step(model, _loss(m2), OPT)
    for _ in range(3):
        state, _ = step(state, BATCH)
    assert len(calls) == 1


# --- a tree that is not a parameter tree at all -----------------------------------------------------------
@pytest.mark.parametrize("params, exc, msg", [
    (lambda p: {"w": jnp.zeros(3)}, ValueError,
     "init_train_state: fully_shard's unit 'hidden_*' matches no module of params=, and params= holds no module's "
     "parameters (its leaves: ['w']); it is not this model's parameter tree: pass model.init(rng, x)['params']."),
    (lambda p: {"params": p}, ValueError,
     "init_train_state: params= is the variables dict model.init returns (keys ['params']), not its parameters: "
     "pass variables['params']."),
    (lambda p: [p], ValueError,
     "init_train_state: params= is a list of 1 entries; a model's parameters are the tree model.init(rng, "
     "x)['params'] itself"),
], ids=["no module", "variables dict", "list"])
def test_a_tree_that_is_not_the_models_says_so(mesh, params, exc, msg):
    m2 = _mlp(2)
    with pytest.raises(exc, match=re.escape(msg)):
        init_train_state(_fs(m2, mesh), OPT, params=params(m2.init(KEY, X)["params"]))


def test_an_int_rng_is_refused_wherever_the_api_takes_one(mesh):
    from spmd.parallel import pipeline

    msg = re.escape("init_train_state: rng=0 (the first of init_args, (rng, *example_inputs)) must be a JAX PRNG "
                    "key: jax.random.key(0)")
    with pytest.raises(TypeError, match=msg):
        init_train_state(_fs(_mlp(2), mesh), OPT, 0, X)
    with pytest.raises(TypeError, match=msg):
        init_train_state(_mlp(2), OPT, 0, X, mesh=mesh)
    pp = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))["pp"]
    with pytest.raises(TypeError, match=msg):
        init_train_state(pipeline(_mlp(2), pp, units="hidden_*", num_microbatches=2), OPT, 0, X)


# --- the step's inputs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(mesh):
    m2 = _mlp(2)
    model = _fs(m2, mesh)
    return m2, model, init_train_state(model, OPT, KEY, X)


@pytest.mark.parametrize("loss, batch, exc, msg", [
    (lambda f: (lambda p, b: jnp.sum(b["x"])), BATCH, TypeError,
     "make_train_step: loss_fn returned a loss of dtype int32; the loss is differentiated, so it must be a float: "
     "return loss.astype(jnp.float32)"),
    (lambda f: (lambda p, b: (f(p, b), {"acc": jnp.ones(3)})), BATCH, ValueError,
     "make_train_step: loss_fn's aux['acc'] has shape (3,); aux metrics are scalars (averaged over the data dims): "
     "return e.g. aux['acc'].mean()"),
    (lambda f: f, {"x": X, "y": Y[:4]}, ValueError,
     "train_step: every batch leaf needs the same leading (batch) dim: batch['x'] has shape (8, 4) but batch['y'] "
     "has (4, 2); give every field the batch's 8 rows."),
    (lambda f: f, {"x": np.asarray(X).tolist(), "y": np.asarray(Y).tolist()}, TypeError,
     "train_step: batch['x'][0][0]=6 is a Python int, not an array (a batch of Python lists?); give arrays:"),
], ids=["int loss", "vector aux", "leading dims", "python lists"])
def test_bad_step_inputs(trained, loss, batch, exc, msg):
    m2, model, state = trained
    with pytest.raises(exc, match=re.escape(msg)):
        make_train_step(model, loss(_loss(m2)), OPT)(state, batch)


# --- unshard_params under DDP (a model with no layout, mesh=) --------------------------------------------
def test_unshard_params_of_a_plain_model_under_ddp(mesh):
    m2 = _mlp(2)
    state = init_train_state(m2, OPT, KEY, X, mesh=mesh)
    want = m2.init(KEY, X)["params"]
    for got in (unshard_params(m2, state.params), unshard_params(m2, state)):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    with pytest.raises(ValueError, match=re.escape("unshard_params: these parameters were not laid out by "
                                                   "init_train_state(model, ...)")):
        unshard_params(m2, init_train_state(_fs(m2, mesh), OPT, KEY, X).params)  # fsdp shards, not the DDP layout


# --- parallelize_module's plan ---------------------------------------------------------------------------
class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="up")(nn.LayerNorm(name="ln")(x))
        return x + nn.Dense(16, name="down")(nn.relu(h))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Embed(8, 16, name="embed")(x)
        for i in range(2):
            x = _Block(name=f"block_{i}")(x)
        return nn.Dense(8, name="head")(x)


@pytest.mark.parametrize("plan, msg", [
    ({"block_*.ln": ColwiseParallel()},
     "parallelize_module: ColwiseParallel on 'block_0.ln' (plan key 'block_*.ln'): the style cuts a module's own "
     "kernel of 2 or more dims (Dense, DenseGeneral, nnx Linear) or an Embed table, and 'block_0.ln' holds bias, "
     "scale (a norm's parameters stay whole: SequenceParallel() runs it on the sequence shards); no module under it "
     "has one; drop the key."),
    ({"block_*": RowwiseParallel()},
     "parallelize_module: RowwiseParallel on 'block_0' (plan key 'block_*'): the style cuts a module's own kernel "
     "of 2 or more dims (Dense, DenseGeneral, nnx Linear) or an Embed table, and 'block_0' holds no parameter of its "
     "own (a container); the modules under it that RowwiseParallel can cut: block_0.down, block_0.up; key those "
     "instead (e.g. 'block_0.down': RowwiseParallel())."),
    ({"block_*.up": ColwiseParallel(), "block_0.up": RowwiseParallel(), "block_*.ln": SequenceParallel()},
     "parallelize_module: plan keys 'block_*.up' and 'block_0.up' both match module 'block_0.up'; a module takes "
     "one style (torch would apply both, the second over the first's layout): narrow one of the globs or drop one "
     "key."),
], ids=["norm", "container", "two keys"])
def test_a_plan_the_styles_cannot_run_is_refused_before_anything_runs(mesh2x4, plan, msg):
    net = _Net()
    with pytest.raises(ValueError, match=re.escape(msg)):
        init_train_state(parallelize_module(net, mesh2x4["tp"], plan), OPT, params=net.init(KEY, X)["params"])


# --- nnx ---------------------------------------------------------------------------------------------------
def _nnx_loss(m, b):
    return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["t"]).mean()


def test_nnx_a_state_of_another_model_is_refused_everywhere(mesh):
    m2, m3 = TokenMLP(depth=2, rngs=nnx.Rngs(0)), TokenMLP(depth=3, rngs=nnx.Rngs(0))
    f2 = fully_shard(m2, mesh=mesh["fsdp"], units=["blocks.*"])
    state3 = init_train_state(fully_shard(m3, mesh=mesh["fsdp"], units=["blocks.*"]), OPT)
    where = "at 'blocks/2/down/bias' the model has nothing"
    with pytest.raises(ValueError, match=owned("train_step: state.params is not this step's TokenMLP parameters "
                                               "(nnx.state(model, nnx.Param))", where, "state.params has float32[32]")):
        make_train_step(f2, _nnx_loss, OPT)(state3, {"x": X, "t": X})
    with pytest.raises(ValueError, match=owned("init_train_state: params= is not this TokenMLP's parameters", where,
                                               "params= has float32[32]")):
        init_train_state(f2, OPT, params=nnx.state(m3, nnx.Param))
    with pytest.raises(ValueError, match=owned("unshard_params: params is not this TokenMLP's parameters", where)):
        unshard_params(f2, state3)


def test_nnx_unshard_params_of_a_plain_model_under_ddp(mesh):
    m2 = TokenMLP(depth=2, rngs=nnx.Rngs(0))
    want = jax.tree.map(np.asarray, nnx.state(m2, nnx.Param))
    state = init_train_state(m2, OPT, mesh=mesh)
    got = unshard_params(m2, state.params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, want)


@pytest.mark.slow  # importing transformers and building two models: ~30 s here
def test_a_hugging_face_model_checks_its_state_too():
    transformers = pytest.importorskip("transformers")
    mesh8 = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))

    def gpt2(n_layer):
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=n_layer, n_head=4)
        return fully_shard(transformers.FlaxGPT2LMHeadModel(cfg, seed=0), mesh=mesh8, units=["transformer.h.*"])

    one, two = gpt2(1), gpt2(2)
    state2 = init_train_state(two, OPT, params=two.params)
    step = make_train_step(one, lambda p, b: one(b["x"], params=p).logits.mean(), OPT)
    with pytest.raises(ValueError, match=owned("train_step: state.params is not the parameters of this step's model "
                                               "(its init on the inputs loss_fn gives it: FlaxGPT2LMHeadModule): at "
                                               "'transformer/h/1/attn/c_attn/bias' the model has nothing, "
                                               "state.params has float32[96]")):
        step(state2, {"x": jnp.zeros((8, 8), jnp.int32)})
