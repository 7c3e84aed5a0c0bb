"""auto_layout's search under ``hardware=``: the compute bound a layout is pruned on (the model's matmul flops
per device at the peak rate) is below every compiled step's own flops, it is counted exactly (a two-matmul
loss against the flops written out by hand), and the best-first search (``_budget.searched``) picks what
compiling every candidate picks while leaving some untraced."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import Transformer
from models._plans import transformer_tp_plan
from spmd.parallel import Hardware, Layout, Link, auto_layout
from spmd.parallel.auto._auto import _with_compiled, candidate_layouts, default_loss, evaluate_layout
from spmd.parallel.auto._compiled import compile_figures
from spmd.parallel.auto._priced import HardwareRates, dot_flops
from spmd.parallel.cost._memory import Profile

VOCAB, T, B = 16, 16, 16
OPT = optax.adamw(1e-3)
U = ("block_*",)
MODEL = Transformer(VOCAB, T, num_layers=2, d_model=32, num_heads=4)


def _batch() -> dict:
    tok = np.random.default_rng(0).integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _plan(sequence_parallel: bool, tp_size: int):
    return None if sequence_parallel else transformer_tp_plan(False, vocab_size=VOCAB, tp_size=tp_size)


def test_dot_flops_counts_the_gradients_matmuls():
    """``loss = sum((x @ w1) @ w2)``: forward 2BDH + 2BHO, backward (parameters only) dh = g w2^T (2BHO),
    dw2 = h^T g (2BHO), dw1 = x^T dh (2BDH)."""
    b, d, h, o = 5, 3, 7, 2
    params = {"w1": jax.ShapeDtypeStruct((d, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, o), jnp.float32)}
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)
    got = dot_flops(lambda p, x: jnp.sum((x @ p["w1"]) @ p["w2"]), params, x)
    assert got == 4 * b * d * h + 6 * b * h * o


@pytest.mark.slow  # compiles five layouts of a two-block model
def test_the_compute_bound_is_below_every_compiled_steps_flops():
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    work = dot_flops(default_loss(MODEL), params, batch)
    tp = lambda n: tuple(_plan(False, n).items())  # noqa: E731
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U), Layout(fsdp=8, units=U, mixed_precision="bfloat16"),
                Layout(dp=2, tp=4, tp_plan=tp(4)),
                Layout(fsdp=8, units=U, reshard_after_forward=False, activation_checkpointing="full")):
        got = compile_figures(MODEL, OPT, default_loss, params, batch, jax.devices()[:8], lay)
        assert work / 8 <= got["flops"], (lay.name, work / 8, got["flops"])


def _hw() -> Hardware:
    """Compute slow enough that the bound prunes the float32 layouts (bf16 10x faster), links as an H100's."""
    return Hardware("slow", {"float32": 2e9, "bfloat16": 2e10}, 80e9, 3e12, 4, Link(450e9, 3e-6), Link(50e9, 1e-5))


@pytest.mark.slow  # traces and compiles every candidate of a two-block model on 2 devices
def test_the_search_picks_what_compiling_every_candidate_picks():
    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(MODEL), params, OPT)
    got = auto_layout(MODEL, OPT, batch, 2, hardware=_hw(), plan=_plan, units=U, params=params, profile=prof,
                      mixed_precision="bfloat16")
    untraced = [n for n, why in got.rejected if why.startswith("not traced: its bound")]
    assert untraced, got.rejected  # the bound prunes: some layouts were never traced
    # the reference: every candidate traced and compiled, the fastest fitting one by its compiled time
    rates = HardwareRates(_hw(), "float32", group_size=2)
    lays = [lay for base in candidate_layouts(2, _plan, U)
            for lay in (base, *((Layout(**{**base.__dict__, "mixed_precision": "bfloat16"}),) if base.fsdp > 1 else ()))]
    best = None
    for lay in lays:
        c = evaluate_layout(MODEL, OPT, batch, 2, lay, params=params, calibration=rates, profile=prof,
                            budget=int(80e9))
        c = _with_compiled(c, compile_figures(MODEL, OPT, default_loss, params, batch, jax.devices()[:2], lay),
                           rates, int(80e9))
        if c.fits and (best is None or c.predicted_s < best.predicted_s):
            best = c
    assert got.best.name == best.name
    assert got.best.predicted_s == pytest.approx(best.predicted_s, rel=1e-9)
    assert all(math.isfinite(c.predicted_s) for c in got if c.fits)


@pytest.mark.slow  # traces six layouts of a two-block model
def test_the_communication_bound_is_below_every_traced_steps_parameter_collectives():
    """``comm_floor`` (the gradients' reduction and FSDP's gathers at the least bytes, before any trace) is at
    most what the step's own table costs on the same hardware, for DP, FSDP, HSDP, mixed precision and tp; and
    it is no bound at all (0) for a layout without data dims."""
    from spmd.parallel.auto._priced import comm_floor

    batch = _batch()
    params = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), batch["inputs"])["params"])
    hw = Hardware("h100 links", {"float32": 67e12}, 80e9, 3.35e12, 4, Link(450e9, 3e-6), Link(50e9, 1e-5))
    free = Hardware("no latency", {"float32": 67e12}, 80e9, 3.35e12, 4, Link(450e9, 0.0), Link(50e9, 0.0))
    tp = lambda n: tuple(_plan(False, n).items())  # noqa: E731
    seen = []
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U), Layout(fsdp=8, units=U, mixed_precision="bfloat16"),
                Layout(dp=2, fsdp=4, units=U), Layout(dp=2, tp=4, tp_plan=tp(4)),
                Layout(fsdp=2, tp=4, tp_plan=tp(4), units=U, reshard_after_forward=False)):
        for h in (hw, free):
            c = evaluate_layout(MODEL, OPT, batch, jax.devices()[:8], lay, params=params,
                                calibration=HardwareRates(h, "float32", group_size=8))
            floor = comm_floor(lay, h, params)
            assert 0 < floor <= sum(c.comm_s.values()) * (1 + 1e-9), (lay.name, h.name, floor, c.comm_s)
        seen.append(floor / sum(c.comm_s.values()))
    assert seen[0] == pytest.approx(1.0)  # dp=8 without latency: all of it (one all-reduce of every gradient)
    assert comm_floor(Layout(tp=8, tp_plan=tp(8)), hw, params) == 0.0
