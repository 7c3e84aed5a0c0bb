"""A parallel style a user writes (a subclass of ``ParallelStyle``, nothing of the library touched) gets what
the built-in styles get: ``parallelize_module``, the train step (equal to 1-device training), the step's
communication table (equal to the compiled HLO's collectives and to the counts written out below from the
styles' layouts), and ``auto_layout``'s ranking.

The model is written here as a user would: a norm, an MLP (``up``, ``down``) with a residual, and a head.
Two styles of the user's own: ``KeepColumnsCut`` cuts the up projection's output features and leaves them
cut for the row-parallel ``down`` (Megatron's pair, the first half written by the user);
``SplitRows`` keeps the head's weights whole and splits its work on the batch rows over tp (each device
computes its rows; the output gathered). SGD, so a gradient off by a factor of tp would show.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import spmd
from _one_device import train_one_device
from spmd import Replicate, Shard
from spmd.parallel import (Calibration, Layout, ParallelStyle, RowwiseParallel, auto_layout, executed_collectives,
                           init_train_state, make_train_step, parallelize_module, unshard_params)

B, T, D, H, O = 16, 4, 16, 32, 4
STEPS = 3
OPT = optax.sgd(0.1)
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(name="norm")(x)
        x = x + nn.Dense(D, name="down")(nn.gelu(nn.Dense(H, name="up")(x)))
        return nn.Dense(O, name="head")(x)


class KeepColumnsCut(ParallelStyle):
    """A Dense cut on its output features; its input whole; its output left cut (the next module reads it cut)."""

    def param_placements(self, module_path, params, module_type=None):
        return {"kernel": Shard(1), "bias": Shard(0)}  # kernel (in, out): the output columns; bias (out,)

    def input_layouts_for(self, module_type):
        return Replicate(), Replicate()

    def output_layouts_for(self, module_type):
        return Shard(-1), Shard(-1)  # computed cut on the features, handed on cut


class SplitRows(ParallelStyle):
    """Weights whole (the default placements); each tp device computes its rows of the batch; output gathered."""

    def input_layouts_for(self, module_type):
        return Replicate(), Shard(0)  # arrives whole: each device takes its rows (a slice, no communication)

    def output_layouts_for(self, module_type):
        return Shard(0), Replicate()  # computed on the rows, gathered whole


PLAN = {"up": KeepColumnsCut(), "down": RowwiseParallel(), "head": SplitRows()}


def loss_fn(params, batch):
    return ((Net().apply({"params": params}, batch["x"]) - batch["y"]) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((B, T, D)).astype(np.float32),
                "y": rng.standard_normal((B, T, O)).astype(np.float32)} for _ in range(STEPS)]
    params = Net().init(jax.random.key(0), batches[0]["x"])["params"]
    return params, batches


def _expected(rows: int, dp: int) -> dict:
    """The collectives per device and step, from the styles' layouts (``rows``: the batch rows per data rank)."""
    act = rows * T * D * 4  # the residual stream, f32
    want = {k: {"count": 0, "bytes": 0} for k in KINDS}

    def add(kind, nbytes):
        want[kind]["count"] += 1
        want[kind]["bytes"] += nbytes

    add("all-reduce", act)  # up: its whole input's gradient, summed over tp (each device saw its columns)
    add("all-reduce", act)  # down: its partial sums, forward
    add("all-reduce", act)  # head: its whole input's gradient (each device's rows, zero elsewhere)
    add("all-gather", rows * T * O * 4)  # head: its rows' outputs gathered, forward
    add("reduce-scatter", rows * T * O * 4)  # ... and its gradient scattered back to the rows, backward
    add("all-reduce", D * O * 4)  # head's kernel and bias, whole over tp: their gradients summed over the rows
    add("all-reduce", O * 4)
    if dp > 1:  # DDP: every leaf's gradient (as stored on the device: up's cut over tp)
        tp = 8 // dp
        for nbytes in (D * 4, D * 4, D * H * 4 // tp, H * 4 // tp, H * D * 4 // tp, D * 4, D * O * 4, O * 4):
            add("all-reduce", nbytes)
    return want


@pytest.mark.slow
def test_a_users_styles_train_as_one_device_and_their_table_is_the_compiled_steps():
    params, batches = _data()
    ref_losses, ref = train_one_device(params, batches, loss_fn, OPT)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(Net(), mesh["tp"], PLAN)
    state = init_train_state(model, OPT, params=params)
    # the style's placements are the plan's: up cut on its columns over tp, head whole
    tp = state.plan.mesh_dim_names.index("tp")
    got = {e.path: e.placements[tp] for e in state.plan.entries}
    assert got["up/kernel"] == Shard(1) and got["up/bias"] == Shard(0) and got["down/kernel"] == Shard(0)
    assert got["head/kernel"] == got["head/bias"] == got["down/bias"] == Replicate()
    step = make_train_step(model, loss_fn, OPT)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)

    table = step.communication(state, batches[0])
    hlo = executed_collectives(step, state, batches[0], scalars=False)
    want = _expected(B // 2, dp=2)
    for kind in KINDS:
        assert table["total"][kind] == want[kind], (kind, table["total"], want)
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want[kind]["count"], want[kind]["bytes"]), (kind, hlo)
    text = step.table(state, batches[0])
    assert re.search(r"head: SplitRows in R \([0-9,]+ B\) -> out R", text), text
    assert "up: KeepColumnsCut in R" in text


@pytest.mark.slow
def test_auto_layout_ranks_a_plan_holding_a_users_style():
    params, batches = _data()
    cal = Calibration(collectives={k: (1e-4, 1e9) for k in (*KINDS, "collective-permute")}, matmul_flops_per_s=1e10,
                      elementwise_bytes_per_s=1e10, dispatch_s=1e-4, group_size=2)
    got = auto_layout(Net(), OPT, batches[0], 2, plan=PLAN, loss_fn=loss_fn, params=params, calibration=cal)
    ranked = {c.name: c for c in got.candidates}
    tp = [c for c in got.candidates if c.layout.tp == 2]
    assert len(tp) >= 1 and all(dict(c.layout.tp_plan) == PLAN for c in tp), list(ranked)
    want = _expected(B, dp=1)  # tp=2 alone: the whole batch on each tp pair, no data dim
    want = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in want.items()}
    for c in tp:
        if c.layout.dp == 1 and c.layout.fsdp == 1 and c.layout.pp == 1:
            assert {k: c.communication["total"][k] for k in KINDS} == want, (c.name, c.communication["total"])
            break
    else:
        raise AssertionError(f"no tp=2 layout among {list(ranked)}")
    assert [c.predicted_s for c in got.candidates if c.fits] == sorted(c.predicted_s for c in got.candidates if c.fits)


def test_a_plan_entry_that_is_no_style_and_a_style_with_bad_placements_are_clear_errors():
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(TypeError, match=re.escape("parallelize_module: parallelize_plan['up']='colwise' must be a "
                                                  "ParallelStyle: a built-in")):
        parallelize_module(Net(), mesh["tp"], {"up": "colwise"})

    class Forgetful(ParallelStyle):
        def param_placements(self, module_path, params, module_type=None):
            return {"kernel": Shard(1)}  # no bias

        def __repr__(self):
            return "Forgetful()"

    class OutOfRange(ParallelStyle):
        def param_placements(self, module_path, params, module_type=None):
            return {"kernel": Shard(2), "bias": Replicate()}

        def __repr__(self):
            return "OutOfRange()"

    params, _ = _data()
    with pytest.raises(TypeError, match=re.escape("parallelize_module: Forgetful().param_placements('up', ...) "
                                                  "returned {'kernel': Shard(dim=1)}; return a dict with one placement "
                                                  "for each of the module's parameters ['bias', 'kernel'].")):
        init_train_state(parallelize_module(Net(), mesh["tp"], {"up": Forgetful()}), OPT, params=params)
    with pytest.raises(ValueError, match=re.escape("parallelize_module: OutOfRange().param_placements('up', ...)"
                                                   "['kernel']=Shard(dim=2) is out of range for the parameter of "
                                                   "shape (16, 32); use a dim in [-2, 1].")):
        init_train_state(parallelize_module(Net(), mesh["tp"], {"up": OutOfRange()}), OPT, params=params)


def test_a_style_whose_input_or_output_changes_its_cut_is_refused():
    """An input arriving ``Shard(a)`` that the style computes on ``Shard(b)``, or an output computed ``Shard(a)`` and
    handed on ``Shard(b)``, would need an all-to-all no style writes: refused at the step's trace, naming both
    layouts (the region ran the module on the wrong cut before, and the table claimed the other one)."""

    class RowsToPositions(ParallelStyle):  # the head's input arrives cut on the batch, wanted on the positions
        def input_layouts_for(self, module_type):
            return Shard(0), Shard(1)

    class RowsHandedAsPositions(ParallelStyle):  # computed on the batch rows, handed on cut on the positions
        def input_layouts_for(self, module_type):
            return Replicate(), Shard(0)

        def output_layouts_for(self, module_type):
            return Shard(0), Shard(1)

    params, batches = _data()
    mesh = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    for style, msg in ((RowsToPositions(), "parallelize_module: RowsToPositions on 'head' takes its input (of shape "
                        f"({B // 4}, {T}, {D})) as it arrives, Shard(dim=0), but its computation needs it Shard(dim=1)"),
                       (RowsHandedAsPositions(), "parallelize_module: RowsHandedAsPositions on 'head' computes its output "
                        "cut on dim 0 (Shard(dim=0)) and hands it on as Shard(dim=1) (dim 1 of 3)")):
        model = parallelize_module(Net(), mesh["tp"], {"head": style})
        state = init_train_state(model, OPT, params=params)
        with pytest.raises(ValueError, match=re.escape(msg)):
            make_train_step(model, loss_fn, OPT)(state, batches[0])
