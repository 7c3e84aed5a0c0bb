"""auto_layout's pp x tp x ep candidates (``spmd.parallel.auto._cpep.pipelined``): ``models.MoE`` with experts in
every block on 8 devices, given Megatron's plan of its attention (``models._plans.decoder_tp_plan``), gets
``pp=2,ep=2,tp=2`` (the blocks in 2 stages, the experts over ep and the attention's projections over tp inside
them) beside the pp x ep ones, and none without a plan; the candidate, ranked by ``auto_layout``, prices the
table of its step, whose every collective equals the compiled program's. A scanned MoE's experts are counted past
the stack's layer axis."""

from __future__ import annotations

import jax
import optax
import pytest

from models._plans import decoder_tp_plan
from spmd.parallel import ExpertTensorParallel, apply_layout, auto_layout, hlo_executed_collectives, init_train_state, make_train_step
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._cpep import context_expert_layouts
from tests.parallel.auto.test_auto_cpep import CAL, KINDS, MOE_EVERY, _batch, _cal_price

PLAN = decoder_tp_plan(MOE_EVERY)  # q/k/v column-, o row-parallel (every block's MLP is experts: over ep)


def _pipelined_ep(plan):
    batch = _batch(16)
    params = jax.eval_shape(MOE_EVERY.init, jax.random.key(0), batch["inputs"])["params"]
    lays = [lay for lay in context_expert_layouts(8, plan, ("layers_*",), params, batch) if lay.pp > 1 and lay.ep > 1]
    return lays, params, batch


def test_an_moe_pipeline_gets_tp_times_ep_candidates_where_a_plan_is_given():
    lays, _, _ = _pipelined_ep(PLAN)
    # 8 rows: a replica of ep=2 has 4 (M=2, 4); of dp=2 x ep=2 or fsdp=2 x ep=2 2 (M=2); of ep=4 2 (M=2)
    assert sorted(lay.name for lay in lays) == sorted([
        "pp=2,dp=2,ep=2 1f1b M=2", "pp=2,fsdp=2,ep=2 1f1b M=2", "pp=2,ep=4 1f1b M=2",
        "pp=2,ep=2,tp=2 1f1b M=2", "pp=2,ep=2,tp=2 1f1b M=4"])
    tp = next(lay for lay in lays if lay.tp == 2)
    # the plan, and the experts' own tp (ExpertTensorParallel: f=32 over tp=2), as models.train lays them out
    assert tp.mesh_dims == (("pp", 2), ("ep", 2), ("tp", 2)) and dict(tp.tp_plan) == {
        **PLAN, "layers_*.mlp.experts": ExpertTensorParallel()}
    assert all(lay.tp == 1 for lay in _pipelined_ep(None)[0])  # no plan: no tp stages


@pytest.mark.slow  # one pipelined layout traced and compiled
def test_a_ranked_pipeline_with_tp_and_ep_prices_its_compiled_collectives():
    lays, params, batch = _pipelined_ep(PLAN)
    lay = next(lay for lay in lays if lay.name == "pp=2,ep=2,tp=2 1f1b M=2")
    got = auto_layout(MOE_EVERY, optax.sgd(0.1), batch, 8, layouts=[lay], calibration=CAL, params=params)
    best = got.best
    assert best.name == lay.name and not got.rejected
    laid, _ = apply_layout(MOE_EVERY, 8, best.layout)
    real = MOE_EVERY.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), params=real)
    hlo = hlo_executed_collectives(make_train_step(laid, default_loss(laid), optax.sgd(0.1)).compiled(
        state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers, an all-to-all's ops (as tests/parallel/pipelining/test_pipeline_experts.py)
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind
    # per device and micro-batch: 8 rows / (ep=2 x M=2) = 2 rows -> buffers [2, 8 experts, capacity 4, 16]
    # float32 = 4,096 B; 20 all-to-alls in the program (tests/parallel/pipelining/test_pipeline_experts.py)
    assert table["all-to-all"] == {"count": 20, "bytes": 20 * 4096}
    # priced as the busiest rank runs them: the first stage's 12 a step (per micro-batch its forward's dispatch and
    # combine, the recomputed forward's 2 and their 2 transposes; the last stage runs 8: its backward's 4), over
    # ep=2 (tests/parallel/pipelining/test_pipeline_experts.py)
    want = _cal_price({"count": 12, "bytes": 12 * 4096}, 2)
    assert best.comm_s["all-to-all"] == pytest.approx(want, rel=1e-9), best.comm_s
    assert best.comm_s["all-reduce"] > 0  # the all-reduces priced too (tp's activations among them)
    assert best.communication["activations"]["all-reduce"]["count"] > 0  # Megatron's f and g inside the stages
    row = next(line for line in got.table().splitlines() if line.startswith("1 "))
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):  # the printed MiB
        assert f"{hlo[kind]['bytes'] / 2**20:.2f}" in row.split(), kind


def test_a_scanned_moes_experts_are_counted_past_the_layer_axis():
    """``models.MoE`` with its 4 blocks as one nn.scan stack: its experts' kernels are [L=4, E=8, d, f]; the ep
    candidates are every ep that the 8 experts divide (ep=8 among them), not the 4 layers (which offered ep=2, 4
    only)."""
    import dataclasses

    from spmd.parallel.auto._cpep import experts_of
    from spmd.parallel.auto._pipeline import scanned_stack

    model = type(MOE_EVERY)(dataclasses.replace(MOE_EVERY.cfg, num_layers=4, scan_layers=True))
    batch = _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    stack = scanned_stack(model, params, (batch["inputs"],))
    assert stack == ("layers", 4)
    assert experts_of(params, stack[0]) == ("layers.mlp.experts", 8)
    eps = {lay.ep for lay in context_expert_layouts(8, None, (), params, batch, stack) if lay.cp == lay.pp == 1}
    assert eps == {2, 4, 8}
