"""Redistribute: every src -> dst over {R, S(d), P(op)} on meshes (8,), (3,), (2, 4), (2, 2, 2).

Values are checked against an independent NumPy reference (blocks placed at
their torch.chunk offsets, Partial values reduced with their op, replicas
compared). Most of the catalogue runs the NumPy simulator of a plan (the same
index tables as the jitted program, NumPy stand-ins for the collectives); a
fixed subset per mesh runs the real jitted program and checks that the HLO's
collective bytes equal the plan's bytes.
"""

from __future__ import annotations

import itertools
import math
import random

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import spmd
from placements import (
    Partial,
    Replicate,
    Shard,
    format_placements,
    local_shape_and_offset,
    local_shapes,
    padded_local_shape,
    plan,
)
from spmd._inspect import hlo_collectives
from spmd.tensor._dispatch import program
from spmd.tensor._dtensor import from_physical, physical
from spmd.tensor._storage import extents
from spmd.testing import np_storage, simulate_plan

R = Replicate()
OPS = ("sum", "avg", "max", "min", "product")
MESHES = [(8,), (3,), (2, 4), (2, 2, 2)]


# --- an independent NumPy reference ----------------------------------------------------------
def coords_of(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def reduce_np(vals, op):
    s = np.stack(vals)
    return {
        "sum": lambda: s.sum(0, dtype=s.dtype),
        "avg": lambda: (s.sum(0, dtype=s.dtype) / len(vals)).astype(s.dtype),
        "product": lambda: s.prod(0, dtype=s.dtype),
        "max": lambda: s.max(0),
        "min": lambda: s.min(0),
    }[op]()


def full_from_blocks(blocks, shape, mesh_shape, pl):
    """The logical tensor from per-coord unpadded blocks: shards placed at their offsets,
    replicas checked equal, partial values reduced."""
    pdims = [d for d, p in enumerate(pl) if isinstance(p, Partial)]
    ops = {pl[d].reduce_op for d in pdims}
    parts = {}
    for c in coords_of(mesh_shape):
        key = tuple(c[d] for d in pdims)
        full = parts.setdefault(key, {})
        ls, off = local_shape_and_offset(shape, mesh_shape, pl, c)
        b = np.asarray(blocks[c])
        assert b.shape == ls, (c, b.shape, ls)
        for idx in itertools.product(*(range(s) for s in ls)):
            g = tuple(o + i for o, i in zip(off, idx))
            if g in full:
                assert full[g] == b[idx], f"replicas differ at {g} (coord {c})"
            full[g] = b[idx]
    outs = []
    for key in sorted(parts):
        full = parts[key]
        arr = np.zeros(shape, dtype=np.asarray(blocks[coords_of(mesh_shape)[0]]).dtype)
        assert len(full) == math.prod(shape)
        for g, v in full.items():
            arr[g] = v
        outs.append(arr)
    if not pdims:
        return outs[0]
    if ops <= {"sum", "avg"} and len(ops) == 2:  # mixed sum/avg: reduce dim by dim
        vals = {k: outs[i] for i, k in enumerate(sorted(parts))}
        for j, d in reversed(list(enumerate(pdims))):
            new = {}
            for k, v in vals.items():
                new.setdefault(k[:j], []).append(v)
            vals = {k: reduce_np(v, pl[d].reduce_op) for k, v in new.items()}
        return vals[()]
    return reduce_np(outs, ops.pop())


def unpadded_blocks(phys, shape, mesh_shape, pl):
    """Each device's unpadded block of a storage array (a value stored once is every device's block)."""
    assert phys.shape[: len(mesh_shape)] == extents(mesh_shape, pl)
    phys = np.broadcast_to(phys, tuple(mesh_shape) + phys.shape[len(mesh_shape):])
    out = {}
    for c in coords_of(mesh_shape):
        ls = local_shape_and_offset(shape, mesh_shape, pl, c)[0]
        out[c] = np.asarray(phys[c])[tuple(slice(0, s) for s in ls)]
    return out


def data(shape, dtype=np.float32):
    """Integer-valued data (exact under every op), with a mix of signs and no zeros."""
    n = math.prod(shape)
    v = (np.arange(n) % 7) + 1
    v = np.where(np.arange(n) % 3 == 0, -v, v)
    return v.reshape(shape).astype(dtype)


np_distribute = np_storage  # physical layout of x placed by pl (Partial as R -> P: coord 0 keeps the value)


def placement_set(ndim, ops):
    return [R] + [Shard(d) for d in range(ndim)] + [Partial(op) for op in ops]


def allowed(src, dst):
    if any(isinstance(a, Partial) and isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
        return False
    for pl in (src, dst):
        ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
        if len(ops) > 1 and not ops <= {"sum", "avg"}:
            return False
    return True


def check_sim(x, mesh_shape, src, dst):
    p = plan(mesh_shape, x.shape, x.dtype.itemsize, src, dst)
    phys = np_distribute(x, mesh_shape, src)
    out = simulate_plan(p, phys)
    assert out.shape == extents(mesh_shape, dst) + padded_local_shape(x.shape, mesh_shape, dst)
    blocks = unpadded_blocks(out, x.shape, mesh_shape, dst)
    got = full_from_blocks(blocks, x.shape, mesh_shape, dst)
    np.testing.assert_array_equal(got, x, err_msg=f"{mesh_shape} {format_placements(src)} -> {format_placements(dst)}")
    return p


# --- catalogue through the simulator -------------------------------------------------------------
SHAPES_1D = [(16,), (5,), (1,), (3,), (10, 7), (2, 3, 9)]


@pytest.mark.parametrize("mesh_shape", [(8,), (3,)])
@pytest.mark.parametrize("shape", SHAPES_1D)
def test_catalogue_1d_simulated(mesh_shape, shape):
    x = data(shape)
    pls = placement_set(len(shape), OPS)
    for a, b in itertools.product(pls, repeat=2):
        if allowed((a,), (b,)):
            check_sim(x, mesh_shape, (a,), (b,))


@pytest.mark.parametrize(
    "mesh_shape,shape,ops",
    [
        ((2, 4), (10, 7), ("sum", "max")),
        ((2, 4), (8, 4), ("avg", "product")),
        ((2, 4), (3, 1), ("min",)),
        # every pair on the 3-D mesh (4,096): the slow tier; test_catalogue_3d_rank3_sampled samples it here
        pytest.param((2, 2, 2), (5, 3), ("sum",), marks=pytest.mark.slow),
    ],
)
def test_catalogue_nd_simulated(mesh_shape, shape, ops):
    x = data(shape)
    lists = list(itertools.product(placement_set(len(shape), ops), repeat=len(mesh_shape)))
    for src in lists:
        for dst in lists:
            if allowed(src, dst):
                check_sim(x, mesh_shape, src, dst)


def test_catalogue_3d_rank3_sampled():
    """(2, 2, 2) with a rank-3 uneven tensor: 600 random pairs over {R, S(0..2), P(min)}."""
    rng = random.Random(0)
    x = data((3, 5, 2))
    pls = placement_set(3, ("min",))
    lists = list(itertools.product(pls, repeat=3))
    for _ in range(600):
        src, dst = rng.choice(lists), rng.choice(lists)
        check_sim(x, (2, 2, 2), src, dst)


# --- real execution + HLO bytes -----------------------------------------------------------------
@pytest.fixture(scope="module")
def meshes():
    return {s: spmd.init_device_mesh("cpu", s) for s in MESHES}


def run_real(mesh, x, src, dst):
    dt = spmd.distribute_tensor(x, mesh, src)
    p = spmd.plan_redistribute(dt, dst)
    if not p.steps:
        return dt, p, {"bytes": 0}
    compiled = program(mesh, p).lower(physical(dt)).compile()
    hlo = hlo_collectives(compiled.as_text())
    out = from_physical(compiled(physical(dt)), mesh, p.dst, x.shape)
    return out, p, hlo


REAL = {
    (8,): [((16, 4), "S0", "S1"), ((10, 3), "S0", "S1"), ((5,), "S0", "R"), ((10, 3), "P(sum)", "S0"),
           ((16,), "P(avg)", "S0"), ((10, 3), "P(max)", "S1"), ((9,), "P(product)", "R"), ((10, 3), "P(min)", "R"),
           ((10, 3), "R", "P(sum)"), ((10, 3), "S1", "P(max)"), ((3, 2), "S0", "P(avg)"), ((2, 3, 9), "S2", "S0"),
           ((1,), "P(sum)", "S0"), ((10, 3), "R", "S0")],
    (3,): [((10, 3), "S0", "S1"), ((7,), "S0", "R"), ((7, 2), "P(sum)", "S0"), ((4, 5), "P(product)", "S1"),
           ((2,), "R", "S0")],
    (2, 4): [((16, 8), "S0S1", "S1S0"), ((16, 8), "S0S1", "S0S0"), ((16, 8), "S0S0", "S1S1"), ((10, 7), "S0S1", "S1S0"),
             ((10, 7), "S0S0", "RS1"), ((10, 7), "P(sum)S0", "S0P(sum)"), ((10, 7), "P(max)P(max)", "S1S0"),
             ((5, 3), "RS0", "S0R"), ((10, 7), "P(avg)S1", "RR"), ((3, 1), "S0S0", "P(product)S1")],
    (2, 2, 2): [((5, 3, 4), "S0S1S2", "S2S1S0"), ((5, 3), "S0S0S0", "S1S1S1"), ((5, 3), "P(min)S1S0", "S0RP(min)"),
                ((8, 4), "S0RS1", "RS1S0"), ((3, 5, 2), "P(sum)P(avg)S2", "S0S1R")],
}


def parse(s):
    out = []
    while s:
        if s[0] == "R":
            out.append(R)
            s = s[1:]
        elif s[0] == "S":
            out.append(Shard(int(s[1])))
            s = s[2:]
        else:
            j = s.index(")")
            out.append(Partial(s[2:j]))
            s = s[j + 1 :]
    return tuple(out)


@pytest.mark.parametrize(
    "mesh_shape,shape,src,dst", [(m, *c) for m, cs in REAL.items() for c in cs], ids=lambda v: str(v).replace(" ", "")
)
def test_real_execution_and_hlo_bytes(meshes, mesh_shape, shape, src, dst):
    x = data(shape)
    src, dst = parse(src), parse(dst)
    out, p, hlo = run_real(meshes[mesh_shape], x, src, dst)
    assert out.placements == dst and out.shape == shape
    assert [tuple(t.shape) for t in out.local_tensors()] == list(local_shapes(shape, mesh_shape, dst))
    blocks = unpadded_blocks(np.asarray(physical(out)), shape, mesh_shape, dst)
    np.testing.assert_array_equal(full_from_blocks(blocks, shape, mesh_shape, dst), x)
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
    # the simulator agrees with the real program block for block
    sim = simulate_plan(p, np_distribute(x, mesh_shape, src)) if p.steps else np_distribute(x, mesh_shape, src)
    got = unpadded_blocks(np.asarray(physical(out)), shape, mesh_shape, dst)
    want = unpadded_blocks(sim, shape, mesh_shape, dst)
    for c in got:
        np.testing.assert_array_equal(got[c], want[c])
    if p.steps:
        assert sum(v["bytes"] for k, v in hlo.items()) == p.cost().bytes


# --- lowering pinned in HLO -------------------------------------------------------------------------
def kinds(hlo):
    return {k: v["count"] for k, v in hlo.items() if v["count"]}


@pytest.mark.parametrize(
    "mesh_shape,src,dst,expected",
    [
        ((8,), "R", "S0", {}),
        ((8,), "R", "S1", {}),
        ((8,), "S0", "R", {"all-gather": 1}),
        ((8,), "S1", "R", {"all-gather": 1}),
        ((8,), "P(sum)", "R", {"all-reduce": 1}),
        ((8,), "P(avg)", "R", {"all-reduce": 1}),
        ((8,), "P(max)", "R", {"all-reduce": 1}),
        ((8,), "P(min)", "R", {"all-reduce": 1}),
        ((8,), "P(sum)", "S0", {"reduce-scatter": 1}),
        ((8,), "P(avg)", "S1", {"reduce-scatter": 1}),
        ((8,), "S0", "S1", {"all-to-all": 1}),
        ((8,), "S1", "S0", {"all-to-all": 1}),
        ((8,), "R", "P(sum)", {}),
        ((2, 4), "S0S1", "S0S0", {"all-to-all": 1}),
        ((2, 4), "S0S0", "S1S1", {"all-to-all": 1}),
        ((2, 4), "P(sum)P(sum)", "RR", {"all-reduce": 1}),
        ((2, 4), "S0S1", "RR", None),
    ],
)
def test_lowering_in_hlo(meshes, mesh_shape, src, dst, expected):
    x = data((16, 32))
    out, p, hlo = run_real(meshes[mesh_shape], x, parse(src), parse(dst))
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
    if expected is not None:
        assert kinds(hlo) == expected
    assert sum(v["count"] for v in hlo.values()) == len(p.collectives)
    assert sum(v["bytes"] for v in hlo.values()) == p.cost().bytes


def test_s0s1_to_s1s0_at_most_two_collectives(meshes):
    x = data((16, 32))
    out, p, hlo = run_real(meshes[(2, 4)], x, parse("S0S1"), parse("S1S0"))
    assert sum(v["count"] for v in hlo.values()) <= 2
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)


# --- hypothesis round trips --------------------------------------------------------------------------
def placement_lists(mesh_ndim, ndim, op):
    pls = [R] + [Shard(d) for d in range(ndim)] + [Partial(op)]
    return st.lists(st.sampled_from(pls), min_size=mesh_ndim, max_size=mesh_ndim).map(tuple)


@st.composite
def chains(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    op = draw(st.sampled_from(OPS))
    pl = placement_lists(len(mesh_shape), ndim, op)
    chain = draw(st.lists(pl, min_size=2, max_size=4))
    return mesh_shape, shape, chain


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chains())
def test_hypothesis_round_trips_simulated(case):
    """1000 random (mesh, shape, op, chain of placement lists): each hop runs the NumPy
    simulator of its plan, and the value is unchanged after every hop."""
    mesh_shape, shape, chain = case
    x = data(shape, np.float64)
    phys = np_distribute(x, mesh_shape, chain[0])
    for a, b in zip(chain, chain[1:]):
        p = plan(mesh_shape, shape, 8, a, b)
        phys = simulate_plan(p, phys) if p.steps else phys
        blocks = unpadded_blocks(phys, shape, mesh_shape, b)
        np.testing.assert_array_equal(full_from_blocks(blocks, shape, mesh_shape, b), x)


# A bounded pool so compiled programs are shared: 2 shapes x few placements per mesh.
POOL_SHAPES = [(5, 3), (8,)]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    st.sampled_from([(8,), (2, 4), (2, 2, 2)]),
    st.sampled_from(POOL_SHAPES),
    st.sampled_from(["sum", "max"]),
    st.data(),
)
def test_hypothesis_round_trips_real(meshes, mesh_shape, shape, op, draw):
    """Real jitted redistributes along random chains drawn from a bounded pool."""
    mesh = meshes[mesh_shape]
    pl = placement_lists(len(mesh_shape), len(shape), op)
    chain = draw.draw(st.lists(pl, min_size=2, max_size=3))
    x = data(shape)
    dt = spmd.distribute_tensor(x, mesh, chain[0])
    for b in chain[1:]:
        dt = dt.redistribute(placements=b)
        assert [tuple(t.shape) for t in dt.local_tensors()] == list(local_shapes(shape, mesh_shape, b))
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


@pytest.mark.parametrize(
    "src,dst,expected",
    [("S0", "S1", {"all-to-all": 1}), ("S0", "R", {"all-gather": 1}), ("P(sum)", "S0", {"reduce-scatter": 1}),
     ("P(max)", "R", {"all-reduce": 1}), ("R", "S1", {})],
)
def test_public_api_under_spmd_collectives(meshes, src, dst, expected):
    """``spmd.collectives`` on the public calls (traced under jit): redistribute and full_tensor
    add nothing beyond the plan's collectives."""
    x = data((16, 32))
    dt = spmd.distribute_tensor(x, meshes[(8,)], parse(src))
    got = spmd.collectives(lambda d: d.redistribute(placements=parse(dst)), dt)
    assert kinds(got) == expected
    assert sum(v["bytes"] for v in got.values()) == spmd.plan_redistribute(dt, parse(dst)).cost().bytes
    full = spmd.collectives(lambda d: d.full_tensor(), dt.redistribute(placements=parse(dst)))
    n_full = len(spmd.plan_redistribute(dt.redistribute(placements=parse(dst)), [R]).collectives)
    assert sum(v["count"] for v in full.values()) == n_full
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda d: d.full_tensor())(dt)), x)


# --- the program cache: weak per mesh, bounded ---------------------------------------------------
def _entries_for(names):
    from spmd.tensor import _dispatch

    return [len(v) for m, v in list(_dispatch._BY_MESH.items()) if m.mesh_dim_names == names]


def test_program_cache_dies_with_its_mesh():
    import gc

    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("cache_dies",))
    x = data((8, 3))
    out = spmd.distribute_tensor(x, mesh, [Shard(0)]).redistribute(placements=[R])
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
    assert _entries_for(("cache_dies",)) == [3]  # the request, its plan's program, full_tensor's request (R -> R)
    del mesh, out
    gc.collect()
    assert _entries_for(("cache_dies",)) == []


def test_program_cache_is_bounded_and_evicts_one_at_a_time(monkeypatch):
    from spmd.tensor import _dispatch

    monkeypatch.setattr(_dispatch, "MAX_PER_MESH", 3)
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("cache_bounded",))
    x = data((8, 4))
    dt = spmd.distribute_tensor(x, mesh, [Shard(0)])
    for dst in ([R], [Shard(1)], [Partial("sum")], [Shard(1)], [R]):
        out = dt.redistribute(placements=dst)
        np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
        assert _entries_for(("cache_bounded",)) == [3]
    keys = list(_dispatch._BY_MESH[mesh])
    assert keys[-1] == ((Replicate(),), (8, 4), dt.dtype, (R,))  # the last request is the most recent entry


def test_grad_through_all_gather_is_torchs_gradient(meshes):
    """S -> R lowers to the invariant all-gather (a Replicate value is stored once): jax.grad through
    redistribute/full_tensor is the true gradient, placed as the input (torch's), on a 2-D mesh, and the
    backward of the all-gather is a local slice (no collective)."""
    x = data((8, 4))
    for src in (parse("S0S1"), parse("S0S0"), parse("S1R"), parse("RR")):
        dt = spmd.distribute_tensor(x, meshes[(2, 4)], src)
        f = jax.grad(lambda d: (d.redistribute(placements=[R, R]).full_tensor() ** 2).sum())
        g = f(dt)
        assert g.placements == src
        np.testing.assert_array_equal(np.asarray(g.full_tensor()), 2 * x)
        hlo = hlo_collectives(jax.jit(f).lower(dt).compile().as_text())
        forward = spmd.plan_redistribute(dt, [R, R]).steps  # all-gathers only; the backward adds nothing
        assert hlo["all-gather"]["count"] == len(forward), (format_placements(src), hlo)
        assert hlo["all-reduce"]["count"] == hlo["reduce-scatter"]["count"] == 0, hlo
