"""ep as a mesh dim of the train step: ``ExpertParallel`` through ``parallelize_module`` on ``mesh["ep"]``.

``models.MoE`` (top-2 of 8 experts in every other block, capacity routing) with its experts cut over ep, tokens
exchanged with all-to-alls, equals 3 SGD steps of one device within 1e-5 under dp=2 x ep=4 and fsdp=2 x ep=2 x
tp=2, the compiled step's collectives equal to the step's table; the dropped assignments the step reports
equal a NumPy count of the capacity routing of the router's logits, with and without fully_shard units (what a
unit sows reaches the loss); the blocks as one nn.scan stack under dp=2 x ep=4 equal one device's too; dropless and
an expert count ep does not divide are refused by name (ep under a pipeline:
tests/parallel/pipelining/test_pipeline_experts.py).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from models import MoE, MoEConfig
from spmd.parallel import (ColwiseParallel, ExpertParallel, RowwiseParallel, executed_collectives, fully_shard,
                           hlo_executed_collectives, init_train_state, make_train_step, parallelize_module,
                           unshard_params)
from tests._one_device import assert_trees_close, train_one_device

T, V = 16, 24
CFG = MoEConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                num_experts=8, top_k=2, capacity_factor=1.0)
TP_PLAN = {"layers_*.self_attn.q_proj": ColwiseParallel(), "layers_*.self_attn.k_proj": ColwiseParallel(),
           "layers_*.self_attn.v_proj": ColwiseParallel(), "layers_*.self_attn.o_proj": RowwiseParallel(),
           "layers_0.mlp.gate_proj": ColwiseParallel(), "layers_0.mlp.up_proj": ColwiseParallel(),
           "layers_0.mlp.down_proj": RowwiseParallel()}


def _batches(n=3, b=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, V, (b, T)).astype(np.int32),
             "labels": rng.integers(0, V, (b, T)).astype(np.int32)} for _ in range(n)]


def _loss(model):
    def loss_fn(p, b):
        logits, st = model.apply({"params": p}, b["tokens"], mutable=["intermediates"])
        drops = [x for k, x in jax.tree_util.tree_leaves_with_path(st) if "dropped" in jax.tree_util.keystr(k)]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()
        return loss, {"dropped": jnp.asarray(sum(jnp.sum(x) for x in drops), jnp.float32)}  # scanned: [L] each

    return loss_fn


def _numpy_drops(model, params, tokens):
    """The assignments over capacity, counted by a NumPy loop over each sequence from the router's logits."""
    _, st = model.apply({"params": params}, tokens, capture_intermediates=lambda m, _: m.name == "router",
                        mutable=["intermediates"])
    cfg, n = model.cfg, tokens.shape[1]
    e, k = cfg.num_experts, cfg.top_k
    cap = min(n, max(1, int(np.ceil(cfg.capacity_factor * n * k / e))))
    total = 0
    routers = [x for k, x in jax.tree_util.tree_leaves_with_path(st) if "router" in jax.tree_util.keystr(k)]
    assert len(routers) == cfg.num_layers // cfg.moe_every
    for logits in routers:
        for seq in np.asarray(logits, np.float64):
            probs = np.exp(seq - seq.max(-1, keepdims=True))
            choice = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            load = np.zeros(e, int)
            for j in range(k):  # first choices first, each in sequence order
                for t in range(n):
                    load[choice[t, j]] += 1
                    total += load[choice[t, j]] > cap
    return total


def _run(pm, mesh_sizes, batches):
    model = MoE(CFG)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, _loss(model), opt)
    table = step.table(state, batches[0])
    comm = step.communication(state, batches[0])
    hlo = executed_collectives(step._build(state.plan).jitted, state, batches[0], scalars=False)
    losses, drops = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        drops.append(float(m["dropped"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (comm["total"]["all-to-all"]["count"],
                                                                         comm["total"]["all-to-all"]["bytes"])
    return table, comm, drops, params


@pytest.mark.slow
def test_moe_under_dp2_ep4_equals_one_device():
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    pm = parallelize_module(MoE(CFG), mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})
    batches = _batches()
    table, comm, drops, params = _run(pm, {"dp": 2, "ep": 4}, batches)
    assert "layers_1.mlp.experts: ExpertParallel all-to-all in (2,048 B) and out (2,048 B)" in table
    # per device: 1 row of 16 tokens -> buffers [1, 8 experts, capacity 4, d 16] float32 = 2,048 B; dispatch and
    # combine forward, their transposes backward
    assert comm["experts"]["all-to-all"] == {"count": 4, "bytes": 4 * 2048}
    # the drops the step reports (averaged over the 8 devices) at step 0 (the initial parameters)
    assert drops[0] * 8 == _numpy_drops(MoE(CFG), params, batches[0]["tokens"])


@pytest.mark.slow
def test_moe_under_fsdp2_ep2_tp2_equals_one_device():
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "ep", "tp"))
    pm = parallelize_module(MoE(CFG), mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})
    pm = parallelize_module(pm, mesh["tp"], TP_PLAN)
    pm = fully_shard(pm, mesh=mesh["fsdp"], units=["layers_*"])
    batches = _batches()
    table, comm, drops, params = _run(pm, {"fsdp": 2, "ep": 2, "tp": 2}, batches)
    assert comm["experts"]["all-to-all"]["count"] == 4
    # the drops sown inside the fully_shard unit layers_1 reach the loss's aux: averaged over the 4 data ranks
    assert drops[0] * 4 == _numpy_drops(MoE(CFG), params, batches[0]["tokens"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 16])  # 16: the sequence as long as d_model (no dim of d mistaken for positions)
def test_moe_under_dp2_cp2_ep2_equals_one_device(n):
    """cp and ep together: models.MoE with its attention through jax.nn.dot_product_attention (the ring over cp)
    and its experts cut over ep. The MoE block's routing (a capacity per sequence: a running count over the whole
    sequence) runs on the sequence gathered over cp (one all-gather of its input forward, of its output's cotangent
    backward), but its router's projection on the device's own positions (1/cp of the matmul flops, read from the
    compiled step; its logits gathered, its kernel's gradient summed over cp), and each device of cp dispatches its half of the buffers' groups to the experts (the experts do not
    run whole on every device of cp; their output gathered back over cp, their input's cotangent backward; their
    gradients summed over cp). Equal to 3 SGD steps of one device within 1e-5, the drops equal the NumPy count,
    every kind of collective equal to the table."""
    cfg = dataclasses.replace(CFG, attn_implementation="sdpa")
    model = MoE(cfg)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, n)).astype(np.int32),
                "labels": rng.integers(0, V, (8, n)).astype(np.int32)} for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "ep"))
    pm = parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})
    state = init_train_state(pm, opt, params=params)
    step = make_train_step(pm, _loss(model), opt)
    table = step.table(state, batches[0])
    comm = step.communication(state, batches[0])
    text = step._build(state.plan).jitted.lower(state, batches[0]).compile().as_text()
    hlo = hlo_executed_collectives(text, scalars=False)
    losses, drops = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        drops.append(float(m["dropped"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    assert drops[0] * 4 == _numpy_drops(model, params, batches[0]["tokens"]) > 0  # averaged over dp x ep
    # the router's projection runs on the device's own positions: its three matmuls (forward, the input's and the
    # kernel's gradients) on 2 rows x n/2 positions x d 16 x E 8, 1/cp of the whole sequence's
    assert _router_flops(text) == 3 * 2 * (2 * n // 2 * 16 * 8)
    assert "'layers_1.mlp.router' on the device's positions, its output gathered, its gradients summed over cp" in table
    assert table.count("jax.nn.dot_product_attention: ring (zigzag) over cp=2") == cfg.num_layers
    cap = n * 2 // 8  # capacity factor 1: top-2 of 8 experts over the n tokens of a sequence
    assert f"MoE routing 'layers_1.mlp': gather sequence over cp=2 (in [2, {n}, 16] float32" in table
    assert f"layers_1.mlp.experts: experts cut over cp=2 (buffers [2, 8, {cap}, 16] float32" in table
    # per device: 2 rows -> buffers [2, 8 experts, cap, 16] float32, of which each device of cp sends its row, each
    # way, forward and backward
    buf = 2 * 8 * cap * 16 * 4
    assert comm["experts"]["all-to-all"] == {"count": 4, "bytes": 4 * buf // 2}
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (comm["total"]["all-to-all"]["count"],
                                                                         comm["total"]["all-to-all"]["bytes"])
    for kind in ("collective-permute", "all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind
    # the gathers: the MoE block's input [2, n, 16] and its output's cotangent, the experts' output [2, 8, cap, 16]
    # and their input's cotangent; the rest are the embedding lookup's
    ctx = comm["context"]["all-gather"]
    assert ctx["count"] >= 4 and ctx["bytes"] >= 2 * (2 * n * 16 * 4) + 2 * buf


def _router_flops(hlo: str) -> int:
    """The flops of the compiled step's matmuls traced in a module named ``router`` (per device: 2 x the output's
    size x the contracted size, read from the lhs operand's shape)."""
    shapes = dict(re.findall(r"(%[\w.\-]+) = \w+\[([\d,]*)\]", hlo))
    total = 0
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* dot\((%[\w.\-]+),.*lhs_contracting_dims=\{([\d,]*)\}", line)
        if m and "/router/" in line:
            lhs = [int(x) for x in shapes[m.group(2)].split(",") if x]
            total += 2 * int(np.prod([int(x) for x in m.group(1).split(",") if x])) * int(
                np.prod([lhs[int(i)] for i in m.group(3).split(",") if i]))
    return total


@pytest.mark.slow
def test_scanned_moe_under_dp2_ep4_equals_one_device():
    """models.MoE with its blocks as one nn.scan stack (scan_layers=True, experts in each of 4 layers): the stacked
    experts [L, E, d, f] cut over ep on their experts dim (1, past the layer axis), the scan's body exchanging its
    layer's tokens; 3 SGD steps equal one device's within 1e-5, the table's all-to-alls (once per layer, not once
    per trace of the body) equal to the compiled step's."""
    cfg = dataclasses.replace(CFG, num_layers=4, moe_every=1, scan_layers=True)
    model = MoE(cfg)
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    pm = parallelize_module(model, mesh["ep"], {"layers.mlp.experts": ExpertParallel()})
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    e = state.plan.entry("layers/mlp/experts/gate_proj")
    assert ([str(p) for p in e.placements], e.local_shape) == (["R", "S(1)"], (4, 2, 16, 32))
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = executed_collectives(step._build(state.plan).jitted, state, batches[0], scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)
    # per device: 1 row -> buffers [1, 8 experts, capacity 4, 16] float32 = 2,048 B; per layer dispatch and combine
    # forward and their transposes backward: 4 x 4 layers
    assert comm["experts"]["all-to-all"] == {"count": 16, "bytes": 16 * 2048}
    assert (hlo["all-to-all"]["count"], hlo["all-to-all"]["bytes"]) == (16, 16 * 2048)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"][kind]["count"],
                                                              comm["total"][kind]["bytes"]), kind


def test_scanned_moe_needs_experts_in_every_block():
    with pytest.raises(ValueError, match=re.escape("MoE: scan_layers=True stacks blocks of one shape, but "
                                                   "moe_every=2 puts experts in one block of every few")):
        MoE(dataclasses.replace(CFG, scan_layers=True)).init(jax.random.key(0), jnp.zeros((2, T), jnp.int32))


def test_dropless_is_refused_on_cpu():
    with pytest.raises(NotImplementedError, match=re.escape("ragged_all_to_all does not run on CPU")):
        ExpertParallel(dropless=True)


def test_experts_ep_does_not_divide_are_refused():
    cfg = MoEConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    num_experts=6)
    model = MoE(cfg)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    pm = parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, T), jnp.int32))["params"]
    with pytest.raises(ValueError, match=re.escape("over ep=4, which does not divide it")):
        pm.plan(params)


@pytest.mark.slow
def test_ep_style_on_a_dim_of_the_experts_size_that_is_not_theirs_is_refused():
    """ExpertParallel(token_dim=1, experts_dim=0) on models.MoE's [b, E, capacity, d] buffers, 8 local rows as
    many as the experts: the size check passes, and the module's own code, probed abstractly on the exchanged
    layout, does not run: refused by name before anything is sent the wrong way."""
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    pm = parallelize_module(MoE(CFG), mesh["ep"], {"layers_*.mlp.experts": ExpertParallel(token_dim=1, experts_dim=0)})
    b = _batches(1, b=16)[0]
    params = MoE(CFG).init(jax.random.key(0), b["tokens"][:2])["params"]
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt, params=params)
    with pytest.raises(ValueError, match=re.escape(
            "parallelize_module: ExpertParallel(token_dim=1, experts_dim=0, dropless=False) on 'layers_1.mlp.experts': "
            "the module does not run on its local experts' tokens, shape (4, 16, 4, 16) on this device (dim 0, "
            "experts_dim=0, exchanged over ep)")):
        make_train_step(pm, _loss(MoE(CFG)), opt)(state, b)
