"""auto_layout's figures from the program: a candidate's peak is its compiled step's memory_analysis() (the lower
bound from shapes below it), its flops the compiled step's cost_analysis() (a loop's body counted once by XLA:
the accumulating step costed from its micro-batch step), the mixed-precision candidates, and ``depth=``: the
figures at 3 and 4 blocks carried to the model's depth, checked against the full model compiled. The expected
numbers come from steps built and compiled here by hand through the public contract."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import optax
import pytest

from models import Transformer
from spmd.parallel import Layout, apply_layout, auto_layout, init_train_state, make_train_step
from spmd.parallel.auto import _compiled
from spmd.parallel.auto._auto import default_loss, evaluate_layout
from spmd.parallel.auto._compiled import carried, compile_figures, slice_depths
from spmd.parallel.cost._hardware import HARDWARE
from spmd.parallel.cost._memory import Profile, _cost
from spmd.parallel.step._protocol import StepMemory

VOCAB, T, B = 16, 16, 16
OPT = optax.adamw(1e-3)
U = ("block_*",)


def _model(layers: int) -> Transformer:
    return Transformer(VOCAB, T, num_layers=layers, d_model=32, num_heads=4)


def _batch(rows: int = B) -> dict:
    tok = np.random.default_rng(0).integers(0, VOCAB, (rows, T + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _by_hand(model, lay: Layout, batch: dict, options: dict | None = None):
    """The step of ``lay`` built through the contract on real zeros of the parameters, donating its state (as
    the planner compiles it), compiled; given the
    example inputs as ``auto_layout`` gives them (``_measure.example_inputs``: the plan then cuts a kernel whose
    gradient is its dot's output transposed on its output dim, another program than the dim-0 cut's)."""
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    laid, mesh = apply_layout(model, 8, lay)
    state = init_train_state(laid, OPT, batch["inputs"], params=params, mesh=mesh)
    return make_train_step(laid, default_loss(laid), OPT, accum_steps=lay.accum_steps, mesh=mesh,
                           donate=True).lower(state, batch).compile(options)


def _flops(exe) -> float:
    c = exe.cost_analysis()
    return float((c[0] if isinstance(c, (list, tuple)) else c)["flops"])


@pytest.mark.slow  # five compiles of a two-block model
def test_compiled_figures_are_the_steps_own_and_the_bound_is_below_them():
    model, batch = _model(2), _batch()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(model), params, OPT)
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U), Layout(fsdp=8, units=U, reshard_after_forward=False,
                                                              activation_checkpointing="full")):
        got = compile_figures(model, OPT, default_loss, params, batch, jax.devices()[:8], lay)
        exe = _by_hand(model, lay, batch)
        assert got["memory"] == StepMemory.from_compiled(exe), lay.name
        assert got["flops"] == pytest.approx(_cost(exe)[0], rel=1e-6), lay.name
        bound = evaluate_layout(model, OPT, batch, 8, lay, params=params, profile=prof,
                                calibration=_rates()).memory
        assert not bound["compiled"] and bound["peak"] <= got["memory"].peak, (lay.name, bound, got["memory"])
    # accumulation: XLA counts the loop's body once; the figures are the accumulating program's own, both
    # micro-batches' work counted (and the accumulator's elementwise work each micro-batch: more than the plain
    # step on the whole batch, by a few percent beside the matmuls), compiled once
    acc = compile_figures(model, OPT, default_loss, params, batch, jax.devices()[:8], Layout(dp=8, accum_steps=2))
    exe = _by_hand(model, Layout(dp=8, accum_steps=2), batch)
    assert acc["flops"] == pytest.approx(_cost(exe)[0], rel=1e-6)
    assert acc["flops"] > 1.5 * _flops(exe)  # XLA's own count: the loop's body once
    plain = _cost(_by_hand(model, Layout(dp=8), batch))[0]
    assert plain < acc["flops"] < 1.1 * plain, (acc["flops"], plain)


def _rates():
    from spmd.parallel.auto._priced import HardwareRates

    return HardwareRates(HARDWARE["h100"], "float32")


@pytest.mark.slow  # compiles the candidate at 1, 2, 3 and 4 blocks, and the 6-block model by hand
def test_depth_carries_the_figures_of_three_and_four_blocks_to_the_models_depth(monkeypatch):
    """``depth=``: the candidate traced and compiled at 3 and 4 blocks and carried affinely to 6; the peak within
    1% of the 6-block step compiled whole by hand, the flops within 1e-5. The layout (fsdp=8 re-gathering) is
    one whose peak is not steady from 1 block: the peak carried from the 1- and 2-block steps compiled as the
    planner compiles them is checked to be more than 5% off the 6-block one (+12% measured; from 2 and 3 blocks
    -6%). Compiled with XLA:CPU's fusion emitters, as outside the tests (conftest leaves them out: the peak of
    this model is then steady within 2% from 1 block, 125,280 B from 1 to 2, 122,912 from 3 on)."""
    emitters = {"xla_cpu_use_fusion_emitters": True}
    monkeypatch.setattr(_compiled, "READ_ONLY", {**_compiled.READ_ONLY, **emitters})
    model, batch = _model(6), _batch()
    lay = Layout(fsdp=8, units=U)
    got = auto_layout(model, OPT, batch, 8, layouts=[lay], hardware="h100", depth=_model, units=U)
    c = got.best
    assert c.memory["compiled"]
    six = _by_hand(model, lay, batch, emitters)
    peak = StepMemory.from_compiled(six).peak
    assert c.measured_peak == pytest.approx(peak, rel=0.01), (c.measured_peak, peak)
    assert c.flops == pytest.approx(_cost(six)[0], rel=1e-5)
    p1, p2 = (compile_figures(m, OPT, default_loss, jax.eval_shape(lambda m=m: m.init(
        jax.random.key(0), batch["inputs"])["params"]), batch, jax.devices()[:8], lay)["memory"].peak
        for m in (_model(1), _model(2)))
    assert abs((p1 + 5 * (p2 - p1)) / peak - 1) > 0.05, (p1, p2, peak)  # carried from 1 and 2 blocks: off
    with pytest.raises(ValueError, match=re.escape("auto_layout: depth(3) has 2 blocks matching 'block_*', not 3")):
        auto_layout(model, OPT, batch, 8, layouts=[lay], hardware="h100", depth=lambda n: _model(2), units=U)
    with pytest.raises(TypeError, match=re.escape("auto_layout: depth=4 must be a callable n -> the model")):
        auto_layout(model, OPT, batch, 8, layouts=[lay], hardware="h100", depth=4, units=U)


def test_the_slices_are_three_and_four_blocks_and_never_deeper_than_the_model():
    """``slice_depths``: 3 and 4 blocks (the block added a middle one), a model of fewer compiled at its own
    count and one less; ``carried``: affine from the lower slice, by hand."""
    assert [slice_depths(n) for n in (1, 2, 3, 4, 80)] == [(1, 2), (1, 2), (2, 3), (3, 4), (3, 4)]
    assert carried(10, 13, 80, 3) == 10 + 77 * 3 and carried(10, 13, 3, 3) == 10
    assert carried({"peak": 10, "compiled": True}, {"peak": 14}, 6, 3) == {"peak": 22, "compiled": True}
    assert carried(1.5, 2.0, 4, 3) == 2.0 and carried(float("inf"), 2.0, 9, 3) == float("inf")
    with pytest.raises(ValueError, match=re.escape("slice_depths: blocks=0 must be an int >= 1")):
        slice_depths(0)


@pytest.mark.slow  # traces and compiles FSDP candidates in float32 and bfloat16
def test_mixed_precision_is_a_candidate_that_gathers_and_computes_in_bfloat16():
    """``mixed_precision="bfloat16"``: every FSDP layout is weighed computing in bfloat16 too (fully_shard's
    MixedPrecisionPolicy, reductions in float32): its gathers move half the bytes, its matmuls are priced at
    the bfloat16 rate, and it is refused without FSDP."""
    model, batch = _model(2), _batch()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    prof = Profile(default_loss(model), params, OPT)
    # memory without limit: the estimates' compute their matmuls' side of the roofline (_priced.step_floor)
    rates = dataclasses.replace(_rates(), hardware=dataclasses.replace(HARDWARE["h100"], memory_bandwidth=math.inf))
    f32 = evaluate_layout(model, OPT, batch, 8, Layout(fsdp=8, units=U), params=params, profile=prof,
                          calibration=rates)
    bf16 = evaluate_layout(model, OPT, batch, 8, Layout(fsdp=8, units=U, mixed_precision="bfloat16"), params=params,
                           profile=prof, calibration=rates)
    ag = [c.communication["total"]["all-gather"]["bytes"] for c in (f32, bf16)]
    rs = [c.communication["total"]["reduce-scatter"]["bytes"] for c in (f32, bf16)]
    assert ag[1] * 2 == ag[0] and rs[1] == rs[0]  # gathered in bf16, reduced in f32
    h = HARDWARE["h100"]
    assert f32.compute_s / bf16.compute_s == pytest.approx(h.matmul_flops["bfloat16"] / h.matmul_flops["float32"])
    assert bf16.name == "fsdp=8 regather mp=bf16"
    got = auto_layout(model, OPT, batch, 8, hardware="h100", units=U, mixed_precision="bfloat16", params=params,
                      profile=prof)
    names = [c.name for c in got] + [n for n, _ in got.rejected]
    assert "fsdp=8 keep mp=bf16" in names and all("fsdp=" in n for n in names if "mp=" in n)
    with pytest.raises(ValueError, match=re.escape("Layout: mixed_precision='bfloat16' with fsdp=1")):
        Layout(dp=8, mixed_precision="bfloat16")
    with pytest.raises(ValueError, match=re.escape("auto_layout: mixed_precision='int8' must be a floating dtype")):
        auto_layout(model, OPT, batch, 8, hardware="h100", mixed_precision="int8", params=params, profile=prof)


def test_the_planners_step_donates_its_state():
    """The step ``compile_figures`` compiles donates its state, as a training loop runs it: XLA aliases the new
    state to the old one's buffers, the state's bytes on a device (parameter shards and adamw's moments and count
    cut as the state is, and the step counter: counted from the state's own shapes), held once; its peak is
    ``argument + output + temp - alias``."""
    model, batch = _model(1), _batch()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    lay = Layout(fsdp=8, units=U)
    laid, mesh = apply_layout(model, 8, lay)
    real = model.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, OPT, batch["inputs"], params=real, mesh=mesh)
    held = sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
               for x in jax.tree.leaves((state.step, state.params, state.opt_state)))
    got = compile_figures(model, OPT, default_loss, params, batch, jax.devices()[:8], lay)["memory"]
    assert got.alias == held > 0 and got.argument == held + B // 8 * T * 4 * 2  # and the batch's two int32 leaves
    assert got.peak == got.argument + got.output + got.temp - got.alias


def test_buffer_assignment_dump_sums_as_memory_analysis():
    """``buffer_assignment_memory`` of a compiled step's dumped buffer assignment is its ``memory_analysis()``."""
    import glob
    import tempfile

    from spmd.parallel.auto._compiled import buffer_assignment_memory
    from spmd.parallel.auto._measure import _built
    from spmd.parallel.cost._memory import READ_ONLY

    model, batch = _model(1), _batch()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    for lay in (Layout(dp=8), Layout(fsdp=8, units=U, mixed_precision="bfloat16")):
        step, state, b = _built(model, OPT, default_loss, params, batch, jax.devices()[:8], lay, abstract=True)
        where = tempfile.mkdtemp()
        exe = step.lower(state, b).compile({**READ_ONLY, "xla_dump_to": where})
        [dump] = glob.glob(where + "/*buffer-assignment.txt")
        with open(dump) as f:
            assert buffer_assignment_memory(f.read()) == StepMemory.from_compiled(exe), lay.name


def test_a_bfloat16_program_is_held_as_hardware_running_bfloat16_holds_it():
    """``bf16_memory``: XLA:CPU computes a bfloat16 dot in float32 (its operands and product converted: 4 bytes
    an element); compiled without that normalization the program holds its own bfloat16 buffers, counted here
    from the shapes: ``tanh(x @ w) @ w.T`` keeps one [256, 512] bfloat16 product besides its arguments and
    output. A bfloat16 all-reduce, for which XLA:CPU has no code, is read off the buffer assignment: per device
    its [64, 128] rows and the whole [128, 128] weight, the product, the psum's output."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.parallel.auto._compiled import bf16_memory
    from spmd.parallel.cost._memory import READ_ONLY

    w, x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16), jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    low = jax.jit(lambda w, x: jnp.tanh(x @ w) @ w.T).lower(w, x)
    assert bf16_memory(low) == StepMemory(argument=(512 + 256) * 512 * 2, output=256 * 512 * 2, temp=256 * 512 * 2,
                                          alias=0)
    assert StepMemory.from_compiled(low.compile(READ_ONLY)).temp >= (512 + 256) * 512 * 4  # float32 copies
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    f = jax.shard_map(lambda x, w: jax.lax.psum(x @ w, "i"), mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    low = jax.jit(f).lower(jax.ShapeDtypeStruct((8 * 64, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("i"))),
                           jax.ShapeDtypeStruct((128, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P())))
    assert bf16_memory(low) == StepMemory(argument=(64 + 128) * 128 * 2, output=64 * 128 * 2, temp=64 * 128 * 2,
                                          alias=0)


@pytest.mark.slow  # one compile of a one-block step (13 s on a loaded host)
def test_the_timed_step_runs_on_finite_values_with_a_gradient():
    """``auto_layout(measure=)`` times each candidate's step on ``host_pattern`` parameters and ``timed_batch``
    (here a batch of shape structs, as the planner may be given: ones, a mask of ones): its loss is finite, the
    one-device loss of the parameters it was given (``model.apply`` on the host's values), and its gradient not
    zero. On zeros the gradient was zero, and a masked loss 0 / 0 = NaN."""
    from spmd.parallel.auto._measure import _built, host_pattern

    model = _model(1)
    batch = {**_batch(), "mask": np.ones((B, T), np.float32)}
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])

    def masked_loss(laid):
        def loss_fn(p, b):
            logits = laid.apply({"params": p}, b["inputs"])
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
            return (nll * b["mask"]).sum() / b["mask"].sum()
        return loss_fn

    step, state, b = _built(model, OPT, masked_loss, params, structs, jax.devices()[:8], Layout(dp=8))
    _, metrics = step(state, b)
    got = jax.device_get(metrics)
    ones = np.ones((B, T), np.int32)
    logits = model.apply({"params": host_pattern(params)}, ones)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, ones).mean()
    assert np.isfinite(got["loss"]) and np.isfinite(got["grad_norm"]) and got["grad_norm"] > 0
    np.testing.assert_allclose(got["loss"], want, rtol=1e-5)
