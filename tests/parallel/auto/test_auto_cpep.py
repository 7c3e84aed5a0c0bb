"""auto_layout's context- and expert-parallel candidates (``spmd.parallel.auto._cpep``).

- ``models.MoE`` (top-2 of 8 experts): the ep candidates are every ep the expert count divides, with the rest of
  the devices over dp x fsdp; each candidate's table (its ``total``: the experts' all-to-alls, the gradients'
  all-reduces, FSDP's gathers) equals the collectives of its compiled step;
- ``models.Llama`` (``jax.nn.dot_product_attention``) on a long sequence under a memory budget built from the
  compiled peaks (between the cp=8 step's and the smallest of the cp-free steps with every block recomputed):
  the pick cuts the sequence over cp and its compiled peak fits, and every cp-free candidate whose bound fits
  is over once compiled;
- a model calling no attention gets no cp candidate: the first one is refused with the reason, which stands for
  the rest;
- ``models.Transformer`` (its own einsum attention) gets cp candidates, its attention modules run on the sequence
  gathered over cp, each candidate's table equal to its compiled step's collectives;
- ``models.MoE`` gets cp x ep candidates (every cp and ep whose product divides the devices, the rest over dp x
  fsdp), the tables of two equal to their compiled steps' collectives (the routers on the gathered sequence, the
  experts' all-to-alls over ep);
- pipelines with cp or ep: ``models.Llama`` (sdpa) gets pp x cp candidates and ``models.MoE`` (experts in every
  block) pp x ep ones (the exact sets); the pick of ``pp=2,fsdp=2,cp=2`` and of ``pp=2,ep=4`` each prints a table
  (its ``total``) equal to its compiled step's collectives; a model's own einsum attention under a pipeline
  (``pp=2,dp=2,cp=2``) is weighed, its table equal to the compiled step's and its attention whole on every cp rank.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from models import Llama, LlamaConfig, MoE, MoEConfig, Transformer
from spmd.parallel import Calibration, Layout, apply_layout, auto_layout, executed_collectives, init_train_state
from spmd.parallel import hlo_executed_collectives, make_train_step
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._compiled import compile_figures
from spmd.parallel.auto._cpep import _routes, context_expert_layouts
from spmd.parallel.auto._layout import infer_units

CAL = Calibration(collectives={k: (1e-4, 1e9) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                       "collective-permute", "all-to-all")},
                  matmul_flops_per_s=1e10, elementwise_bytes_per_s=1e10, dispatch_s=1e-4, group_size=8)
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _cal_price(v: dict, group: int) -> float:
    """CAL's price of ``v["count"]`` collectives moving ``v["bytes"]`` over ``group`` devices, by hand: each its
    latency (1e-4 s) and its bytes at 1e9 B/s, scaled by the ring's traffic per byte from CAL's group of 8."""
    if group < 2 or not v["count"]:
        return 0.0
    return v["count"] * 1e-4 + v["bytes"] * ((group - 1) / group) / (7 / 8) / 1e9


def _batch(t: int, b: int = 8):
    tok = np.random.default_rng(0).integers(0, 24, (b, t + 1)).astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


MOE = MoE(MoEConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    num_experts=8, top_k=2, capacity_factor=1.0))


def _tables_equal_hlo(model, got, batch):
    """Each candidate's table (its ``total``) equals the collectives of its step compiled as it runs (traced once
    by ``communication`` first: under cp the step finds the modules to run on the gathered sequence there)."""
    for c in got:
        laid, mesh = apply_layout(model, 8, c.layout)
        real = model.init(jax.random.key(0), batch["inputs"])["params"]
        state = init_train_state(laid, optax.sgd(0.1), params=real, mesh=mesh)
        step = make_train_step(laid, default_loss(laid), optax.sgd(0.1), mesh=mesh)
        comm = step.communication(state, batch)
        hlo = executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)
        table = c.communication["total"]
        assert table == comm["total"], c.name
        for kind in KINDS:  # the table counts buffers, an all-to-all's ops (as tests/parallel/test_expert_step.py)
            want = table.get(kind, {"count": 0, "bytes": 0})
            assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
                want["count"], want["bytes"]), (c.name, kind)
        yield c, comm


@pytest.mark.slow  # four layouts traced, three compiled
def test_moe_ep_candidates_tables_equal_their_compiled_collectives():
    model = MoE(MoEConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, num_experts=8, top_k=2, capacity_factor=1.0))
    batch = _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    units = infer_units(params)
    ep = [lay for lay in context_expert_layouts(8, None, units, params, batch) if lay.ep > 1 and lay.cp == lay.pp == 1]
    assert sorted(lay.name for lay in ep) == sorted([
        "dp=4,ep=2", "dp=2,fsdp=2,ep=2 regather", "dp=2,fsdp=2,ep=2 keep", "fsdp=4,ep=2 regather",
        "fsdp=4,ep=2 keep", "dp=2,ep=4", "fsdp=2,ep=4 regather", "fsdp=2,ep=4 keep", "ep=8"])
    assert {lay.ep_plan[0][0] for lay in ep} == {"layers_*.mlp.experts"}
    picked = [lay for lay in ep if lay.name in ("ep=8", "dp=2,ep=4", "fsdp=2,ep=4 keep")]
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=picked, calibration=CAL, params=params)
    assert sorted(c.name for c in got) == sorted(lay.name for lay in picked)
    for c in got:
        laid, mesh = apply_layout(model, 8, c.layout)
        real = model.init(jax.random.key(0), batch["inputs"])["params"]
        state = init_train_state(laid, optax.sgd(0.1), params=real, mesh=mesh)
        step = make_train_step(laid, default_loss(laid), optax.sgd(0.1), mesh=mesh)
        hlo = executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)
        table = c.communication["total"]
        assert table["all-to-all"]["count"] > 0, c.name
        for kind in KINDS:  # the table counts buffers, an all-to-all's ops (as tests/parallel/test_expert_step.py)
            want = table.get(kind, {"count": 0, "bytes": 0})
            got = hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]
            assert got == (want["count"], want["bytes"]), (c.name, kind)
        # the all-to-alls alone run over ep, priced from the table as CAL prices them
        assert c.comm_s["all-to-all"] == pytest.approx(_cal_price(table["all-to-all"], c.layout.ep), rel=1e-9)


@pytest.mark.slow  # the candidates traced, the cp-free ones' smallest variants and the pick compiled
@pytest.mark.timeout(600)  # 196 s alone on a loaded 2-core machine, 250 s with the pp x cp candidates traced too
def test_a_long_sequence_under_a_tight_budget_picks_cp():
    model = Llama(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, attn_implementation="sdpa"))
    batch, opt = _batch(512), optax.sgd(0.1)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    units, devices = ("layers_*",), jax.devices()[:8]

    def peak(lay):
        return compile_figures(model, opt, default_loss, params, batch, devices, lay)["memory"].peak

    # the cp-free layouts at their smallest (every block recomputed: one sequence per device, no accumulation)
    free = min(peak(Layout(dp=8, units=units, activation_checkpointing="full")),
               peak(Layout(fsdp=8, units=units, activation_checkpointing="full")),
               peak(Layout(fsdp=8, units=units, reshard_after_forward=False, activation_checkpointing="full")))
    cp = peak(Layout(dp=1, cp=8))
    assert cp < free / 2, (cp, free)
    budget = (cp + free) // 2
    got = auto_layout(model, opt, batch, 8, calibration=CAL, params=params, memory_budget_bytes=budget)
    best = got.best
    assert best.layout.cp > 1 and best.fits and best.measured_peak is not None and best.measured_peak <= budget
    # every cp-free candidate is over once compiled: those the ranking compiled, and those it lists as fitting
    # by their lower bound alone (ranked behind the pick, so never compiled there) compiled here
    free_peaks = {c.name: c.measured_peak if c.measured_peak is not None else peak(c.layout)
                  for c in got if c.layout.cp == 1 and (c.fits or c.measured_peak is not None)}
    assert free_peaks and all(p > budget for p in free_peaks.values()), free_peaks


class _NoAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Embed(24, 16)(x)
        for i in range(2):
            x = x + nn.Dense(16, name=f"layers_{i}")(x)
        return nn.Dense(24)(x)


def test_a_model_without_attention_gets_no_cp_candidate():
    model, batch = _NoAttention(), _batch(8)
    lays = [lay for lay in context_expert_layouts(8, None, (), jax.eval_shape(
        model.init, jax.random.key(0), batch["inputs"])["params"], batch)]
    assert lays and all(lay.cp > 1 for lay in lays)  # no experts: no ep candidate
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[Layout(dp=8), *lays[:2]], calibration=CAL)
    assert [c.name for c in got] == ["dp=8"]
    assert [n for n, _ in got.rejected] == [lay.name for lay in lays[:2]]
    assert all("the model calls no attention the cp step recognizes" in r for _, r in got.rejected)


def test_moe_gets_cp_times_ep_candidates():
    batch = _batch(16)
    params = jax.eval_shape(MOE.init, jax.random.key(0), batch["inputs"])["params"]
    lays = context_expert_layouts(8, None, infer_units(params), params, batch)
    both = sorted(lay.name for lay in lays if lay.cp > 1 and lay.ep > 1)
    assert both == sorted(["dp=2,ep=2,cp=2", "fsdp=2,ep=2,cp=2 regather", "fsdp=2,ep=2,cp=2 keep", "ep=2,cp=4",
                           "ep=4,cp=2"])
    assert all(lay.size == 8 and lay.ep_plan[0][0] == "layers_*.mlp.experts" for lay in lays if lay.ep > 1)
    # a router (the module enclosing the experts) is no attention; a module beside it is
    assert _routes("layers_1.mlp", lays[-1].ep_plan) and not _routes("layers_0.self_attn", lays[-1].ep_plan)
    assert not _routes("layers_1.mlp.experts", lays[-1].ep_plan)


@pytest.mark.slow  # two layouts traced and compiled
def test_moe_cp_times_ep_tables_equal_their_compiled_collectives():
    batch = _batch(16)
    params = jax.eval_shape(MOE.init, jax.random.key(0), batch["inputs"])["params"]
    picked = [lay for lay in context_expert_layouts(8, None, infer_units(params), params, batch)
              if lay.name in ("dp=2,ep=2,cp=2", "ep=4,cp=2")]
    got = auto_layout(MOE, optax.sgd(0.1), batch, 8, layouts=picked, calibration=CAL, params=params)
    assert sorted(c.name for c in got) == ["dp=2,ep=2,cp=2", "ep=4,cp=2"] and not got.rejected
    for c, comm in _tables_equal_hlo(MOE, got, batch):
        methods = {r["call"]: r["method"] for r in comm["attention"]}  # eager attention: gathered; the router too
        assert methods == {"layers_0.self_attn": "gather sequence", "layers_1.self_attn": "gather sequence",
                           "layers_1.mlp": "gather sequence", "layers_1.mlp.experts": "experts cut"}, c.name
        a2a = c.communication["total"]["all-to-all"]
        assert a2a["count"] > 0 and c.comm_s["all-to-all"] == pytest.approx(_cal_price(a2a, c.layout.ep), rel=1e-9)


def test_an_einsum_attention_model_gets_cp_candidates():
    model, batch = Transformer(24, 16, num_layers=2, d_model=16, num_heads=2), _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    got = sorted(lay.name for lay in context_expert_layouts(8, None, ("block_*",), params, batch) if lay.pp == 1)
    assert got == sorted(["dp=4,cp=2", "dp=2,fsdp=2,cp=2 regather", "dp=2,fsdp=2,cp=2 keep", "fsdp=4,cp=2 regather",
                          "fsdp=4,cp=2 keep", "dp=2,cp=4", "fsdp=2,cp=4 regather", "fsdp=2,cp=4 keep", "dp=1,cp=8"])


@pytest.mark.slow  # two layouts traced and compiled
def test_an_einsum_attention_models_cp_candidates_run_it_on_the_gathered_sequence():
    model, batch = Transformer(24, 16, num_layers=2, d_model=16, num_heads=2), _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    picked = [lay for lay in context_expert_layouts(8, None, ("block_*",), params, batch)
              if lay.name in ("dp=4,cp=2", "fsdp=2,cp=4 keep")]
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[Layout(dp=8), *picked], calibration=CAL,
                      params=params)
    assert sorted(c.name for c in got) == ["dp=4,cp=2", "dp=8", "fsdp=2,cp=4 keep"] and not got.rejected
    for c, comm in _tables_equal_hlo(model, [c for c in got if c.layout.cp > 1], batch):
        assert [(r["call"], r["method"]) for r in comm["attention"]] == [
            ("block_0.attn", "gather sequence"), ("block_1.attn", "gather sequence")], c.name
        # the parameters' gathers over fsdp, the sequence's (the rest of the total) over cp; none over tp
        par, total = c.communication["parameters"]["all-gather"], c.communication["total"]["all-gather"]
        seq = {k: total[k] - par[k] for k in ("count", "bytes")}
        assert seq["count"] > 0 and c.communication["activations"]["all-gather"]["count"] == 0
        assert c.comm_s["all-gather"] == pytest.approx(
            _cal_price(par, c.layout.fsdp) + _cal_price(seq, c.layout.cp), rel=1e-9), c.name


LLAMA = Llama(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, attn_implementation="sdpa"))
MOE_EVERY = MoE(MoEConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, num_experts=8, top_k=2, capacity_factor=1.0, moe_every=1))


def test_pipelines_with_cp_and_with_ep_are_candidates():
    batch = _batch(16)
    p = jax.eval_shape(LLAMA.init, jax.random.key(0), batch["inputs"])["params"]
    got = sorted(lay.name for lay in context_expert_layouts(8, None, ("layers_*",), p, batch) if lay.pp > 1)
    assert got == sorted(["pp=2,dp=2,cp=2 1f1b M=2", "pp=2,dp=2,cp=2 1f1b M=4", "pp=2,fsdp=2,cp=2 1f1b M=2",
                          "pp=2,fsdp=2,cp=2 1f1b M=4", "pp=2,cp=4 1f1b M=2", "pp=2,cp=4 1f1b M=4"])
    p = jax.eval_shape(MOE_EVERY.init, jax.random.key(0), batch["inputs"])["params"]
    got = sorted(lay.name for lay in context_expert_layouts(8, None, ("layers_*",), p, batch)
                 if lay.pp > 1 and lay.ep > 1)
    # 8 rows: a replica of dp=2 x ep=2 has 2, which M=4 does not divide
    assert got == sorted(["pp=2,dp=2,ep=2 1f1b M=2", "pp=2,fsdp=2,ep=2 1f1b M=2", "pp=2,ep=4 1f1b M=2"])
    assert Layout(pp=2, cp=4, units=("layers_*",), microbatches=2).mesh_dims == (("pp", 2), ("dp", 1), ("cp", 4))


def _picked_table_is_hlo(model, name):
    batch = _batch(16)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    lay = next(lay for lay in context_expert_layouts(8, None, ("layers_*",), params, batch) if lay.name == name)
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[lay], calibration=CAL, params=params)
    best = got.best
    assert best.name == name and not got.rejected
    laid, _ = apply_layout(model, 8, best.layout)
    real = model.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(laid, optax.sgd(0.1), params=real)
    hlo = hlo_executed_collectives(make_train_step(laid, default_loss(laid), optax.sgd(0.1)).compiled(
        state, batch).as_text(), scalars=False)
    table = best.communication["total"]
    for kind in KINDS:  # buffers, an all-to-all's ops (as tests/parallel/pipelining/test_pipeline_experts.py)
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), (name, kind)
    row = next(line for line in got.table().splitlines() if line.startswith("1 "))
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):  # the printed MiB
        assert f"{hlo[kind]['bytes'] / 2**20:.2f}" in row.split(), (name, kind)
    return best, table


@pytest.mark.slow  # one pipelined layout traced and compiled
def test_a_picked_pipeline_with_cp_prints_its_compiled_collectives():
    best, table = _picked_table_is_hlo(LLAMA, "pp=2,fsdp=2,cp=2 1f1b M=2")
    # the stages' gathers over fsdp and the lookup's; the 4 sends of activations cut over cp and the stages' rings
    # (zigzag, 108 permutes: tests/parallel/pipelining/test_pipeline_cp.py counts them)
    assert table["all-gather"]["count"] > 2 and table["collective-permute"]["count"] == 4 + 108
    assert best.comm_s["all-gather"] > 0 and "all-to-all" not in table


@pytest.mark.slow  # one pipelined layout traced and compiled
def test_a_picked_pipeline_with_ep_prints_its_compiled_collectives():
    best, table = _picked_table_is_hlo(MOE_EVERY, "pp=2,ep=4 1f1b M=2")
    assert table["all-to-all"]["count"] == 20
    # priced as the busiest rank (the first stage) runs them: 12 of the 20 (M=2 x its forward's 2, the recomputed
    # forward's 2 and their 2 transposes: tests/parallel/pipelining/test_pipeline_experts.py), over ep=4
    each = table["all-to-all"]["bytes"] / 20
    assert best.comm_s["all-to-all"] == pytest.approx(_cal_price({"count": 12, "bytes": 12 * each}, 4), rel=1e-9)


@pytest.mark.slow  # one pipelined layout traced and compiled
def test_a_pipeline_with_cp_weighs_a_models_own_attention():
    """``models.Transformer`` (its own einsum attention) under ``pp=2,dp=2,cp=2``: weighed (it was refused), its
    stages' ``attn`` run on the sequence gathered over cp (the table's ``gather sequence`` rows), the candidate's
    table equal to its compiled step's collectives (each kind's buffers and bytes), and its attention's work whole
    on every cp rank: as much compute per device as ``pp=2,dp=4`` at its ``T / cp`` positions plus the whole
    ``[T, T]`` part, more than ``pp=2,dp=4``'s."""
    model, batch = Transformer(24, 16, num_layers=2, d_model=16, num_heads=2), _batch(16)
    lay = Layout(pp=2, dp=2, cp=2, units=("block_*",), microbatches=2)
    plain = Layout(pp=2, dp=4, units=("block_*",), microbatches=2)
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[plain, lay], calibration=CAL)
    assert sorted(c.name for c in got) == sorted([plain.name, lay.name]) and not got.rejected
    cand = next(c for c in got if c.name == lay.name)
    laid, _ = apply_layout(model, 8, lay)
    state = init_train_state(laid, optax.sgd(0.1), params=model.init(jax.random.key(0), batch["inputs"])["params"])
    step = make_train_step(laid, default_loss(laid), optax.sgd(0.1))
    assert {r["method"] for r in step.attention(state, batch)} == {"gather sequence"}
    hlo = hlo_executed_collectives(step.compiled(state, batch).as_text(), scalars=False)
    table = cand.communication["total"]
    for kind in KINDS:
        want = table.get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["count" if kind == "all-to-all" else "buffers"], hlo[kind]["bytes"]) == (
            want["count"], want["bytes"]), kind
    dp4 = next(c for c in got if c.name == plain.name)
    assert cand.flops > dp4.flops  # the [T, T] part whole on each cp rank, the rest on its half of the positions


def test_a_gathered_attentions_cp_layouts_are_weighed_over_dp_only():
    from spmd.parallel.auto._cpep import gather_only

    seen = {"gather": True}  # a traced cp layout ran the model's attention on the gathered sequence
    assert gather_only(seen, Layout(fsdp=2, cp=4, units=("block_*",)))
    assert gather_only(seen, Layout(dp=2, tp=2, cp=2, tp_plan=(("block_*.fc", None),)))
    assert not gather_only(seen, Layout(dp=2, cp=4)) and not gather_only(seen, Layout(dp=2, ep=2, cp=2, ep_plan=(
        ("layers_*.mlp.experts", None),)))
    assert not gather_only({"gather": False}, Layout(fsdp=2, cp=4, units=("block_*",)))  # a ring: every cp layout
    assert not gather_only({}, Layout(fsdp=2, cp=4, units=("block_*",)))  # none traced yet
    # pipelined: fsdp weighed (the stages' table holds the gathered attention's collectives), tp in the stages not
    assert not gather_only(seen, Layout(pp=2, fsdp=2, cp=2, units=("block_*",), microbatches=2,
                                        reshard_after_forward=False))
    assert gather_only(seen, Layout(pp=2, cp=2, tp=2, tp_plan=(("block_*.fc", None),), units=("block_*",),
                                    microbatches=2))


class _Sdpa(nn.Module):
    """One attention layer through ``jax.nn.dot_product_attention`` (the cp step's ring), narrow enough that its
    ``[T, T]`` work dominates the step's."""
    causal: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Embed(24, 8)(x)
        q, k, v = (nn.DenseGeneral((2, 4), name=n)(x) for n in ("q", "k", "v"))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal)
        return nn.Dense(24)(nn.DenseGeneral(8, axis=(-2, -1))(y))


def _one_device_flops(model, params, rows: int, t: int) -> float:
    """XLA's flops of the loss and its gradient on one device, ``rows`` sequences of ``t`` tokens."""
    b = _batch(t, rows)
    loss = default_loss(model)
    with jax.default_device(jax.devices()[0]):
        comp = jax.jit(jax.value_and_grad(loss)).lower(params, b).compile()
    cost = comp.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.slow  # four layouts traced, a dozen one-device programs compiled
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_cp_candidates_compute_counts_its_queries_against_every_key(causal):
    """A cp rank computes its ``T / cp`` queries against all ``T`` keys: attention's ``[T, T]`` work at ``T^2 / cp``
    (the causal ring's zigzag blocks: those not wholly in the future on the busiest rank), the rest of the step at
    ``T / cp`` positions. Reference: the one-device program's flops (XLA's count, at 3 lengths: its quadratic part
    fitted) and a NumPy count of the zigzag blocks; the old estimate (the step at ``T / cp``: attention at
    ``(T / cp)^2``) is below by about half at cp=2 and more at cp=4."""
    from spmd.parallel.auto._auto import evaluate_layout

    t, b = 64, 8
    model = _Sdpa(causal)
    batch = _batch(t, b)
    params = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"])["params"]
    for cp in (2, 4):
        dp = 8 // cp
        rows = b // dp
        # the one-device step's flops at the device's rows: c + a s + q s^2 over s positions, fitted at 3 lengths
        ts = np.array([t // 4, t // 2, t], float)
        f = np.array([_one_device_flops(model, params, rows, int(s)) for s in ts])
        c0, a, q = np.linalg.solve(np.stack([np.ones(3), ts, ts ** 2], 1), f)
        quad = q * t * t
        if causal:  # zigzag: rank r holds chunks r and 2 cp - 1 - r of the 2 cp; a (query chunk, key chunk) pair
            # is computed unless wholly in the future; the busiest rank's share of its T / cp x T
            blocks = [sum(kc <= qc for qc in (r, 2 * cp - 1 - r) for kc in range(2 * cp)) for r in range(cp)]
            share = max(blocks) / (2 * 2 * cp)
        else:
            share = 1.0
        want = (f[2] - quad) / cp + share * quad / cp
        got = evaluate_layout(model, optax.sgd(0.1), batch, 8, Layout(dp=dp, cp=cp), calibration=CAL)
        assert got.communication["total"]["collective-permute"]["count"] > 0  # the ring ran
        np.testing.assert_allclose(got.flops, want, rtol=0.02, err_msg=f"cp={cp}")


def test_an_moe_with_experts_in_every_other_block_gets_no_pipeline():
    """``models.MoE`` with ``moe_every=2``: its blocks hold other parameters by turns (experts or an MLP), which
    ``pipeline`` refuses (its stages run one unit's code on stacked parameters); auto_layout proposes no pipeline
    of them (pp x ep, pp x cp, plain pp), where with experts in every block (``moe_every=1``) it does."""
    import re

    from spmd.parallel.auto._auto import evaluate_layout
    from spmd.parallel import ExpertParallel
    from spmd.parallel.auto._pipeline import pipeline_layouts

    batch = _batch(16)
    p = jax.eval_shape(MOE.init, jax.random.key(0), batch["inputs"])["params"]
    lays = context_expert_layouts(8, None, ("layers_*",), p, batch)
    assert lays and not [lay.name for lay in lays if lay.pp > 1]
    assert {lay.ep for lay in lays} == {1, 2, 4, 8} and {lay.cp for lay in lays} == {1, 2, 4, 8}
    assert pipeline_layouts(8, None, ("layers_*",), p, 8) == []
    every = jax.eval_shape(MOE_EVERY.init, jax.random.key(0), batch["inputs"])["params"]
    assert pipeline_layouts(8, None, ("layers_*",), every, 8)
    # the layout left out is one the step refuses
    lay = Layout(pp=2, ep=4, units=("layers_*",), microbatches=2,
                 ep_plan=(("layers_*.mlp.experts", ExpertParallel()),))
    with pytest.raises(ValueError, match=re.escape("unit 'layers_1' has other parameters than 'layers_0'")):
        evaluate_layout(MOE, optax.sgd(0.1), batch, 8, lay, calibration=CAL, params=p)


def _moe_tp_plan():
    from spmd.parallel import ColwiseParallel, RowwiseParallel

    return {"layers_*.self_attn.q_proj": ColwiseParallel(), "layers_*.self_attn.k_proj": ColwiseParallel(),
            "layers_*.self_attn.v_proj": ColwiseParallel(), "layers_*.self_attn.o_proj": RowwiseParallel(),
            "layers_0.mlp.gate_proj": ColwiseParallel(), "layers_0.mlp.up_proj": ColwiseParallel(),
            "layers_0.mlp.down_proj": RowwiseParallel()}


def _moe_candidate(pick):
    batch = _batch(16)
    params = jax.eval_shape(MOE.init, jax.random.key(0), batch["inputs"])["params"]
    lays = [lay for lay in context_expert_layouts(8, _moe_tp_plan(), infer_units(params), params, batch) if pick(lay)]
    got = auto_layout(MOE, optax.sgd(0.1), batch, 8, layouts=lays[:1], calibration=CAL, params=params)
    assert len(got.candidates) == 1 and not got.rejected
    return got, batch


@pytest.mark.slow  # one layout traced and compiled
def test_moe_cp_only_candidates_table_equals_its_compiled_collectives():
    """``models.MoE`` cut over cp alone (``dp=4,cp=2``): its eager attention and its MoE block (router and experts,
    no ep) run on the sequence gathered over cp; the table equals the compiled step's collectives."""
    got, batch = _moe_candidate(lambda lay: lay.cp == 2 and lay.ep == 1 and lay.dp == 4)
    assert got.best.name == "dp=4,cp=2"
    for c, comm in _tables_equal_hlo(MOE, got, batch):
        methods = {r["call"]: r["method"] for r in comm["attention"]}
        assert methods == {"layers_0.self_attn": "gather sequence", "layers_1.self_attn": "gather sequence",
                           "layers_1.mlp": "gather sequence"}
        assert "all-to-all" not in c.communication["total"] or not c.communication["total"]["all-to-all"]["count"]


@pytest.mark.slow  # one layout traced and compiled
def test_moe_ep_times_tp_candidates_table_equals_its_compiled_collectives():
    """``models.MoE`` with its experts over ep and Megatron's plan on its attention and dense MLP over tp
    (``dp=2,tp=2,ep=2``): the table (the experts' all-to-alls, tp's all-reduces, the gradients') equals the
    compiled step's collectives."""
    got, batch = _moe_candidate(lambda lay: lay.ep == 2 and lay.tp == 2 and lay.cp == 1 and lay.dp == 2)
    for c, comm in _tables_equal_hlo(MOE, got, batch):
        assert c.layout.tp == 2 and c.communication["total"]["all-to-all"]["count"] > 0
        assert comm["activations"]["all-reduce"]["count"] > 0  # Megatron's f and g


@pytest.mark.slow  # four layouts traced (two pipelines)
def test_a_cp_candidates_work_per_device_equals_the_data_parallel_ones():
    """Cutting the sequence over cp moves no work: a device of ``dp=4,cp=2`` computes 2 rows of ``T / 2`` queries
    against all ``T`` keys (the ring without a mask: every block), as much as a device of ``dp=8`` on its 1 row;
    and under a pipeline the stages run the same ring (91fbafd): ``pp=2,dp=2,cp=2`` against ``pp=2,dp=4`` saves
    what ``dp=4,cp=2`` saves against ``dp=8`` for the causal Llama (the zigzag ring skips the blocks wholly in the
    future: both 0.807 here). Before, attention was counted at ``(T / cp)^2`` and the cp candidates' flops were
    below the data-parallel ones'."""
    from spmd.parallel.auto._auto import evaluate_layout

    batch = _batch(64)
    params = jax.eval_shape(LLAMA.init, jax.random.key(0), batch["inputs"])["params"]

    def flops(lay):
        return evaluate_layout(LLAMA, optax.sgd(0.1), batch, 8, lay, calibration=CAL, params=params).flops

    # unpipelined: a mask-free attention (the causal ring skips blocks wholly in the future)
    masked = _Sdpa(False)
    mp = jax.eval_shape(masked.init, jax.random.key(0), batch["inputs"])["params"]
    got = [evaluate_layout(masked, optax.sgd(0.1), batch, 8, lay, calibration=CAL, params=mp).flops
           for lay in (Layout(dp=4, cp=2), Layout(dp=8))]
    np.testing.assert_allclose(got[0], got[1], rtol=0.01)
    units = ("layers_*",)
    cut, whole = (flops(Layout(pp=2, dp=2, cp=2, units=units, microbatches=2)),
                  flops(Layout(pp=2, dp=4, units=units, microbatches=2)))
    plain = flops(Layout(dp=4, cp=2)) / flops(Layout(dp=8))
    assert plain < 0.9  # the causal ring computes less than every pair
    np.testing.assert_allclose(cut / whole, plain, rtol=0.01)
