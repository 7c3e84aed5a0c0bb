"""A loss that reads what the pipeline's units sow (linen's ``self.sow("intermediates", ...)``, nnx's
``nnx.Intermediate``: an MoE block's load-balancing term) is refused when the step is built, naming the unit and
the sown name: the units run on their stages apart from ``loss_fn``, which would train without the term. A loss
that asks for the collection without reading it trains as on one device; an aux metric reading a sown value is
warned about (the step's own metrics carry it, ``metrics["intermediates/<unit>/<name>"]``)."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import init_train_state, make_train_step, pipeline

VOCAB = 16
WHY = ("under a pipeline the units run on their stages apart from loss_fn, so a value a unit sows cannot reach "
       "loss_fn across the stages")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "aux", jnp.mean(h ** 2))  # a load-balancing-like term
        return x + jnp.tanh(h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8)(tok)
        for i in range(2):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(VOCAB)(x)


def _batch(n=8, t=4):
    tok = np.random.default_rng(0).integers(0, VOCAB, (n, t + 1))
    return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}


def _ce(logits, b):
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()


def _mesh():
    return spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))


def _adding_what_is_sown(m, units: str, *example):
    """``(step, state)`` of linen model ``m`` pipelined over ``units`` on pp=2, its loss adding every value the
    model sows (``example``: init_train_state's example inputs, a scanned stack's)."""
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]

    def loss(p, b):
        logits, vs = m.apply({"params": p}, b["inputs"], mutable=["intermediates"])
        return _ce(logits, b) + 0.01 * sum(jax.tree.leaves(vs["intermediates"]))

    pm = pipeline(m, _mesh()["pp"], units=units, num_microbatches=2)
    opt = optax.sgd(0.1)
    return make_train_step(pm, loss, opt), init_train_state(pm, opt, *example, params=params)


def test_a_linen_loss_adding_what_the_units_sow_is_refused():
    step, state = _adding_what_is_sown(Net(), "layers_*")
    with pytest.raises(ValueError, match=re.escape("pipeline: loss_fn reads 'aux', which unit 'layers_0' sows (and 1 "
                                                   "more: ['layers_1/aux'])") + ".*" + re.escape(WHY) + ".*"
                       + re.escape("metrics['intermediates/layers_0/aux']") + ".*" + re.escape("without pp (fsdp, ep)")):
        step(state, _batch())


@pytest.mark.slow
def test_a_linen_aux_metric_reading_what_the_units_sow_is_warned_about_and_the_step_trains():
    m = Net()
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]

    def loss(p, b):
        logits, vs = m.apply({"params": p}, b["inputs"], mutable=["intermediates"])
        sown = jax.tree.leaves(vs.get("intermediates", {}).get("layers_1"))  # under pp: empty (warned)
        return _ce(logits, b), {"aux1": sum(sown, jnp.zeros(()))}

    b = _batch()
    want_loss, want_aux = (float(x) for x in (loss(params, b)[0], loss(params, b)[1]["aux1"]))
    pm = pipeline(m, _mesh()["pp"], units="layers_*", num_microbatches=2)
    opt = optax.sgd(0.1)
    step = make_train_step(pm, loss, opt)
    with pytest.warns(UserWarning, match=re.escape("pipeline: loss_fn's aux['aux1'] reads 'aux', which unit "
                                                   "'layers_1' sows") + ".*" + re.escape(
                                                       "metrics['intermediates/layers_1/aux']")):
        _, metrics = step(init_train_state(pm, opt, params=params), b)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    # the mean of h**2 over each micro-batch, averaged: the batch's (micro-batches of one size)
    np.testing.assert_allclose(float(metrics["intermediates/layers_1/aux"]), want_aux, rtol=1e-5)


def test_a_linen_loss_asking_for_the_sown_values_without_reading_them_trains():
    m = Net()
    params = m.init(jax.random.key(0), _batch()["inputs"])["params"]

    def loss(p, b):
        logits, _ = m.apply({"params": p}, b["inputs"], mutable=["intermediates"])
        return _ce(logits, b)

    b = _batch()
    want_loss = float(loss(params, b))
    pm = pipeline(m, _mesh()["pp"], units="layers_*", num_microbatches=2)
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt, params=params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the loss reads nothing the units sow
        _, metrics = make_train_step(pm, loss, opt)(state, b)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)


def _nnx_block():
    """The nnx block sowing ``aux`` (``nnx.Intermediate``), as a class."""
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, *, rngs):
            self.up = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            h = self.up(x)
            self.sow(nnx.Intermediate, "aux", jnp.mean(h ** 2))
            return x + jnp.tanh(h)

    return NBlock


def test_an_nnx_loss_adding_what_the_units_sow_is_refused():
    from flax import nnx

    NBlock = _nnx_block()

    class NNet(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)
            self.blocks = nnx.List([NBlock(rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(8, VOCAB, rngs=rngs)

        def __call__(self, tok):
            x = self.embed(tok)
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

    def loss(mod, b):
        logits = mod(b["inputs"])
        return _ce(logits, b) + 0.01 * sum(jax.tree.leaves(nnx.pop(mod, nnx.Intermediate)))

    m = NNet(rngs=nnx.Rngs(0))
    pm = pipeline(m, _mesh()["pp"], units="blocks.*", num_microbatches=2)
    opt = optax.sgd(0.1)
    step = make_train_step(pm, loss, opt)
    with pytest.raises(ValueError, match=re.escape("pipeline: loss_fn reads 'aux', which unit 'blocks/0' sows (and 1 "
                                                   "more: ['blocks/1/aux'])") + ".*" + re.escape(WHY)):
        step(init_train_state(pm, opt), _batch())


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "aux", jnp.mean(h ** 2))
        return x + jnp.tanh(h), None


class _ScanNet(nn.Module):
    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, 8)(tok)
        x, _ = nn.scan(_ScanBlock, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                       length=4)(name="layers")(x, None)
        return nn.Dense(VOCAB)(x)


def _nnx_scan_net():
    from flax import nnx

    NBlock = _nnx_block()

    class NNet(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, 8, rngs=rngs)

            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NBlock(rngs=rngs)

            self.layers = make(rngs)
            self.head = nnx.Linear(8, VOCAB, rngs=rngs)

        def __call__(self, tok):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            return self.head(run(self.embed(tok), self.layers))

    return NNet(nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_what_a_scanned_stacks_layers_sow_reaches_the_metrics_per_layer(kind):
    """A scanned stack (linen ``nn.scan`` with ``intermediates`` on the layer axis, nnx ``nnx.vmap`` +
    ``nnx.scan``) of 4 layers over pp=2: what each layer sows reaches the step's metrics as
    ``metrics['intermediates/layers/<i>/aux']``, equal to layer ``i``'s value in one device's run."""
    b = _batch()
    if kind == "linen":
        m = _ScanNet()
        params = m.init(jax.random.key(0), b["inputs"])["params"]
        _, vs = m.apply({"params": params}, b["inputs"], mutable=["intermediates"])
        (want,) = vs["intermediates"]["layers"]["aux"]

        def loss(p, b):
            return _ce(m.apply({"params": p}, b["inputs"]), b)

        kw = {"params": params}
    else:
        from flax import nnx

        m = _nnx_scan_net()
        ref = _nnx_scan_net()
        ref(b["inputs"])
        (want,) = nnx.pop(ref, nnx.Intermediate)["layers"]["aux"].get_value()

        def loss(mod, b):
            return _ce(mod(b["inputs"]), b)

        kw = {}
    assert np.shape(want) == (4,)
    pm = pipeline(m, _mesh()["pp"], units="layers", num_microbatches=2)
    opt = optax.sgd(0.1)
    _, metrics = make_train_step(pm, loss, opt)(init_train_state(pm, opt, b["inputs"][:2], **kw), b)
    got = [float(metrics[f"intermediates/layers/{i}/aux"]) for i in range(4)]
    # each micro-batch's mean of h**2, averaged: the batch's (micro-batches of one size)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5)


def test_a_linen_loss_adding_what_a_scanned_stacks_layers_sow_is_refused():
    step, state = _adding_what_is_sown(_ScanNet(), "layers", _batch()["inputs"][:2])
    with pytest.raises(ValueError, match=re.escape("pipeline: loss_fn reads 'aux', which unit 'layers' sows") + ".*"
                       + re.escape(WHY) + ".*" + re.escape("metrics['intermediates/layers/<layer>/aux']")):
        step(state, _batch())
