"""auto_layout's activation-checkpointing candidates: the layout's name and refusals, which variants the budget
loop weighs (against a stub cost), and, where XLA:CPU's scheduler lets checkpointing save memory, the predicted
peak against the compiled step's memory_analysis and the pick under a budget only checkpointing meets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.parallel import Layout
from spmd.parallel.auto._auto import Candidate, _fitting
from spmd.parallel.auto._budget import CHECKPOINTING

UNITS = ("block_*",)
TWO = ("dots", "full")  # the policies the stub's budget loops weigh


def test_the_policy_is_named_and_refused_where_it_cannot_run():
    assert Layout(dp=8, units=UNITS, activation_checkpointing="full").name == "dp=8 ac=full"
    assert Layout(fsdp=4, dp=2, units=UNITS, reshard_after_forward=False, activation_checkpointing="dots",
                  accum_steps=2).name == "dp=2,fsdp=4 keep ac=dots accum=2"
    with pytest.raises(ValueError, match=re.escape("Layout: activation_checkpointing='some' is not a policy; use None "
                                                   "or one of 'full', 'dots', 'selective', 'minimal', "
                                                   "'save_dot_except_mlp', 'save_dot_except_mlpwi', 'save_qkv_proj', "
                                                   "'offload'.")):
        Layout(dp=8, units=UNITS, activation_checkpointing="some")
    with pytest.raises(ValueError, match=re.escape("Layout: pp=2 with activation_checkpointing='full': a pipeline's "
                                                   "backward pass already recomputes each stage")):
        Layout(pp=2, dp=4, units=UNITS, microbatches=2, activation_checkpointing="full")
    with pytest.raises(ValueError, match=re.escape("Layout: activation_checkpointing='dots' with units=(): name the "
                                                   "modules to recompute")):
        Layout(dp=8, activation_checkpointing="dots")


def _stub(peaks: dict):
    """An ``evaluate`` whose candidates' peak is ``peaks[name]`` (bytes) and time the accumulation steps, with
    every call recorded; fitting means a peak of at most 100."""
    calls = []

    def evaluate(lay: Layout) -> Candidate:
        calls.append(lay.name)
        peak = peaks[lay.name]
        return Candidate(layout=lay, predicted_s=float(lay.accum_steps), compute_s=0.0, comm_s={}, dispatch_s=0.0,
                         communication={}, memory={"peak": peak}, flops=0.0, fits=peak <= 100)

    return evaluate, calls


def test_the_budget_loop_weighs_each_policy_with_the_least_accumulation_that_fits():
    base = Layout(dp=8)
    evaluate, calls = _stub({"dp=8": 400, "dp=8 accum=2": 150, "dp=8 accum=4": 90, "dp=8 ac=dots": 120,
                             "dp=8 ac=dots accum=2": 80, "dp=8 ac=full": 100})
    got = _fitting(evaluate(base), evaluate, rows=32, units=UNITS, rejected=[], policies=TWO)  # 4 rows per replica: accum 2, 4
    assert [c.name for c in got] == ["dp=8 accum=4", "dp=8 ac=dots accum=2", "dp=8 ac=full"]
    # a policy that needs no less accumulation than a lighter one is slower and no smaller under the budget
    evaluate2, _ = _stub({"dp=8": 400, "dp=8 accum=2": 90, "dp=8 ac=dots": 200, "dp=8 ac=dots accum=2": 80,
                          "dp=8 ac=full": 100})
    assert [c.name for c in _fitting(evaluate2(base), evaluate2, rows=32, units=UNITS, rejected=[], policies=TWO)] == [
        "dp=8 accum=2", "dp=8 ac=full"]
    assert calls == ["dp=8", "dp=8 accum=2", "dp=8 accum=4", "dp=8 ac=dots", "dp=8 ac=dots accum=2", "dp=8 ac=full"]
    assert got[1].layout.units == UNITS and got[1].layout.activation_checkpointing == "dots"
    # every policy weighed, from the least recomputation to the most
    assert CHECKPOINTING == ("dots", "minimal", "offload", "save_dot_except_mlpwi", "save_dot_except_mlp", "selective",
                             "save_qkv_proj", "full")
    # none fitting: the smallest of the variants, for the error
    evaluate, _ = _stub({"dp=8": 400, "dp=8 ac=dots": 300, "dp=8 ac=full": 350})
    assert [c.name for c in _fitting(evaluate(base), evaluate, rows=8, units=UNITS, rejected=[], policies=TWO)] == ["dp=8 ac=dots"]


def test_a_layout_over_with_a_policy_of_its_own_weighs_the_heavier_ones():
    """A compiled ``ac=dots`` candidate over the budget with all the accumulation its rows allow (2 rows per
    replica): ``"full"`` is weighed for it at its accumulation (before: no variant, a dead end); a lighter
    policy is not weighed again."""
    base = Layout(dp=8, units=UNITS, activation_checkpointing="dots", accum_steps=2)
    evaluate, calls = _stub({"dp=8 ac=dots accum=2": 300, "dp=8 ac=full accum=2": 90})
    got = _fitting(evaluate(base), evaluate, rows=16, units=UNITS, rejected=[], policies=TWO)
    assert [c.name for c in got] == ["dp=8 ac=full accum=2"]
    assert calls == ["dp=8 ac=dots accum=2", "dp=8 ac=full accum=2"]
    evaluate, calls = _stub({"dp=8 ac=full": 300})  # the heaviest over: nothing heavier, the smallest for the error
    assert [c.name for c in _fitting(evaluate(Layout(dp=8, units=UNITS, activation_checkpointing="full")), evaluate,
                                     rows=8, units=UNITS, rejected=[], policies=TWO)] == ["dp=8 ac=full"]


@pytest.mark.parametrize("lay, weighed", [
    # re-gathered units save their matmul outputs already: "full" alone is a variant of them
    (Layout(fsdp=8, units=UNITS), ["fsdp=8 regather", "fsdp=8 regather ac=full"]),
    (Layout(pp=2, dp=4, units=UNITS, microbatches=2), ["pp=2,dp=4 1f1b M=2"]),  # a pipeline recomputes its stages
    (Layout(dp=8), ["dp=8"]),  # a model without repeated blocks (units=()): nothing to checkpoint
])
def test_no_policy_is_weighed_where_it_does_not_apply(lay, weighed):
    evaluate, calls = _stub({name: 400 for name in weighed})
    units = () if lay == Layout(dp=8) else UNITS
    got = _fitting(evaluate(lay), evaluate, rows=8, units=units, rejected=[], policies=TWO)  # one row per replica: no accumulation
    assert calls == weighed and [c.name for c in got] == weighed[:1]  # none fits: the smallest (the first)


def test_a_variant_that_cannot_be_built_is_rejected_with_its_reason():
    evaluate, calls = _stub({"dp=8": 400, "dp=8 ac=full": 90})

    def refusing(lay: Layout) -> Candidate:
        if lay.activation_checkpointing == "dots":
            raise ValueError("activation_checkpointing: no such unit")
        return evaluate(lay)

    rejected = []
    got = _fitting(evaluate(Layout(dp=8)), refusing, rows=8, units=UNITS, rejected=rejected, policies=TWO)
    assert [c.name for c in got] == ["dp=8 ac=full"]
    assert rejected == [("dp=8 ac=dots", "activation_checkpointing: no such unit")]


def test_kept_fsdp_units_are_checkpointed_and_only_the_fitting_variants_ranked():
    keep = Layout(fsdp=8, units=UNITS, reshard_after_forward=False)
    evaluate, calls = _stub({"fsdp=8 keep": 400, "fsdp=8 keep ac=dots": 200, "fsdp=8 keep ac=full": 99})
    got = _fitting(evaluate(keep), evaluate, rows=8, units=UNITS, rejected=[], policies=TWO)
    assert [c.name for c in got] == ["fsdp=8 keep ac=full"]
    assert calls == ["fsdp=8 keep", "fsdp=8 keep ac=dots", "fsdp=8 keep ac=full"]


_SCRIPT = r"""
import json, jax, numpy as np, optax
from models import Transformer
from spmd.parallel import Calibration, Layout, apply_layout, auto_layout, init_train_state, make_train_step
from spmd.parallel.auto._auto import default_loss, evaluate_layout
from spmd.parallel.cost._memory import Profile

net = Transformer(16, 128, num_layers=2, d_model=32, num_heads=8)
tok = np.random.default_rng(0).integers(0, 16, (8, 129)).astype(np.int32)
batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}  # one sequence per device: no accumulation to fall back on
params = net.init(jax.random.key(0), batch["inputs"])["params"]
opt = optax.adamw(1e-3)
prof = Profile(default_loss(net), params, opt)
cal = Calibration(collectives={k: (1e-4, 1e9) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                       "collective-permute")},
                  matmul_flops_per_s=1e10, elementwise_bytes_per_s=1e10, dispatch_s=1e-4, group_size=8)

def measured(lay):
    laid, mesh = apply_layout(net, 8, lay)
    state = init_train_state(laid, opt, params=params, mesh=mesh)
    m = make_train_step(laid, default_loss(laid), opt, mesh=mesh, donate=True).lower(state, batch).compile(
        ).memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes

U = ("block_*",)
out = {}
for lay in (Layout(dp=8), Layout(dp=8, units=U, activation_checkpointing="dots"),
            Layout(dp=8, units=U, activation_checkpointing="full"),
            Layout(fsdp=8, units=U, reshard_after_forward=False, activation_checkpointing="full")):
    c = evaluate_layout(net, opt, batch, 8, lay, calibration=cal, profile=prof)
    out[lay.name] = [int(c.memory["peak"]), int(measured(lay))]
budget = (out["dp=8"][1] + out["dp=8 ac=dots"][1]) // 2
ranked = auto_layout(net, opt, batch, 8, layouts=[Layout(dp=8)], calibration=cal, memory_budget_bytes=budget,
                     profile=prof)
out["budget"] = budget
out["ranked"] = [[c.name, c.fits] for c in ranked]
out["pick"] = int(measured(ranked.best.layout))
print(json.dumps(out))
"""


def test_under_a_scheduler_that_lets_it_save_the_pick_checkpoints_and_fits():
    """XLA:CPU's default scheduler hoists the recomputation back beside the forward pass (checkpointing saves
    nothing there, and the estimate, measured on the one-device step, says so); its memory-minimizing one
    does not. In a fresh process, since the flag is global to a process: the lower bound of each policy is below
    its memory_analysis(), and under a budget dp=8 misses by its activations once compiled, with no
    accumulation to fall back on, the pick checkpoints and its compiled step fits."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                      "--xla_cpu_enable_concurrency_optimized_scheduler=false", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("dp=8", "dp=8 ac=dots", "dp=8 ac=full", "fsdp=8 keep ac=full"):
        bound, compiled = got[name]
        assert bound <= compiled, (name, bound, compiled)
    # the saving is real (the attention scores, 8 heads of 128 x 128, recomputed), and the bound follows it
    assert got["dp=8 ac=full"][1] < 0.9 * got["dp=8"][1] and got["dp=8 ac=dots"][1] < got["dp=8"][1]
    assert got["dp=8 ac=full"][0] < got["dp=8 ac=dots"][0] == got["dp=8"][0]  # the matmul outputs: kept by both
    # dp=8 compiled over; its variants join: "dots" compiled and fits ("full" needs no less accumulation and
    # recomputes the matmuls too: dropped)
    assert got["ranked"][0] == ["dp=8 ac=dots", True] and ["dp=8", False] in got["ranked"], got["ranked"]
    assert got["pick"] <= got["budget"], got


def _keep_peak(layers: int, policy: str | None, seq: int = 1024) -> tuple[int, int]:
    """(compiled peak of the fsdp=8 keep step of a ``layers``-block Transformer, one sequence of ``seq`` a device;
    one block's parameter bytes)."""
    import jax
    import numpy as np
    import optax

    from models import Transformer
    from spmd.parallel import apply_layout, init_train_state, make_train_step
    from spmd.parallel.auto._auto import default_loss

    net = Transformer(16, seq, num_layers=layers, d_model=64, num_heads=4)
    tok = np.random.default_rng(0).integers(0, 16, (8, seq + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), batch["inputs"])["params"])
    lay = Layout(fsdp=8, units=UNITS, reshard_after_forward=False, activation_checkpointing=policy)
    laid, mesh = apply_layout(net, 8, lay)
    opt = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: init_train_state(laid, opt, params=params, mesh=mesh))
    m = make_train_step(laid, default_loss(laid), opt, mesh=mesh).lower(state, batch).compile().memory_analysis()
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["block_0"]))
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes, block


@pytest.mark.slow
def test_a_checkpointed_keeping_unit_holds_only_its_inputs_under_the_default_scheduler():
    """fsdp=8 keep ac=full under XLA:CPU's default scheduler (the one the planner's compiles run): what one more
    block adds to the compiled peak is what must stay live for it, counted from the shapes: its parameter, mu and
    nu shards in the step's arguments and again in its outputs (the state is not donated), its gathered
    parameters (kept) and its input [1, T, d] float32. Before the backward pass was tied to the unit's cotangent
    the recomputation ran at the end of the forward pass and the delta was the uncheckpointed one's (40.2 MB
    a block, its T x T scores and MLP activations; Llama 3 8B dp=8,fsdp=8 keep 4.45 GiB under every policy).
    Measured after: 1.21 MB a block against 0.61 MB counted (XLA keeps some of the block's inputs twice)."""
    seq = 1024
    (p2, block), (p4, _) = _keep_peak(2, "full", seq), _keep_peak(4, "full", seq)
    (n2, _), (n4, _) = _keep_peak(2, None, seq), _keep_peak(4, None, seq)
    live = 2 * 3 * block // 8 + block + seq * 64 * 4  # state shards in and out, gathered params, the block input
    full, none = (p4 - p2) / 2, (n4 - n2) / 2
    assert none > 20 * live, (none, live)  # the activations the checkpoint drops dominate
    assert full < 2.5 * live, (full, live, none)


def _llama_tp_peak(layers: int, policy: str | None, seq: int = 1024) -> tuple[int, int]:
    """(compiled peak of a small Llama's fsdp=4,tp=2 re-gathering step in bfloat16, Megatron's plan and the
    lm_head column-parallel, one sequence of ``seq`` a device (two a tp pair); one layer's parameter bytes)."""
    import jax
    import numpy as np
    import optax

    from models._llama import Llama, LlamaConfig
    from spmd.parallel import ColwiseParallel, RowwiseParallel, apply_layout, init_train_state, make_train_step
    from spmd.parallel.auto._auto import default_loss
    from spmd.parallel.cost._memory import READ_ONLY

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = (*((f"layers_*.self_attn.{p}", col) for p in ("q_proj", "k_proj", "v_proj")),
            ("layers_*.self_attn.o_proj", row), ("layers_*.mlp.gate_proj", col), ("layers_*.mlp.up_proj", col),
            ("layers_*.mlp.down_proj", row), ("lm_head", col))
    net = Llama(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=layers, num_heads=4,
                            num_kv_heads=2))
    tok = np.random.default_rng(0).integers(0, 64, (8, seq + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), batch["inputs"][:1])["params"])
    lay = Layout(fsdp=4, tp=2, tp_plan=plan, units=("layers_*",), activation_checkpointing=policy,
                 mixed_precision="bfloat16")
    laid, mesh = apply_layout(net, 8, lay)
    opt = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: init_train_state(laid, opt, params=params, mesh=mesh))
    m = make_train_step(laid, default_loss(laid), opt, mesh=mesh).lower(state, batch).compile(
        READ_ONLY).memory_analysis()
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers_0"]))
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes, block


@pytest.mark.slow
def test_a_checkpointed_regathering_unit_recomputes_nothing_before_its_cotangent():
    """fsdp=4,tp=2 regather ac=full (bfloat16) under XLA:CPU's default scheduler: one more layer adds what must
    stay live for it, counted from the shapes: its parameter, mu and nu shards (cut 8 ways) in the arguments and
    again in the outputs, its gathered parameters (counted, though re-gathered) and its input, [2, T, d] float32
    (two sequences a tp pair). A re-gathering unit tied only its shards to its cotangent, so what its backward
    pass recomputes from its input alone (the norms' statistics) ran at the end of the forward pass, every
    layer's at once: 2.28 MB a layer against 0.96 MB counted (Llama 3 8B fsdp=8,tp=8: 5.4 GiB a layer); now
    0.71 MB (8B: 1.39 GiB)."""
    seq = 1024
    (p2, block), (p4, _) = _llama_tp_peak(2, "full", seq), _llama_tp_peak(4, "full", seq)
    (n2, _), (n4, _) = _llama_tp_peak(2, None, seq), _llama_tp_peak(4, None, seq)
    live = 2 * 3 * block // 8 + block + 2 * seq * 64 * 4
    full, none = (p4 - p2) / 2, (n4 - n2) / 2
    assert none > 20 * live, (none, live)
    assert full < 1.5 * live, (full, live, none)


@pytest.mark.slow
def test_full_on_tp_prices_its_recomputed_tp_collectives_over_tp():
    """``models.Llama`` (2 layers, d 16) on dp=4 x tp=2 (Megatron's plan) under "full" and under "dots": "full"
    runs each layer's o_proj all-reduce again in the backward pass (its step's table: ``recomputed``, by mesh dim
    ``{"tp": ...}``), "dots" keeps it; the planner prices those all-reduces over tp (2 devices, adjacent: the
    innermost dim), not over the data dims (4 devices, 2 apart), and nothing else differs between the two:
    the all-reduce seconds differ by 2 of H100's all-reduces of [2 rows, 8, 16] float32 over 2 adjacent
    devices."""
    import jax
    import numpy as np
    import optax

    from models._llama import Llama, LlamaConfig
    from spmd.parallel import ColwiseParallel, RowwiseParallel
    from spmd.parallel.auto._auto import evaluate_layout
    from spmd.parallel.auto._priced import HardwareRates
    from spmd.parallel.cost._hardware import HARDWARE

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = (*((f"layers_*.self_attn.{p}_proj", col) for p in "qkv"), ("layers_*.self_attn.o_proj", row),
            ("layers_*.mlp.gate_proj", col), ("layers_*.mlp.up_proj", col), ("layers_*.mlp.down_proj", row))
    net = Llama(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2))
    tok = np.random.default_rng(0).integers(0, 24, (8, 9)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    cal = HardwareRates(HARDWARE["h100"], "float32")
    got = {p: evaluate_layout(net, optax.sgd(0.1), batch, 8, Layout(dp=4, tp=2, tp_plan=plan, units=("layers_*",),
                                                                     activation_checkpointing=p), calibration=cal)
           for p in ("full", "dots")}
    act = 2 * 8 * 16 * 4
    want = 2 * HARDWARE["h100"].collective_s("all-reduce", act, 2, 1)
    assert want > 0 and HARDWARE["h100"].collective_s("all-reduce", act, 4, 2) != want / 2
    diff = got["full"].comm_s["all-reduce"] - got["dots"].comm_s["all-reduce"]
    assert abs(diff - want) <= 1e-9 * want, (diff, want)
    for kind in ("all-gather", "reduce-scatter"):
        assert got["full"].comm_s.get(kind, 0.0) == got["dots"].comm_s.get(kind, 0.0)
