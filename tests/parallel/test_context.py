"""Context parallelism's attention (``spmd.parallel.context``): ``ring_attention`` and ``allgather_attention``
inside ``jax.shard_map`` over a ``cp`` mesh dim equal ``jax.nn.dot_product_attention`` on the whole sequence
(values and gradients wrt q, k, v, within 1e-5 in float32) with no mask, causal masks on the plain and the
zigzag cut, segment ids (packed sequences with padding) and GQA; the compiled programs execute exactly the
ring's ``cp - 1`` permutes of K and of V (the K and V all-gathers for the other); the zigzag cut balances the
causal work (counted against a brute-force count of the mask).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd.parallel import (allgather_attention, causal_work, executed_collectives, ring_attention,
                           unzigzag_permutation, zigzag_permutation)

B, H, D = 2, 4, 8
FNS = {"ring": ring_attention, "allgather": allgather_attention}
# (causal, layout, segment ids)
MASKS = {
    "none": (False, "contiguous", False),
    "causal": (True, "contiguous", False),
    "causal-zigzag": (True, "zigzag", False),
    "segments": (False, "contiguous", True),
    "causal-zigzag-segments": (True, "zigzag", True),
}


def _mesh(cp):
    return spmd.init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)).jax_mesh


def _inputs(seq, kv_heads, seed=0):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, seq, H, D), jnp.float32)
    k = jax.random.normal(kk, (B, seq, kv_heads, D), jnp.float32)
    v = jax.random.normal(kv, (B, seq, kv_heads, D), jnp.float32)
    # packed sequences: row 0 holds three documents then padding (id 0), row 1 two documents
    cut = seq // 4
    seg = np.zeros((B, seq), np.int32)
    seg[0, :cut + 3], seg[0, cut + 3:2 * cut + 5], seg[0, 2 * cut + 5:seq - 5] = 1, 2, 3
    seg[1, :seq // 2 + 1], seg[1, seq // 2 + 1:] = 1, 2
    ct = jax.random.normal(kg, (B, seq, H, D), jnp.float32)  # the output's cotangent
    return q, k, v, jnp.asarray(seg), ct


def _reference(q, k, v, seg, ct, causal, use_seg):
    def attn(q, k, v):
        mask = (seg[:, :, None] == seg[:, None, :])[:, None] if use_seg else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(ct)


@functools.lru_cache(maxsize=None)
def _cut_program(fn_name, cp, causal, layout, use_seg):
    """jit of (q, k, v, seg, ct) -> (out, (dq, dk, dv)) with the sequence cut over cp, in global order."""
    fn, mesh = FNS[fn_name], _mesh(cp)

    def attn(q, k, v, seg):
        return fn(q, k, v, axis_name="cp", causal=causal, layout=layout, segment_ids=seg if use_seg else None)

    cut = jax.shard_map(attn, mesh=mesh, in_specs=(P(None, "cp"),) * 4, out_specs=P(None, "cp"))

    @jax.jit
    def run(q, k, v, seg, ct):
        seq = q.shape[1]
        perm = zigzag_permutation(seq, cp) if layout == "zigzag" else np.arange(seq)
        inv = unzigzag_permutation(seq, cp) if layout == "zigzag" else np.arange(seq)
        out, vjp = jax.vjp(lambda q, k, v: cut(q[:, perm], k[:, perm], v[:, perm], seg[:, perm])[:, inv], q, k, v)
        return out, vjp(ct)

    return run


def _check(fn_name, cp, mask, kv_heads, seq):
    causal, layout, use_seg = MASKS[mask]
    q, k, v, seg, ct = _inputs(seq, kv_heads)
    out, grads = _cut_program(fn_name, cp, causal, layout, use_seg)(q, k, v, seg, ct)
    ref_out, ref_grads = _reference(q, k, v, seg, ct, causal, use_seg)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("fn_name", list(FNS))
def test_equals_full_attention_cp4_gqa(fn_name, mask):
    _check(fn_name, 4, mask, kv_heads=2, seq=32)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("cp,seq", [(2, 32), (4, 64), (8, 64)])
@pytest.mark.parametrize("fn_name", list(FNS))
def test_equals_full_attention(fn_name, cp, seq, mask, kv_heads):
    _check(fn_name, cp, mask, kv_heads, seq)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_executes_cp_minus_1_permutes_of_k_and_v(cp):
    seq, kv_heads = 64, 2
    q, k, v, seg, _ = _inputs(seq, kv_heads)
    mesh = _mesh(cp)
    block = B * (seq // cp) * kv_heads * D * 4  # one rank's K (or V) block, bytes
    for use_seg in (False, True):
        fwd = jax.jit(jax.shard_map(
            lambda q, k, v, s: ring_attention(q, k, v, axis_name="cp", causal=True, layout="zigzag",
                                              segment_ids=s if use_seg else None),
            mesh=mesh, in_specs=(P(None, "cp"),) * 4, out_specs=P(None, "cp")))
        got = executed_collectives(fwd, q, k, v, seg)
        seg_bytes = B * (seq // cp) * 4 if use_seg else 0  # the key segment ids travel with their block
        assert got["collective-permute"]["buffers"] == (cp - 1) * (3 if use_seg else 2), got
        assert got["collective-permute"]["bytes"] == (cp - 1) * (2 * block + seg_bytes), got
        assert all(got[kind]["count"] == 0 for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all"))


def test_ring_backward_runs_the_ring_again():
    """The custom VJP's backward: K and V make cp - 1 hops again, dK and dV cp hops (home at the end)."""
    cp, seq, kv_heads = 4, 32, 2
    q, k, v, _, _ = _inputs(seq, kv_heads)
    mesh = _mesh(cp)
    cut = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="cp", causal=True), mesh=mesh,
                        in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    grad = jax.jit(jax.grad(lambda q, k, v: cut(q, k, v).sum(), argnums=(0, 1, 2)))
    got = executed_collectives(grad, q, k, v)
    block = B * (seq // cp) * kv_heads * D * 4
    hops = 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp  # forward K, V; backward K, V; backward dK, dV
    assert got["collective-permute"]["buffers"] == hops, got
    assert got["collective-permute"]["bytes"] == hops * block, got


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_allgather_executes_the_k_and_v_gathers(cp):
    seq, kv_heads = 64, 2
    q, k, v, seg, _ = _inputs(seq, kv_heads)
    fwd = jax.jit(jax.shard_map(
        lambda q, k, v: allgather_attention(q, k, v, axis_name="cp", causal=True, layout="zigzag"),
        mesh=_mesh(cp), in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp")))
    got = executed_collectives(fwd, q, k, v)
    assert got["all-gather"]["buffers"] == 2, got
    assert got["all-gather"]["bytes"] == 2 * B * seq * kv_heads * D * 4, got  # the gathered K and V
    assert all(got[kind]["count"] == 0 for kind in ("collective-permute", "all-reduce", "reduce-scatter"))


# ------------------------------------------------------------------------------------------- the zigzag cut


def test_zigzag_permutation():
    # T = 8 over cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_permutation(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_permutation(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    for seq, cp in ((8, 1), (32, 4), (64, 8), (96, 3)):
        perm, inv = zigzag_permutation(seq, cp), unzigzag_permutation(seq, cp)
        assert sorted(perm.tolist()) == list(range(seq))
        np.testing.assert_array_equal(perm[inv], np.arange(seq))
        np.testing.assert_array_equal(inv[perm], np.arange(seq))


def _brute_force_pairs(seq, cp, layout):
    """Attended (query, key) pairs per rank, from the full causal mask rows of each rank's tokens."""
    order = zigzag_permutation(seq, cp) if layout == "zigzag" else np.arange(seq)
    mask = np.tril(np.ones((seq, seq), bool))
    return np.array([mask[rows].sum() for rows in np.split(order, cp)])


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_work_per_rank(cp, layout):
    seq = 32 * cp
    work = causal_work(seq, cp, layout=layout)
    np.testing.assert_array_equal(work["pairs"], _brute_force_pairs(seq, cp, layout))
    r = np.arange(cp)
    # pieces of seq / (2 cp) tokens, two per rank: the ring computes every (q piece, k piece) pair not wholly
    # in the future; plain cut: 4 per earlier rank's block + 3 on the diagonal; zigzag: 3 + 2 per other rank
    expected_blocks = 4 * r + 3 if layout == "contiguous" else np.full(cp, 3 + 2 * (cp - 1))
    np.testing.assert_array_equal(work["blocks"], expected_blocks)


def test_zigzag_balances_causal_work():
    seq, cp = 256, 4
    plain, zigzag = causal_work(seq, cp, layout="contiguous"), causal_work(seq, cp, layout="zigzag")
    imbalance = {name: w["pairs"].max() / w["pairs"].mean() for name, w in (("plain", plain), ("zigzag", zigzag))}
    assert imbalance["zigzag"] == 1.0
    # plain: rank r attends L^2 r + L (L + 1) / 2 pairs with L = seq / cp
    L = seq // cp
    closed = L * L * np.arange(cp) + L * (L + 1) // 2
    assert imbalance["plain"] == pytest.approx(closed.max() / closed.mean())
    assert imbalance["plain"] > 1.7
    assert zigzag["blocks"].max() / zigzag["blocks"].mean() == 1.0
    assert plain["blocks"].max() / plain["blocks"].mean() == pytest.approx(15 / 9)


# ------------------------------------------------------------------------------------------------- errors


def test_errors():
    q = jnp.zeros((B, 8, H, D))
    k = jnp.zeros((B, 8, 3, D))
    with pytest.raises(ValueError, match=re.escape("zigzag_permutation: seq_len=10 is not divisible by 2 * cp = 4")):
        zigzag_permutation(10, 2)
    with pytest.raises(TypeError, match=re.escape("zigzag_permutation: cp=2.0 is not an integer")):
        zigzag_permutation(8, 2.0)
    with pytest.raises(ValueError, match=re.escape("causal_work: layout='ring' is not one of")):
        causal_work(8, 2, layout="ring")
    with pytest.raises(ValueError, match=re.escape("ring_attention: q has 4 heads, not a multiple of k's 3 heads")):
        ring_attention(q, k, k, axis_name="cp")
    k = jnp.zeros((B, 8, 2, D))
    with pytest.raises(ValueError, match=re.escape("ring_attention: axis_name='cp' is not a mesh dim of the "
                                                   "enclosing SPMD region")):
        ring_attention(q, k, k, axis_name="cp")
    with pytest.raises(ValueError, match=re.escape("allgather_attention: layout='zig' is not one of")):
        allgather_attention(q, k, k, axis_name="cp", layout="zig")
    with pytest.raises(TypeError, match=re.escape("ring_attention: segment_ids=")):
        ring_attention(q, k, k, axis_name="cp", segment_ids=jnp.zeros((B, 8)))
    with pytest.raises(ValueError, match=re.escape("ring_attention: segment_ids has shape (2, 4)")):
        ring_attention(q, k, k, axis_name="cp", segment_ids=jnp.zeros((B, 4), jnp.int32))
    with pytest.raises(ValueError, match=re.escape("ring_attention: layout='zigzag' needs an even local sequence")):
        ring_attention(q[:, :7], k[:, :7], k[:, :7], axis_name="cp", causal=True, layout="zigzag")
    with pytest.raises(ValueError, match=re.escape("ring_attention: causal=True needs q and k cut alike")):
        ring_attention(q, k[:, :4], k[:, :4], axis_name="cp", causal=True)
    with pytest.raises(ValueError, match=re.escape("ring_attention: q has shape (2, 8, 32)")):
        ring_attention(q.reshape(B, 8, H * D), k, k, axis_name="cp")


@pytest.mark.parametrize("check_vma", [True, False])
def test_ring_in_spmd_region_on_dp_x_cp(check_vma):
    """Inside ``spmd.spmd`` on a 2-D mesh (batch cut over dp, sequence over cp), with and without JAX's vma
    checking: the ring runs over cp alone and equals full attention, values and gradients."""
    from spmd import Shard

    cp, seq = 4, 32
    mesh = spmd.init_device_mesh("cpu", (2, cp), mesh_dim_names=("dp", "cp"))
    q, k, v, seg, ct = _inputs(seq, 2)
    perm, inv = zigzag_permutation(seq, cp), unzigzag_permutation(seq, cp)

    @spmd.spmd(mesh, in_placements=[Shard(0), Shard(1)], out_placements=[Shard(0), Shard(1)], check_vma=check_vma)
    def attn(q, k, v, seg):
        return ring_attention(q, k, v, axis_name="cp", causal=True, segment_ids=seg, layout="zigzag")

    @jax.jit
    def run(q, k, v, ct):
        out, vjp = jax.vjp(lambda q, k, v: attn(q[:, perm], k[:, perm], v[:, perm], seg[:, perm])[:, inv], q, k, v)
        return out, vjp(ct)

    out, grads = run(q, k, v, ct)
    ref, ref_grads = _reference(q, k, v, seg, ct, True, True)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("fn_name", list(FNS))
def test_scale(fn_name):
    cp, seq = 2, 16
    q, k, v, _, _ = _inputs(seq, 2)
    cut = jax.jit(jax.shard_map(lambda q, k, v: FNS[fn_name](q, k, v, axis_name="cp", causal=True, scale=0.3),
                                mesh=_mesh(cp), in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp")))
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    np.testing.assert_allclose(cut(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_attention_runs_across_the_cut_only_in_the_context_that_installed_it():
    """``ContextCalls.installed`` is per context (a ``contextvars.ContextVar``), not a module attribute swapped while
    a step traces: another thread calling ``jax.nn.dot_product_attention`` meanwhile runs the original (before, it
    ran the cp version and was refused: its 4 positions are not the installed sequence's 8)."""
    import threading

    from spmd.parallel.context._calls import ContextCalls

    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32) for _ in range(3))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", qn, kn) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vn)  # NumPy's attention
    inside, release, seen = threading.Event(), threading.Event(), {}

    def trace_in_context():
        with ContextCalls(mesh.jax_mesh, 2, 8, "cp").installed():
            try:
                jax.nn.dot_product_attention(q, k, v)
            except ValueError as e:
                seen["error"] = str(e)
            inside.set()
            release.wait(60)

    t = threading.Thread(target=trace_in_context)
    t.start()
    try:
        assert inside.wait(60)
        got = jax.nn.dot_product_attention(q, k, v)  # while the other thread's context is open
    finally:
        release.set()
        t.join(60)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert "query has 4 positions and key 4, but the batch's sequence cut over cp has 8" in seen["error"]
