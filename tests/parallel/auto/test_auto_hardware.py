"""auto_layout(hardware=): each candidate's communication table priced on a Hardware's links by its mesh dim's
group and stride (inside a node or across), its compute the roofline of the step's own flops and bytes, nothing
timed or calibrated here, the hardware's memory as the default budget, and the errors. The expected seconds are
computed here from the ring / tree formulas and the table the step reports, not by the code under test."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import optax
import pytest

from models import Transformer
from models._plans import transformer_tp_plan
from spmd.parallel import (HARDWARE, Calibration, Hardware, Layout, Link, apply_layout, auto_layout, init_train_state,
                           make_train_step)
from spmd.parallel.step._protocol import StepMemory
from spmd.parallel.auto import _auto
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._priced import HardwareRates, matmul_dtype, mesh_group
from spmd.parallel.cost._memory import Profile, _cost

VOCAB, T, B = 16, 8, 16
MODEL = Transformer(VOCAB, T, num_layers=2, d_model=32, num_heads=8)
OPT = optax.adamw(1e-3)
FAST, SLOW = Link(1e12, 1e-6), Link(1e10, 1e-4)  # the inter-node link 100x slower in bandwidth and latency


def _plan(tp):
    return tuple(transformer_tp_plan(False, vocab_size=VOCAB, tp_size=tp).items())


LAYOUTS = [Layout(dp=1, tp=8, tp_plan=_plan(8)), Layout(dp=2, tp=4, tp_plan=_plan(4))]


def _hw(per_node: int, flops: float = 1e18, bw: float = 1e18) -> Hardware:
    return Hardware("test", {"float32": flops}, 1e12, bw, per_node, FAST, SLOW)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    tok = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    params = MODEL.init(jax.random.key(0), batch["inputs"])["params"]
    return batch, params, Profile(default_loss(MODEL), params, OPT)


def _ring(kind: str, count: int, nbytes: int, group: int, link: Link) -> float:
    """``count`` collectives of ``nbytes`` in all over ``group`` devices on ``link``: ring (all-reduce: the
    faster of two ring passes and a tree), nccl-tests byte convention."""
    if not count or group < 2:
        return 0.0
    each = nbytes / count
    one = (group - 1) * link.latency + (group - 1) / group * each / link.bandwidth
    if kind == "all-reduce":
        tree = 2 * math.ceil(math.log2(group)) * link.latency + 2 * each / link.bandwidth
        return count * min(2 * one, tree)
    return count * one


def _no_timing(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("timed or calibrated on this machine under hardware=")

    monkeypatch.setattr(_auto, "calibrate", refuse)
    monkeypatch.setattr(Profile, "grad_seconds", refuse)
    monkeypatch.setattr(Profile, "optimizer_seconds", refuse)


@pytest.mark.slow  # compiles the one-device step and the pick (its peak under the default budget)
def test_a_tp_dim_spanning_nodes_is_priced_on_the_inter_node_link_and_ranked_behind(data, monkeypatch):
    batch, params, prof = data
    _no_timing(monkeypatch)
    four = auto_layout(MODEL, OPT, batch, 8, layouts=LAYOUTS, hardware=_hw(4), profile=prof, params=params)
    eight = auto_layout(MODEL, OPT, batch, 8, layouts=LAYOUTS, hardware=_hw(8), profile=prof, params=params)
    by4 = {c.name: c for c in four}
    by8 = {c.name: c for c in eight}
    # tp=8 (stride 1) spans two nodes of 4: every activation collective on the slow link; in a node of 8 the fast
    c4, c8 = by4["dp=1,tp=8"], by8["dp=1,tp=8"]
    act = c4.communication["activations"]
    assert sum(v["bytes"] for v in act.values()) > 0
    assert not any(v["count"] for v in c4.communication["parameters"].values())  # dp=1: no gradient all-reduce
    for kind, v in act.items():
        assert c4.comm_s[kind] == pytest.approx(_ring(kind, v["count"], v["bytes"], 8, SLOW))
        assert c8.comm_s[kind] == pytest.approx(_ring(kind, v["count"], v["bytes"], 8, FAST))
    # dp=2,tp=4: tp (stride 1) inside a node of 4, the gradients' all-reduce over dp (stride 4) across nodes
    d = by4["dp=2,tp=4"]
    act, par = d.communication["activations"]["all-reduce"], d.communication["parameters"]["all-reduce"]
    want = _ring("all-reduce", act["count"], act["bytes"], 4, FAST) + _ring("all-reduce", par["count"], par["bytes"],
                                                                          2, SLOW)
    assert d.comm_s["all-reduce"] == pytest.approx(want)
    # keeping tp inside a node wins where nodes hold 4 (though its gradients' all-reduce crosses them); in a
    # node of 8 tp=8, which moves no gradient, wins; the topology does not change the compute
    assert [c.name for c in four] == ["dp=2,tp=4", "dp=1,tp=8"]
    assert [c.name for c in eight] == ["dp=1,tp=8", "dp=2,tp=4"]
    assert c4.predicted_s > 10 * c8.predicted_s
    assert four.budget == 10**12 and "on test's figures" in four.table()


@pytest.mark.slow  # compiles the one-device step and the pick (its peak under the default budget)
def test_compute_is_the_roofline_of_the_compiled_steps_flops_and_bytes(data, monkeypatch):
    """The candidate compiled (the default budget: the hardware's memory): its compute is the roofline of its own
    step's cost_analysis() flops and bytes (the step built and compiled here by hand), its peak the step's
    memory_analysis(); before compiling, the estimate is the model's matmul work at the peak rate (a bound)."""
    batch, params, prof = data
    _no_timing(monkeypatch)
    lay = Layout(dp=8)
    laid, mesh = apply_layout(MODEL, 8, lay)
    state = init_train_state(laid, OPT, params=params, mesh=mesh)
    exe = make_train_step(laid, default_loss(laid), OPT, mesh=mesh, donate=True).lower(state, batch).compile()
    f, b = _cost(exe)  # cost_analysis(), each loop's other trips added (spmd.parallel.cost._loops)
    for rate, bw in ((1e9, 1e18), (1e18, 1e9)):  # matmul-bound, then memory-bound
        got = auto_layout(MODEL, OPT, batch, 8, layouts=[lay], hardware=_hw(8, rate, bw), profile=prof,
                          params=params).best
        assert got.compute_s == pytest.approx(max(f / rate, b / bw), rel=1e-6)
        assert got.flops == pytest.approx(f, rel=1e-6) and got.dispatch_s == 0.0
        assert got.measured_peak == StepMemory.from_compiled(exe).peak and got.memory["compiled"]
        bound = _auto.evaluate_layout(MODEL, OPT, batch, 8, lay, params=params, profile=prof,
                                      calibration=HardwareRates(_hw(8, rate, bw), "float32"))
        assert not bound.memory["compiled"] and bound.compute_s <= got.compute_s


@pytest.mark.slow  # compiles the one-device step and the pick (its peak under the default budget)
def test_a_built_in_plans_without_any_calibration_or_timing(data, monkeypatch):
    batch, params, prof = data
    _no_timing(monkeypatch)
    got = auto_layout(MODEL, OPT, batch, 8, layouts=[Layout(dp=8), Layout(fsdp=8, units=("block_*",))],
                      hardware="h100", profile=prof, params=params)
    assert got.hardware is HARDWARE["h100"] and got.calibration is None
    assert got.budget == 80 * 10**9  # the H100's memory: the default budget
    fsdp = next(c for c in got if c.name.startswith("fsdp=8"))
    ag = fsdp.communication["parameters"]["all-gather"]
    assert fsdp.comm_s["all-gather"] == pytest.approx(_ring("all-gather", ag["count"], ag["bytes"], 8,
                                                            HARDWARE["h100"].intra))


def test_hardware_errors_name_the_argument_and_the_fix():
    batch = {"inputs": np.zeros((B, T), np.int32), "targets": np.zeros((B, T), np.int32)}
    params, lays = None, [Layout(dp=8)]  # refused before the model is traced
    with pytest.raises(ValueError, match=re.escape("auto_layout: hardware='h9000' is not a built-in; use one of "
                                                   f"{sorted(HARDWARE)}")):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, hardware="h9000", params=params)
    with pytest.raises(TypeError, match=re.escape("auto_layout: hardware=3 must be a built-in's name")):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, hardware=3, params=params)
    cal = Calibration(collectives={k: (1e-4, 1e9) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                            "collective-permute")})
    with pytest.raises(ValueError, match=re.escape("auto_layout: hardware='h100' and calibration= were both given")):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, hardware="h100", calibration=cal, params=params)
    with pytest.raises(ValueError, match=re.escape("auto_layout: hardware='h100' with measure=2: measure= times")):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, hardware="h100", measure=2, params=params)
    with pytest.raises(ValueError, match=re.escape("auto_layout: hardware=Hardware('test') and calibration= were")):
        auto_layout(MODEL, OPT, batch, 8, layouts=lays, hardware=_hw(4), calibration=cal, params=params)


def test_a_mesh_dims_group_and_stride_follow_the_row_major_order():
    dims = Layout(dp=2, fsdp=2, tp=2, tp_plan=_plan(2)).mesh_dims  # dp x fsdp x tp: tp innermost
    assert [mesh_group(dims, n) for n in (("tp",), ("fsdp",), ("dp",), ("dp", "fsdp"))] == [(2, 1), (2, 2), (2, 4),
                                                                                           (4, 2)]
    pipe = Layout(pp=2, dp=4, units=("block_*",), microbatches=2).mesh_dims  # pp outermost
    assert [mesh_group(pipe, n) for n in (("pp",), ("dp", "fsdp"), ("tp",))] == [(2, 4), (4, 1), (1, 1)]
    h = _hw(4)  # nodes of 4: dp (2 x stride 4) spans two, fsdp (2 x stride 2) and the 4 of dp x fsdp at 2 don't
    assert [h.spans_nodes(*mesh_group(dims, n)) for n in (("tp",), ("fsdp",), ("dp",), ("dp", "fsdp"))] == [
        False, False, True, True]


def test_the_matmul_dtype_is_the_models_and_one_without_a_rate_is_refused():
    import flax.linen as nn
    import jax.numpy as jnp

    class Net(nn.Module):
        dtype: object = jnp.float32

        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, dtype=self.dtype)(nn.Dense(64, dtype=self.dtype)(x)).sum()

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    for dtype, want in ((jnp.float32, "float32"), (jnp.bfloat16, "bfloat16")):
        net = Net(dtype)
        params = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, 16)))["params"])
        assert matmul_dtype(lambda p, b: net.apply({"params": p}, b["x"]), params, {"x": x}) == want
    net = Net()
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, 16)))["params"])
    bf16_only = Hardware("bf16 only", {"bfloat16": 1e15}, 1e12, 1e12, 8, FAST, SLOW)
    with pytest.raises(ValueError, match=re.escape("auto_layout: the model's matmuls run in float32, for which "
                                                   "hardware=Hardware('bf16 only') gives no rate (its matmul_flops "
                                                   "are for ['bfloat16']); add 'float32' to its matmul_flops")):
        auto_layout(net, OPT, {"x": x}, 8, loss_fn=lambda p, b: net.apply({"params": p}, b["x"]), params=params,
                    layouts=[Layout(dp=8)], hardware=bf16_only)


@pytest.mark.slow  # traces the pipelined step and compiles the one-device programs its estimate reads
def test_a_pipelines_permutes_cross_nodes_by_pps_stride(data):
    """pp=2 x dp=4: the stages 4 devices apart; on nodes of 4 the activations' permutes cross nodes while the
    gradients' all-reduce over dp (stride 1) stays inside one; on nodes of 8 both stay inside."""
    batch, params, prof = data
    lay = Layout(pp=2, dp=4, units=("block_*",), microbatches=2)
    got = {n: _auto.evaluate_layout(MODEL, OPT, batch, 8, lay, params=params, profile=prof,
                                    calibration=HardwareRates(_hw(n), "float32")) for n in (4, 8)}
    cp = got[4].communication["total"]["collective-permute"]
    ar = got[4].communication["parameters"]["all-reduce"]
    assert cp["count"] > 0 and ar["count"] > 0
    for n, link in ((4, SLOW), (8, FAST)):
        assert got[n].comm_s["collective-permute"] == pytest.approx(
            cp["count"] * (link.latency + cp["bytes"] / cp["count"] / link.bandwidth))
        assert got[n].comm_s["all-reduce"] == pytest.approx(_ring("all-reduce", ar["count"], ar["bytes"], 4, FAST))
