"""Expert parallelism (``spmd.parallel.expert_dispatch`` / ``expert_combine``) and the MoE model.

The ep-cut layer (experts cut over ``ep``, tokens cut over ``dp`` x ``ep`` as data) against the model's
dense single-device ``MoEMLP`` (forward and gradients), the model's layer and its drop counts against a
NumPy loop, the compiled HLO's all-to-alls (two per layer in the forward) and their bytes against the
capacity-padded bound, and the refusals.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from models import MoE, MoEConfig, MoEMLP
from spmd import Replicate, Shard
from spmd.parallel import ExpertDispatch, expert_capacity, expert_combine, expert_dispatch

B, T, D, F, E, K = 8, 16, 8, 16, 8, 2


def _cfg(cf):
    return MoEConfig(hidden_size=D, intermediate_size=F, num_experts=E, top_k=K, capacity_factor=cf)


def _layer_inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    p = {"router": {"kernel": rng.standard_normal((D, E)).astype(np.float32)},
         "experts": {"gate_proj": (rng.standard_normal((E, D, F)) / np.sqrt(D)).astype(np.float32),
                     "up_proj": (rng.standard_normal((E, D, F)) / np.sqrt(D)).astype(np.float32),
                     "down_proj": (rng.standard_normal((E, F, D)) / np.sqrt(F)).astype(np.float32)}}
    return x, p


def _numpy_layer(x, p, cf):
    """The MoE layer as a loop: (output, dropped assignments, load-balancing loss); choices in order, tokens
    in sequence order."""
    logits = x.astype(np.float64) @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    cap = min(T, max(1, math.ceil(cf * T * K / E)))
    out, dropped, share = np.zeros(x.shape), 0, np.zeros((K, E))
    g, u, w = (p["experts"][n].astype(np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
    for b in range(x.shape[0]):
        top = np.argsort(-probs[b], axis=-1, kind="stable")[:, :K]
        wts = np.take_along_axis(probs[b], top, -1)
        wts /= wts.sum(-1, keepdims=True)
        used = np.zeros(E, int)
        for j in range(K):
            share[j] += np.bincount(top[:, j], minlength=E) / (x.shape[0] * T)
        for j in range(K):
            for t in range(T):
                e = top[t, j]
                if used[e] >= cap:
                    dropped += 1
                    continue
                used[e] += 1
                h = x[b, t] @ g[e]
                h = h / (1 + np.exp(-h)) * (x[b, t] @ u[e])
                out[b, t] += wts[t, j] * (h @ w[e])
    balance = E * np.sum(share * probs.reshape(-1, E).mean(0))
    return out, dropped, balance


def _dense(x, p, cf, balance=False):
    out, state = MoEMLP(_cfg(cf)).apply({"params": p}, x, mutable=["intermediates"])
    got = (out, state["intermediates"]["dropped"][0])
    return got + (state["intermediates"]["load_balancing"][0],) if balance else got


@functools.lru_cache(maxsize=None)
def _ep_layer(ep, cf, layers=1):
    """``layers`` ep-cut MoE layers (same weights) on a (8 / ep, ep) dp x ep mesh; (out, dropped)."""
    mesh = spmd.init_device_mesh("cpu", (8 // ep, ep), mesh_dim_names=("dp", "ep"))
    tokens, rep, experts = [Shard(0), Shard(0)], [Replicate(), Replicate()], [Replicate(), Shard(0)]

    @spmd.spmd(mesh, in_placements=(tokens, rep, {"gate_proj": experts, "up_proj": experts, "down_proj": experts}),
               out_placements=(tokens, rep))
    def layer(x, router, w):
        dropped = 0
        for _ in range(layers):
            probs = jax.nn.softmax(x @ router, axis=-1)
            weights, idx = jax.lax.top_k(probs, K)
            weights = weights / weights.sum(-1, keepdims=True)
            buf, dispatch = expert_dispatch(x, idx, num_experts=E, capacity_factor=cf, group="ep")
            h = jax.nn.silu(jnp.einsum("esd,edf->esf", buf, w["gate_proj"]))
            h = h * jnp.einsum("esd,edf->esf", buf, w["up_proj"])
            x = expert_combine(jnp.einsum("esf,efd->esd", h, w["down_proj"]), dispatch, weights, group="ep")
            dropped = dropped + dispatch.dropped
        return x, spmd.all_reduce(dropped, group=("dp", "ep"))

    return layer


def _ep(x, p, ep, cf):
    return _ep_layer(ep, cf)(x, p["router"]["kernel"], p["experts"])


def test_model_layer_equals_numpy_loop():
    x, p = _layer_inputs()
    for cf in (0.5, 1.0, 4.0):
        ref, ref_dropped, ref_balance = _numpy_layer(x, p, cf)
        out, dropped, balance = _dense(x, p, cf, balance=True)
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
        assert int(dropped) == ref_dropped, cf
        np.testing.assert_allclose(float(balance), ref_balance, rtol=1e-5)
        assert ref_balance > K  # random routing is uneven: above the even value, top_k
    assert _numpy_layer(x, p, 0.5)[1] > 0 and _numpy_layer(x, p, 4.0)[1] == 0  # drops where the cap bites


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_layer_equals_dense(ep):
    x, p = _layer_inputs(ep)
    cf = 1.0  # capacity 4 of 16 tokens x 2 choices over 8 experts: some assignments dropped
    ref, ref_dropped = _dense(x, p, cf)
    out, dropped = _ep(x, p, ep, cf)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert int(dropped) == int(ref_dropped) == _numpy_layer(x, p, cf)[1] > 0

    ct = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    dense_grad = jax.grad(lambda x, p: jnp.sum(_dense(x, p, cf)[0] * ct), argnums=(0, 1))(x, p)
    ep_grad = jax.grad(lambda x, p: jnp.sum(_ep(x, p, ep, cf)[0] * ct), argnums=(0, 1))(x, p)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(dense_grad), jax.tree.leaves(ep_grad)):
        assert np.abs(np.asarray(a)).max() > 0, path  # every weight takes part
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_drop_counts_at_small_capacity(ep):
    x, p = _layer_inputs(10 + ep)
    for cf in (0.25, 0.5):
        want = _numpy_layer(x, p, cf)[1]
        assert want > 0
        assert int(_ep(x, p, ep, cf)[1]) == want
        assert int(_dense(x, p, cf)[1]) == want


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_hlo_two_all_to_alls_per_layer_and_bytes(ep):
    x, p = _layer_inputs()
    cf = 1.25
    for layers in (1, 2):
        fn = _ep_layer(ep, cf, layers)
        text = fn.lower(x, p["router"]["kernel"], p["experts"]).compile().as_text()
        got = spmd._inspect.hlo_collectives(text)["all-to-all"]
        assert got["count"] == 2 * layers
        # the bound: each rank's tokens x top_k, padded to capacity per (sequence, expert), x d x 4 bytes
        cap = math.ceil(cf * T * K / E)  # 5 places per expert of a 16-token sequence
        slots = (B // 8) * E * cap  # 1 sequence per rank (8 ranks over dp x ep)
        per_direction = slots * D * 4
        assert got["bytes"] == 2 * layers * per_direction
        off_rank = got["bytes"] / (2 * layers) * (ep - 1) / ep
        assert off_rank == (B // 8) * T * K * cf * D * 4 * (ep - 1) / ep  # cf * t * k / E is whole here
    # the backward pass: each all-to-all's transpose is the inverse all-to-all, of the same bytes
    fn = _ep_layer(ep, cf)
    grad = jax.jit(jax.grad(lambda x, r, w: jnp.sum(fn(x, r, w)[0] ** 2), argnums=(0, 1, 2)))
    got = spmd._inspect.hlo_collectives(grad.lower(x, p["router"]["kernel"], p["experts"]).compile().as_text())
    assert got["all-to-all"]["count"] == 4
    assert got["all-to-all"]["bytes"] == 4 * per_direction


@pytest.mark.slow  # a 4-block decoder compiled: ~12 s on CPU
def test_moe_model_sows_drops_per_moe_block():
    cfg = MoEConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=4, capacity_factor=0.5)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    variables = jax.jit(MoE(cfg).init)(jax.random.key(0), tokens)
    params = variables["params"]
    assert params["layers_1"]["mlp"]["experts"]["gate_proj"].shape == (8, 16, 16)
    assert params["layers_1"]["mlp"]["experts"]["down_proj"].shape == (8, 16, 16)
    assert "router" not in params["layers_0"]["mlp"] and "router" not in params["layers_2"]["mlp"]
    logits, state = jax.jit(functools.partial(MoE(cfg).apply, mutable=["intermediates"]))(variables, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    drops = {k: int(v["mlp"]["dropped"][0]) for k, v in state["intermediates"].items()}
    assert sorted(drops) == ["layers_1", "layers_3"]
    # capacity 2 of 16 tokens x 2 choices over 8 experts: at most 8 x 2 of each sequence's 32 are kept
    assert all(v >= 2 * (32 - 16) for v in drops.values()), drops


def test_dropless_refused_on_cpu():
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    x = np.zeros((2, 4, D), np.float32)
    idx = np.zeros((2, 4, K), np.int32)

    @spmd.spmd(mesh, in_placements=(Shard(0), Shard(0)), out_placements=Shard(0))
    def f(x, idx):
        return expert_dispatch(x, idx, num_experts=E, group="ep", dropless=True)[0]

    with pytest.raises(NotImplementedError, match=re.escape(
            "expert_dispatch: dropless=True needs lax.ragged_all_to_all, and ragged_all_to_all does not run "
            "on CPU; use a capacity factor")):
        f(x, idx)


def test_errors():
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    x = np.zeros((4, 4, D), np.float32)

    def run(idx, num_experts):
        @spmd.spmd(mesh, in_placements=(Shard(0), Shard(0)), out_placements=Shard(0))
        def f(x, idx):
            return expert_dispatch(x, idx, num_experts=num_experts, group="ep")[0]
        return f(x, idx)

    with pytest.raises(ValueError, match=re.escape("expert_dispatch: num_experts=6 does not divide over "
                                                   "group='ep' of 4 ranks")):
        run(np.zeros((4, 4, K), np.int32), 6)
    with pytest.raises(TypeError, match=re.escape("expert_dispatch: experts has dtype float32; it must hold "
                                                  "integer expert indices")):
        run(np.zeros((4, 4, K), np.float32), 8)
    with pytest.raises(ValueError, match=re.escape("expert_dispatch: experts has shape (1, 3, 2); it must be "
                                                   "[groups, tokens, top_k]")):
        run(np.zeros((4, 3, K), np.int32), 8)
    with pytest.raises(ValueError, match=re.escape("expert_capacity: capacity_factor=0 must be a number > 0")):
        expert_capacity(16, 8, 2, 0)
    with pytest.raises(ValueError, match=re.escape("expert_capacity: top_k=3 is more than num_experts=2")):
        expert_capacity(16, 2, 3, 1.0)
    with pytest.raises(TypeError, match=re.escape("expert_combine: dispatch=tuple must be the ExpertDispatch")):
        expert_combine(np.zeros((2, 8, D), np.float32), (1, 2), np.zeros((1, 4, K), np.float32))
    assert expert_capacity(16, 8, 2, 1.25) == 5 and expert_capacity(16, 8, 2, 4.0) == 16
    assert ExpertDispatch._fields == ("experts", "slots", "kept", "dropped")
