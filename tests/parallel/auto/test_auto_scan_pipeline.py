"""auto_layout's pipeline candidates for a scanned stack (linen ``nn.scan``, nnx ``nnx.vmap`` + ``nnx.scan``):
the stack's layers are the units and the stages equal slices of its layer axis (``pipeline(...,
units="layers")``); each candidate's table equals its list twin's (the same blocks as a Python list)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from spmd.parallel import auto_layout
from spmd.parallel.auto._auto import evaluate_layout
from spmd.parallel.auto._pipeline import pipeline_layouts, scanned_stack
from tests.parallel.auto.test_auto_layout import _cal
from tests.third_party.scanned import Block, ScannedMLP, nnx_scanned_mlp

OPT = optax.adamw(1e-3)
EXAMPLE = np.zeros((2, 8), np.int32)


class ListMLP(nn.Module):
    """``ScannedMLP``'s blocks as a Python list (``layers_0`` ... ``layers_{depth-1}``)."""

    depth: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16, name="embed")(tokens)
        for i in range(self.depth):
            x, _ = Block(16, 32, name=f"layers_{i}")(x, None)
        return nn.Dense(32, name="head")(nn.LayerNorm(name="norm")(x))


def _batch():
    tok = np.random.default_rng(0).integers(0, 32, (16, 9)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


@pytest.mark.slow
def test_a_scanned_stacks_pipeline_layouts_slice_its_layer_axis():
    model = ScannedMLP(depth=6, axis=1, remat=True)
    params = model.init(jax.random.key(0), EXAMPLE)["params"]
    assert scanned_stack(model, params, (EXAMPLE,)) == ("layers", 6)
    got = [lay.name for lay in pipeline_layouts(8, None, ("layers",), params, 16, layers=6)]
    # 6 layers in equal slices: pp=2 only (4 stages do not divide them), not interleaved (2 x 2 stages do
    # not either); a replica's 4 rows: M = 2, 4
    assert got == ["pp=2,dp=4 1f1b M=2", "pp=2,dp=4 1f1b M=4", "pp=2,dp=2,fsdp=2 1f1b M=2",
                   "pp=2,dp=2,fsdp=2 1f1b M=4", "pp=2,fsdp=4 1f1b M=2", "pp=2,fsdp=4 1f1b M=4"]
    assert all(lay.units == ("layers",) for lay in pipeline_layouts(8, None, ("layers",), params, 16, layers=6))
    twin = ListMLP(depth=6)
    assert scanned_stack(twin, twin.init(jax.random.key(0), EXAMPLE)["params"], (EXAMPLE,)) is None
    from flax import nnx

    stack = nnx_scanned_mlp(depth=4)
    assert scanned_stack(stack, nnx.state(stack, nnx.Param), (EXAMPLE,)) == ("layers", 4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_auto_layout_weighs_a_scanned_stacks_pipelines_as_its_list_twins(kind):
    """On 2 devices: pp=2 at M = 2, 4, 8 and interleaved, each with the table of the list twin's candidate."""
    batch = _batch()
    model = ScannedMLP(depth=4, axis=1, remat=True) if kind == "linen" else nnx_scanned_mlp(depth=4)
    got = auto_layout(model, OPT, batch, 2, calibration=_cal(op_s=1e-6))
    pp = {c.layout.name: c for c in got.candidates if c.layout.pp > 1}
    assert sorted(pp) == ["pp=2 1f1b M=2", "pp=2 1f1b M=4", "pp=2 1f1b M=8", "pp=2 interleaved v=2 M=8"]
    twin = ListMLP(depth=4)
    twin_params = twin.init(jax.random.key(0), batch["inputs"])["params"]
    for name, c in pp.items():
        assert c.layout.units == ("layers",)
        ref = evaluate_layout(twin, OPT, batch, 2, dataclasses.replace(c.layout, units=("layers_*",)),
                              params=twin_params, calibration=_cal(op_s=1e-6))
        assert c.communication["total"] == ref.communication["total"], name
        assert c.memory["stash"] == ref.memory["stash"], name
