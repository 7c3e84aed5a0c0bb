"""The experts' own tp inside ep (torchtitan's ``ExpertTensorParallel``): ``models.MoE``'s experts cut over ep on E
and over tp on their hidden f (gate / up ``[E, d, f]`` on dim 2, down ``[E, f, d]`` on dim 1), laid out by
``models.layout_model`` on dp=2 x ep=2 x tp=2: 3 SGD steps equal one device's within 1e-5, every collective kind
of the step's table (count and bytes) equals the compiled step's, each device holds 1/(ep x tp) of the experts'
parameter bytes; with the sequence over cp too (cp=2 x ep=2 x tp=2, and fsdp=2 x cp=2 x ep=2 x tp=2 on 16 devices
in its own process), the router on the gathered sequence and each device of cp dispatching its part, the same; the
style's reading of d and f from the shapes, and its refusals, by name.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import spmd
from models import MoE
from models._plans import layout_model
from spmd.parallel import (ExpertTensorParallel, init_train_state, make_train_step, parallelize_module,
                           unshard_params)
from tests._one_device import assert_trees_close, train_one_device
from tests.parallel.test_expert_compose import EP, SCANNED, SCANNED_TP, _assert_table_is_hlo, _compiled, _cp_batches
from tests.parallel.test_expert_step import CFG, _batches, _loss

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_moe_experts_over_ep_and_tp_under_dp2_ep2_tp2_equals_one_device():
    model = MoE(CFG)  # 8 experts of d=16, f=32 in layers_1 (layers_0 dense)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    pm = layout_model(model, mesh)
    state = init_train_state(pm, opt, params=params)
    full = local = 0
    for name, dim in (("gate_proj", 2), ("up_proj", 2), ("down_proj", 1)):
        e = state.plan.entry(f"layers_1/mlp/experts/{name}")
        want = ["R", "S(0)", f"S({dim})"]
        assert [str(p) for p in e.placements] == want, name
        full += int(np.prod(e.shape)) * 4
        local += int(np.prod(e.local_shape)) * 4
    # per device: E/ep = 4 experts of f/tp = 16: 3 x 4 x 16 x 16 x 4 B
    assert (full, local) == (3 * 8 * 16 * 32 * 4, 3 * 4 * 16 * 16 * 4) and local * 4 == full
    leaves = state.params["layers_1"]["mlp"]["experts"]
    assert all(x.addressable_shards[0].data.nbytes * 4 == x.nbytes for x in leaves.values())
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo)
    # over ep: per device 8 rows / (dp x ep) = 2 -> buffers [2, 8 experts, capacity 4, 16] float32 = 4,096 B,
    # dispatch and combine forward, their transposes backward
    assert comm["experts"]["all-to-all"] == {"count": 4, "bytes": 4 * 4096}
    # over tp: the attention's (o_proj's output forward, q/k/v's input gradients backward: 4 per layer, 2 layers)
    # and the dense layers_0 MLP's (down's output, gate/up's input gradients: 3), [2, 16, 16] float32 = 2,048 B
    # each; the experts' partial output forward and their tokens' gradient backward, one 4,096 B buffer each
    assert comm["activations"]["all-reduce"] == {"count": 8 + 3 + 2, "bytes": 11 * 2048 + 2 * 4096}


SHAPES = {"gate_proj": (8, 16, 32), "up_proj": (8, 16, 32), "down_proj": (8, 32, 16)}


def test_expert_tensor_parallel_reads_d_and_f_from_the_shapes():
    want = {"gate_proj": "S(2)", "up_proj": "S(2)", "down_proj": "S(1)"}
    for style in (ExpertTensorParallel(), ExpertTensorParallel(model_dim=16)):
        got = style.param_placements("layers_1.mlp.experts", SHAPES)
        assert {n: str(p) for n, p in got.items()} == want
    # an ungated expert (one projection in, one out): d given, f cut; not given, refused
    plain = {"w_in": (4, 8, 24), "w_out": (4, 24, 8)}
    got = ExpertTensorParallel(model_dim=8).param_placements("experts", plain)
    assert {n: str(p) for n, p in got.items()} == {"w_in": "S(2)", "w_out": "S(1)"}
    with pytest.raises(ValueError, match=r"ExpertTensorParallel on 'experts'.*give ExpertTensorParallel\(model_dim=d\)"):
        ExpertTensorParallel().param_placements("experts", plain)


def test_expert_tensor_parallel_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"model_dim=12 is not a dim of the parameters.*one of \[16, 32\]"):
        ExpertTensorParallel(model_dim=12).param_placements("e", SHAPES)
    with pytest.raises(ValueError, match=r"d == f == 16"):
        ExpertTensorParallel(model_dim=16).param_placements("e", {"a": (2, 16, 16), "b": (2, 16, 16)})
    with pytest.raises(ValueError, match=r"must all be \[E, d, f\] or \[E, f, d\]"):
        ExpertTensorParallel().param_placements("e", {"kernel": (16, 32)})
    with pytest.raises(ValueError, match=r"\(4, 8, 16, 32\).*give init_train_state the example inputs"):
        ExpertTensorParallel().param_placements("e", {n: (4, *s) for n, s in SHAPES.items()})  # stacked, unknown
    with pytest.raises(TypeError, match=r"model_dim=0 must be None or an int >= 1"):
        ExpertTensorParallel(model_dim=0)
    with pytest.raises(ValueError, match=r"input has shape \(2, 8, 4, 32\), whose last dim is not the experts' "
                                         r"width d=16"):
        ExpertTensorParallel().check_input("e", SHAPES, np.zeros((2, 8, 4, 32)))


@pytest.mark.slow
def test_moe_experts_over_ep_and_tp_under_fsdp2_ep2_tp2_equals_one_device():
    """With fully_shard units too: the experts' blocks [E / ep, d, f / tp] cut over fsdp on their free dim d."""
    model = MoE(CFG)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "tp"))
    pm = layout_model(model, mesh)
    state = init_train_state(pm, opt, params=params)
    e = state.plan.entry("layers_1/mlp/experts/down_proj")  # [E, f, d]
    assert ([str(p) for p in e.placements], e.local_shape) == (["S(2)", "S(0)", "S(1)"], (4, 16, 8))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo)


@pytest.mark.slow
def test_moe_experts_over_ep_and_tp_under_cp2_ep2_tp2_equals_one_device():
    """With the sequence over cp: the router runs on the sequence gathered over cp, each device of cp dispatches its
    half of the buffers' groups, so the experts' all-reduces over tp move 1/cp of the gathered buffers' bytes."""
    model = MoE(dataclasses.replace(CFG, attn_implementation="sdpa"))  # the ring over cp
    batches = _cp_batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("cp", "ep", "tp"))
    pm = layout_model(model, mesh)
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    e = state.plan.entry("layers_1/mlp/experts/gate_proj")  # [E, d, f]
    assert ([str(p) for p in e.placements], e.local_shape) == (["R", "S(0)", "S(2)"], (4, 16, 16))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo, ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"))
    # per device: 8 rows / ep = 4, the router's buffers [4, 8 experts, capacity 4, 16] on the gathered sequence,
    # each device of cp dispatching 2 groups (4,096 B); after the dispatch [4, 4 local experts, 4, 16] = 4,096 B:
    # the experts' partial output forward and their tokens' gradient backward over tp, one such buffer each
    # (8,192 B each were the whole buffers, counted before: 8,192 B more than the compiled step)
    assert comm["experts"]["all-to-all"] == {"count": 4, "bytes": 4 * 4096}
    mods = {r["module"]: r for r in comm["modules"]}
    assert mods["layers_1.mlp.experts"]["style"] == "ExpertTensorParallel"
    # over tp: the attention's (4 a layer) and the dense layers_0 MLP's (3), [4, 8, 16] float32 = 2,048 B each
    # on a device's 8 of the 16 positions; the experts' 2 of 4,096 B
    assert comm["activations"]["all-reduce"] == {"count": 8 + 3 + 2, "bytes": 11 * 2048 + 2 * 4096}


@pytest.mark.slow  # a 16-device program compiled in a subprocess (~1.5 min on 2 cores)
def test_moe_experts_over_ep_and_tp_under_fsdp2_cp2_ep2_tp2_equals_one_device():
    """fsdp=2 x cp=2 x ep=2 x tp=2 on 16 devices, in its own process (``_fsdp_cp_ep_tp.py``; the tests' processes
    have 8): 3 SGD steps equal one device's within 1e-5, every collective kind of the table equal to the compiled
    step's (the experts' all-reduces over tp on each cp device's half of the buffers: 4,096 B less than counted
    on the whole ones before)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "--xla_force_host_platform_device_count=16"))
    out = subprocess.run([sys.executable, "-m", "tests.parallel._fsdp_cp_ep_tp"], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got["losses"], got["ref_losses"], rtol=1e-5, atol=1e-5)
    assert got["params"] < 1e-5
    # gate_proj [E, d, f]: d over fsdp, E over ep, f over tp, whole over cp
    assert got["placements"] == [["S(1)", "R", "S(0)", "S(2)"], [4, 8, 16]]
    table, hlo = got["table"], got["hlo"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):  # buffers and bytes
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), kind
    for kind in ("all-to-all", "collective-permute"):
        assert (hlo[kind]["count"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), kind
    # per device: 8 rows / (fsdp x ep) = 2 -> buffers [2, 8 experts, capacity 4, 16] on the gathered sequence, each
    # device of cp dispatching one group (2,048 B)
    assert got["experts"] == {"count": 4, "bytes": 4 * 2048}


@pytest.mark.slow
@pytest.mark.parametrize("dims", [("dp", "ep", "tp"), ("cp", "ep", "tp")])
def test_scanned_moe_experts_over_ep_and_tp_equals_one_device(dims):
    """``models.MoE``'s blocks as one nn.scan stack (experts in each): the stacked experts ``[L, E, d, f]`` cut on E
    over ep and on f over tp past the layer axis (``ExpertTensorParallel`` on ``layers.mlp.experts``), the
    attention's projections over tp; under dp=2 x ep=2 x tp=2 and cp=2 x ep=2 x tp=2 (sdpa: the ring), 3 SGD steps
    equal one device's within 1e-5 and every collective kind of the table equals the compiled step's (the scan's
    body counted once per layer)."""
    cp = "cp" in dims
    model = MoE(dataclasses.replace(SCANNED, attn_implementation="sdpa") if cp else SCANNED)
    batches = _cp_batches() if cp else _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=dims)
    pm = parallelize_module(parallelize_module(model, mesh["ep"], EP), mesh["tp"],
                            {**SCANNED_TP, "layers.mlp.experts": ExpertTensorParallel()})
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    for name, dim in (("gate_proj", 3), ("up_proj", 3), ("down_proj", 2)):  # [L, E, d, f] / [L, E, f, d]
        e = state.plan.entry(f"layers/mlp/experts/{name}")
        assert ([str(p) for p in e.placements], e.local_shape) == (["R", "S(1)", f"S({dim})"], (4, 4, 16, 16)), name
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = _compiled(step, state, batches[0])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    _assert_table_is_hlo(comm, hlo, ("all-gather", "reduce-scatter", "all-reduce") + (("collective-permute",) if cp
                                                                                      else ()))
    # per layer over tp: q/k/v's input gradients and o_proj's output (4), the experts' partial output and their
    # tokens' gradient (2), 2,048 B and 4,096 B per device either way: dp=2: 2 rows, [2, 16, 16] activations and
    # [2 x ep, 4 local experts, 4, 16] dispatched buffers; cp=2: 4 rows of 8 positions, [4, 8, 16], and each device
    # of cp on its half of the groups of the [4, 8, 4, 16] buffers, [2 x ep, 4, 4, 16] after the dispatch
    assert comm["activations"]["all-reduce"] == {"count": 4 * 6, "bytes": 4 * (4 * 2048 + 2 * 4096)}
