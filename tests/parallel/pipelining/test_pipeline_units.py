"""Pipeline units that differ by a static attribute (a local-attention window on every other block) run as
themselves: the step never substitutes one unit's module for another's."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import init_train_state, make_train_step, pipeline

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


def test_units_that_differ_are_refused_naming_both_and_the_attribute():
    _, params, loss, pm = _setup((None, 2, None, 2))
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, loss, opt)
    with pytest.raises(ValueError, match=re.escape("units 'layers_0' and 'layers_1' differ (window=None vs 2)")):
        step.lower(state, _batch())
