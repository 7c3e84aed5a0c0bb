"""DTensor ops (``spmd.ops``, operators, methods): values equal NumPy on the full tensors, every
rank's local block is its torch.chunk slice of the NumPy result, output placements follow torch's
strategies, over R / S(d) / P(sum|max|min|avg) on meshes (8,), (3,), (2, 4) with even, uneven and
empty shards; jit (one program, collectives counted), grad, explain, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
import spmd.ops as ops
from placements import Partial, Replicate, Shard, format_placements, local_shape_and_offset, rank_to_coord
from spmd import DTensor, distribute_tensor

R = Replicate()
S = Shard
P = Partial


@pytest.fixture(scope="module")
def mesh3():
    return spmd.init_device_mesh("cpu", (3,), mesh_dim_names=("x",))


@pytest.fixture
def meshes(mesh8, mesh3, mesh2x4):
    return {"8": mesh8, "3": mesh3, "2x4": mesh2x4}


def data(shape, seed=0, positive=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, size=shape).astype(np.float32)
    return np.abs(x) + 1 if positive else x


def make(x, mesh, pl):
    """A DTensor of global value ``x``; Partial dims hold a non-trivial split of it (exact for
    integer-valued data): sum/avg add offsets that cancel, max/min lower/raise the other ranks."""
    pl = tuple(pl)
    if not any(isinstance(p, Partial) for p in pl):
        return distribute_tensor(x, mesh, pl)
    base = distribute_tensor(x, mesh, [R if isinstance(p, Partial) else p for p in pl]).local_tensors()
    locs = []
    for r, b in enumerate(base):
        b = np.asarray(b)
        c = rank_to_coord(r, mesh.shape)
        off = ((np.arange(b.size) % 3) + 1).reshape(b.shape).astype(b.dtype)
        for m, p in enumerate(pl):
            if not isinstance(p, Partial):
                continue
            i, k = c[m], mesh.shape[m]
            if p.reduce_op == "sum":
                b = (b if i == 0 else np.zeros_like(b)) + off * (1 if i else -(k - 1))
            elif p.reduce_op == "avg":
                b = b + off * (1 if i else -(k - 1))
            elif p.reduce_op == "max":
                b = b - off * i
            elif p.reduce_op == "min":
                b = b + off * i
        locs.append(b)
    return DTensor.from_local(locs, mesh, pl, shape=x.shape)


def check(out, ref, placements=None, tol=1e-5):
    """Values, shape and (if given) placements; each rank's block is its slice of ``ref``."""
    ref = np.asarray(ref)
    assert isinstance(out, DTensor), type(out)
    assert out.shape == ref.shape
    if placements is not None:
        assert out.placements == tuple(placements)
    np.testing.assert_allclose(np.asarray(out.full_tensor()), ref, rtol=tol, atol=tol)
    if not any(isinstance(p, Partial) for p in out.placements):
        mesh = out.device_mesh
        for r, t in enumerate(out.local_tensors()):
            shp, off = local_shape_and_offset(ref.shape, mesh.shape, out.placements, rank_to_coord(r, mesh.shape))
            np.testing.assert_allclose(
                np.asarray(t), ref[tuple(slice(o, o + s) for o, s in zip(off, shp))], rtol=tol, atol=tol
            )


def no_partial(pl):
    return not any(isinstance(p, Partial) for p in pl)


# Placements per mesh; shapes: (5, 3) is uneven on 8 and 3 ranks (empty shards on 8), (6, 4) even on 2 and 3.
PL = {
    "8": [[R], [S(0)], [S(1)], [P("sum")], [P("max")]],
    "3": [[S(0)], [S(1)], [P("sum")], [P("min")]],
    "2x4": [[S(0), S(1)], [R, S(0)], [S(1), P("sum")], [P("sum"), S(0)], [S(0), S(0)], [P("max"), R]],
}
CASES = [(m, pl) for m, pls in PL.items() for pl in pls]
IDS = [f"{m}-{''.join(map(str, pl))}" for m, pl in CASES]
# A smaller set for the op x placement products (the suite's time budget): every placement kind, every mesh.
SOME = [c for c in CASES if c[0] == "8" or c in (("3", [S(1)]), ("2x4", [S(0), S(1)]), ("2x4", [S(1), P("sum")]),
                                                  ("2x4", [P("max"), R]))]
SOME_IDS = [f"{m}-{''.join(map(str, pl))}" for m, pl in SOME]

UNARY = {
    "exp": (ops.exp, np.exp, {"max", "min"}),
    "log": (ops.log, np.log, set()),
    "tanh": (ops.tanh, np.tanh, {"max", "min"}),
    "sqrt": (ops.sqrt, np.sqrt, set()),
    "abs": (ops.abs, np.abs, set()),
    "negative": (lambda x: -x, np.negative, {"sum", "max", "min"}),
    "relu": (ops.relu, lambda a: np.maximum(a, 0), {"max", "min"}),
    "gelu": (lambda x: ops.gelu(x, approximate=False), lambda a: np.asarray(jax.nn.gelu(a, approximate=False)), set()),
}


# --- elementwise ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("case", SOME, ids=SOME_IDS)
def test_unary(meshes, name, case):
    m, pl = case
    fn, ref, keeps = UNARY[name]
    x = data((5, 3), positive=name in ("log", "sqrt"))
    out = fn(make(x, meshes[m], pl))
    flip = {"max": "min", "min": "max"} if name == "negative" else {}
    if no_partial(pl):
        want = tuple(pl)  # elementwise keeps every Shard
    elif all(p.reduce_op in keeps for p in pl if isinstance(p, Partial)):
        want = tuple(P(flip.get(p.reduce_op, p.reduce_op)) if isinstance(p, Partial) else p for p in pl)
    else:
        want = None
        assert no_partial(out.placements), out.placements  # a non-linear op reduces the Partial first
    check(out, ref(x), want, tol=1e-4)


BINARY = {
    "add": (lambda a, b: a + b, np.add),
    "subtract": (lambda a, b: a - b, np.subtract),
    "multiply": (lambda a, b: a * b, np.multiply),
    "divide": (lambda a, b: a / b, np.divide),
    "maximum": (ops.maximum, np.maximum),
    "minimum": (ops.minimum, np.minimum),
    "power": (lambda a, b: a**b, np.power),
}
PAIRS = [
    ("8", [S(0)], [S(0)], (5, 3), (5, 3), [S(0)]),
    ("8", [S(0)], [S(1)], (5, 3), (5, 3), [R]),  # torch: dim 1 (3) has fewer elements than 8 shards: no S(1) target
    ("8", [S(1)], [R], (9, 10), (10,), [S(1)]),  # broadcast: y is sharded like x's dim 1
    ("8", [S(0)], [R], (9, 10), (9, 1), [S(0)]),
    ("8", [S(1)], [R], (5, 3), (3,), [R]),  # torch: y's 3 elements cannot take 8 shards, so both are gathered
    ("8", [S(0)], [S(1)], (9, 10), (9, 10), [S(0)]),  # torch: the first of two equal costs
    ("3", [R], [S(0)], (1, 3), (4, 3), [S(0)]),  # x broadcast along the sharded dim
    ("3", [P("sum")], [P("sum")], (4, 3), (4, 3), None),  # P(sum) for add, R for the others
    ("3", [P("max")], [R], (4, 3), (4, 3), None),
    ("2x4", [S(0), S(1)], [S(0), S(1)], (5, 6), (5, 6), [S(0), S(1)]),
    ("2x4", [S(0), R], [R, S(0)], (6, 5), (5,), [S(0), S(1)]),
    ("2x4", [P("sum"), R], [R, S(1)], (4, 6), (4, 6), None),
]


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p[0]}-{''.join(map(str, p[1]))}-{''.join(map(str, p[2]))}-{p[4]}" for p in PAIRS])
def test_binary(meshes, name, pair):
    m, pa, pb, sa, sb, want = pair
    fn, ref = BINARY[name]
    x, y = data(sa, 1), data(sb, 2)
    if name in ("divide", "power"):
        y = np.abs(y) + 1  # no division by zero; small integer powers stay exact
    check(fn(make(x, meshes[m], pa), make(y, meshes[m], pb)), ref(x, y), want, tol=1e-4)


@pytest.mark.parametrize("case", SOME, ids=SOME_IDS)
def test_scalars_on_either_side(meshes, case):
    m, pl = case
    x = data((5, 3), 3)
    d = make(x, meshes[m], pl)
    check(2.5 * d, 2.5 * x, [P(p.reduce_op) if isinstance(p, Partial) and p.reduce_op == "sum" else p for p in pl]
          if all(not isinstance(p, Partial) or p.reduce_op == "sum" for p in pl) else None)
    check(d / 2, x / 2)
    check(1 - d, 1 - x)
    check(d + np.float32(3), x + 3)
    check(2.0 ** (d / 4), 2.0 ** (x / 4), tol=1e-5)
    if no_partial(pl):
        assert (d * 2).placements == tuple(pl) and (1 - d).placements == tuple(pl)


def test_partial_rules_of_binary_ops(mesh8):
    """torch 2.13's Partial pass-through rules (``_pointwise_ops.py``)."""
    x, y = data((4, 3), 1), data((4, 3), 2)
    ps, pm, r = make(x, mesh8, [P("sum")]), make(x, mesh8, [P("max")]), make(y, mesh8, [R])
    check(ps + make(y, mesh8, [P("sum")]), x + y, [P("sum")])
    check(ps * r, x * y, [P("sum")])  # linear in one argument
    check(ps / make(np.abs(y) + 1, mesh8, [R]), x / (np.abs(y) + 1), [P("sum")])
    check(pm + r, x + y, [P("max")])  # max(a_i) + r = max(a_i + r)
    check(pm - r, x - y, [P("max")])
    check(ops.maximum(pm, make(y, mesh8, [P("max")])), np.maximum(x, y), [P("max")])
    check(-pm, -x, [P("min")])
    check(ps * 3, x * 3, [P("sum")])
    out = ps + 1  # a scalar is not a tensor: no (P(sum), scalar) rule, the Partial is reduced first
    assert no_partial(out.placements)
    check(out, x + 1)
    out = ps * ps  # linear in one argument once the other is reduced (P(sum), R -> P(sum))
    check(out, x * x, [P("sum")])
    assert ops.explain(lambda a: a * a, ps, print_out=False).cost().collectives == 1
    check(ps * pm, x * x, [P("sum")])  # P(max) reduced (all_reduce max), P(sum) kept
    out = pm * pm  # no product rule for max: both reduced
    assert no_partial(out.placements)
    check(out, x * x)


def test_where_comparisons_and_astype(meshes):
    x = data((5, 3), 4)
    for m, pl in [("8", [S(0)]), ("3", [S(1)]), ("2x4", [S(1), S(0)])]:
        d = make(x, meshes[m], pl)
        check(ops.where(d > 0, d, 0.0), np.where(x > 0, x, 0), pl)
        check(d >= 1, x >= 1, pl)
        check(d == x[0, 0], x == x[0, 0], pl)
        check(d != d, x != x, pl)
        check(d.astype(jnp.int32), x.astype(np.int32), pl)
    pm = make(x, meshes["8"], [P("max")])
    check(pm.astype("int32"), x.astype(np.int32), [P("max")])  # casts are monotone
    ps = make(x, meshes["8"], [P("sum")])
    check(ps.astype("float16"), x.astype(np.float16), [P("sum")])  # float -> float keeps P(sum), as torch
    out = ps.astype("int32")  # int(a) + int(b) != int(a + b): reduced first
    assert no_partial(out.placements)
    check(out, x.astype(np.int32))


# --- reductions -------------------------------------------------------------------------------
RED = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
RED_CASES = SOME + [("3", [S(0)]), ("2x4", [S(0), S(0)])]


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("name", list(RED))
@pytest.mark.parametrize("case", RED_CASES, ids=[f"{m}-{''.join(map(str, pl))}" for m, pl in RED_CASES])
def test_reductions(meshes, case, name, axis):
    m, pl = case
    x = data((5, 3), 5) if name != "prod" else np.where(data((5, 3), 5) > 0, 2.0, -1.0).astype(np.float32)
    d = make(x, meshes[m], pl)
    keep = axis == 1
    out = getattr(d, name)(axis=axis, keepdims=keep)
    check(out, RED[name](x, axis=axis, keepdims=keep), tol=1e-5)
    op = {"mean": "avg", "prod": "product"}.get(name, name)
    axes = range(2) if axis is None else (axis,) if isinstance(axis, int) else axis
    for i, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim in axes and no_partial(pl):
            # torch: a reduction over a sharded dim leaves Partial(op); mean only if the shard is even
            even = name != "mean" or all(
                x.shape[d_] % np.prod([s for s, q in zip(meshes[m].shape, pl) if q == S(d_)]) == 0 for d_ in axes
            )
            assert out.placements[i] == (P(op) if even else R), (out.placements, i)
        if isinstance(p, Partial):
            assert out.placements[i] == (p if p.reduce_op == op else R)


def test_reduction_placements_table(mesh8, mesh2x4):
    x = data((8, 6))
    check(make(x, mesh8, [S(0)]).sum(0), x.sum(0), [P("sum")])
    check(make(x, mesh8, [S(0)]).sum(1), x.sum(1), [S(0)])
    check(make(x, mesh8, [S(0)]).sum(1, keepdims=True), x.sum(1, keepdims=True), [S(0)])
    check(make(x, mesh8, [S(1)]).sum(0), x.sum(0), [S(0)])
    check(make(x, mesh8, [S(0)]).mean(0), x.mean(0), [P("avg")])  # even: local means average exactly
    check(make(x, mesh8, [S(1)]).mean(1), x.mean(1), [R])  # 6 over 8 ranks is uneven: gathered first (torch)
    check(make(x, mesh8, [S(0)]).max(), x.max(), [P("max")])
    check(make(x, mesh8, [P("max")]).max(0), x.max(0), [P("max")])
    check(make(x, mesh8, [P("sum")]).sum(), x.sum(), [P("sum")])
    check(make(x, mesh8, [P("sum")]).max(1), x.max(1), [R])
    check(make(x, mesh2x4, [S(0), S(1)]).sum(0), x.sum(0), [P("sum"), S(0)])
    check(make(x, mesh2x4, [S(0), S(1)]).sum((0, 1)), x.sum((0, 1)), [P("sum"), P("sum")])
    check(make(x, mesh2x4, [S(1), R]).mean((0, 1), keepdims=True), x.mean((0, 1), keepdims=True), [P("avg"), R])
    check(make(x, mesh2x4, [S(0), S(0)]).min(0), x.min(0), [P("min"), P("min")])
    y = np.where(x > 0, 2.0, 1.0).astype(np.float32)
    check(make(y, mesh8, [S(1)]).prod(1), y.prod(1), [P("product")])
    check(ops.sum(make(x, mesh8, [S(0)]), axis=-1), x.sum(-1), [S(0)])


def test_empty_tensors_and_shards(mesh8, mesh3):
    x = data((0, 3))
    d = make(x, mesh8, [S(0)])
    check(d.sum(0), x.sum(0), [P("sum")])
    check(ops.exp(d) * 2, np.exp(x) * 2, [S(0)])
    check(d.sum(), x.sum())
    y = data((2, 3))  # ranks 2..7 hold empty shards
    e = make(y, mesh8, [S(0)])
    check(e.max(0), y.max(0), [P("max")])
    check(e.prod(0), y.prod(0), [P("product")])
    check(e.mean(0), y.mean(0), [R])
    check(e @ make(data((3, 4)), mesh8, [R]), y @ data((3, 4)), [R])  # torch: 2 rows cannot take 8 shards (a matmul)
    with ops.placement_strategy("cheapest"):
        check(e @ make(data((3, 4)), mesh8, [R]), y @ data((3, 4)), [S(0)])  # the rows stay where they are
    z = data((1, 4))
    check(make(z, mesh3, [S(0)]).T.sum(1), z.T.sum(1), [P("sum")])


# --- softmax and normalisation ------------------------------------------------------------------
@pytest.mark.parametrize("case", SOME, ids=SOME_IDS)
def test_softmax_log_softmax_layer_norm(meshes, case):
    m, pl = case
    x = data((5, 4), 6) / 2
    d = make(x, meshes[m], pl)
    want = tuple(R if isinstance(p, Partial) or p == S(1) else p for p in pl)  # the softmax dim and Partial replicated
    check(ops.softmax(d, axis=-1), np.asarray(jax.nn.softmax(x, axis=-1)), want)
    check(ops.log_softmax(d, axis=1), np.asarray(jax.nn.log_softmax(x, axis=1)), want, tol=1e-4)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    out = ops.layer_norm(d, axis=-1)
    check(out, (x - mu) / np.sqrt(var + 1e-5), tol=1e-4)
    assert S(1) not in out.placements and no_partial(out.placements)
    if no_partial(pl) and S(1) not in pl:
        assert out.placements == tuple(pl)  # rows keep their shards


# --- contractions -----------------------------------------------------------------------------
MM = [  # (9, 10) @ (10, 11): every dim has at least 8 elements, uneven on 8 and 3 ranks; torch 2.13's placements
    ("8", [S(0)], [R], [S(0)]),
    ("8", [R], [S(1)], [S(1)]),
    ("8", [S(1)], [S(0)], [P("sum")]),  # contraction over the sharded dim: Partial(sum), no communication
    ("8", [P("sum")], [R], [P("sum")]),  # linear in each argument
    ("8", [R], [P("sum")], [P("sum")]),
    ("3", [S(0)], [S(0)], [S(0)]),  # torch gathers y (the cheapest turns x to S(1): P(sum))
    ("3", [S(1)], [R], [P("sum")]),
    ("2x4", [S(0), R], [R, S(1)], [S(0), S(1)]),
    ("2x4", [R, S(1)], [R, S(0)], [R, P("sum")]),
    ("2x4", [S(0), S(1)], [R, S(0)], [S(0), P("sum")]),
]


@pytest.mark.parametrize("case", MM, ids=[f"{m}-{''.join(map(str, a))}@{''.join(map(str, b))}" for m, a, b, _ in MM])
def test_matmul(meshes, case):
    m, pa, pb, want = case
    x, w = data((9, 10), 7), data((10, 11), 8)
    check(make(x, meshes[m], pa) @ make(w, meshes[m], pb), x @ w, want, tol=1e-4)
    check(ops.matmul(make(x, meshes[m], pa), make(w[:, 0], meshes[m], [R] * len(pa))), x @ w[:, 0], tol=1e-4)
    x, w = data((5, 6), 7), data((6, 3), 8)  # dims with fewer elements than shards: torch gathers them first
    out = make(x, meshes[m], pa) @ make(w, meshes[m], pb)
    check(out, x @ w, tol=1e-4)
    if m == "8":
        assert out.placements == ((P("sum"),) if P("sum") in pa + pb else (R,))


def test_matmul_of_vectors(mesh8):
    """1-D operands, with torch's rules: ``dot`` gives P(sum) out of any sharded or Partial input, ``mv``
    keeps only P(sum) (a P(avg) is reduced), ``vm`` is ``mm``'s."""
    v, a = data((9,), 1), data((9, 10), 2)
    check(make(v, mesh8, [S(0)]) @ make(v, mesh8, [R]), v @ v, [P("sum")])
    check(make(v, mesh8, [P("avg")]) @ make(v, mesh8, [R]), v @ v, [P("sum")], tol=1e-4)
    check(make(v, mesh8, [R]) @ make(v, mesh8, [R]), v @ v, [R])
    check(make(a.T, mesh8, [P("avg")]) @ make(v, mesh8, [R]), a.T @ v, [R], tol=1e-4)
    check(make(a.T, mesh8, [P("sum")]) @ make(v, mesh8, [R]), a.T @ v, [P("sum")])
    check(make(v, mesh8, [P("avg")]) @ make(a, mesh8, [R]), v @ a, [P("avg")], tol=1e-4)


def test_einsum_and_batched_matmul(mesh8, mesh2x4):
    a, b = data((8, 5, 9), 1), data((8, 9, 4), 2)
    check(ops.einsum("bij,bjk->bik", make(a, mesh8, [S(0)]), make(b, mesh8, [S(0)])), a @ b, [S(0)])
    check(make(a, mesh8, [S(2)]) @ make(b, mesh8, [S(1)]), a @ b, [P("sum")])
    check(make(a, mesh2x4, [S(0), S(1)]) @ make(b, mesh2x4, [S(0), R]), a @ b, [S(0), S(1)])
    a3, b3 = data((3, 5, 6), 1), data((3, 6, 4), 2)  # 3 batches and 6 contracted on 8 ranks: torch gathers
    check(ops.einsum("bij,bjk->bik", make(a3, mesh8, [S(0)]), make(b3, mesh8, [S(0)])), a3 @ b3, [R])
    c = data((9, 9), 3)
    check(ops.einsum("ij,ij->i", make(c, mesh8, [S(1)]), make(c, mesh8, [S(1)])), (c * c).sum(1), [P("sum")])
    check(ops.einsum("ij,jk->ik", make(c, mesh8, [S(0)]), make(data((9, 2)), mesh8, [R])), c @ data((9, 2)), [S(0)])


# --- views ------------------------------------------------------------------------------------
def test_transpose_reshape_index(mesh8, mesh3, mesh2x4):
    x = data((5, 6), 9)
    d = make(x, mesh2x4, [S(0), S(1)])
    check(d.T, x.T, [S(1), S(0)])
    check(d.transpose(1, 0), x.T, [S(1), S(0)])
    y = data((2, 3, 4), 1)
    check(ops.transpose(make(y, mesh8, [S(2)]), (2, 0, 1)), y.transpose(2, 0, 1), [S(0)])
    e = data((6, 4), 2)
    check(make(e, mesh3, [S(0)]).reshape(24), e.reshape(24), [S(0)])  # leading dim of a merge, even
    check(make(e, mesh3, [S(0)]).reshape(3, 2, 4), e.reshape(3, 2, 4), [S(0)])  # split, 3 divisible by 3
    check(make(e, mesh3, [S(1)]).reshape(6, 4, 1), e.reshape(6, 4, 1), [S(1)])
    check(make(x, mesh8, [S(0), ]).reshape((5, 2, 3)), x.reshape(5, 2, 3), [S(0)])  # uneven, kept as is
    check(make(x, mesh8, [P("sum")]).reshape(-1), x.reshape(-1), [P("sum")])
    check(make(x, mesh8, [S(0)])[:, 2], x[:, 2], [S(0)])
    check(make(x, mesh8, [S(1)])[1:4, ..., None], x[1:4, ..., None], [S(1)])
    check(make(x, mesh8, [S(1)])[-1], x[-1], [S(0)])
    check(make(x, mesh2x4, [R, S(0)])[:, ::2], x[:, ::2], [R, S(0)])


# --- errors -------------------------------------------------------------------------------------
def raises(exc, text):
    return pytest.raises(exc, match=re.escape(text))


def test_errors(mesh8, mesh3, mesh2x4):
    x = make(data((5, 3)), mesh8, [S(0)])
    with raises(ValueError, "add: shapes (5, 3) placed S(0), (4,) placed R do not broadcast (dim -1 has sizes [3, 4]); make the sizes equal or 1"):
        x + make(data((4,)), mesh8, [R])
    with raises(ValueError, "multiply: operands live on different meshes"):
        x * make(data((5, 3)), mesh3, [S(0)])
    with raises(TypeError, "add: argument 1 is a ndarray of shape (5, 3), not a DTensor or a scalar; lay it out first"):
        x + data((5, 3))
    with raises(TypeError, "subtract: argument 0 is a ndarray of shape (5, 3), not a DTensor or a scalar"):
        data((5, 3)) - x
    with raises(ValueError, "reshape: a tensor of shape (5, 3) placed S(0) cannot become shape (15,) without communication: the shard of dim 0 (size 5, 8 shards) would not stay one contiguous block per rank. Redistribute first, e.g. x.redistribute(placements=[Replicate()]), then reshape"):
        x.reshape(15)
    with raises(ValueError, "reshape: cannot reshape a tensor of shape (5, 3) (15 elements) into (4, 4)"):
        x.reshape(4, 4)
    with raises(ValueError, "indexing: index 1 on dim 0, which placements S(0) shard; index only dims that are not sharded"):
        x[1]
    with raises(ValueError, "indexing: slice slice(0, 2, None) on dim 0, which placements S(0) shard"):
        x[0:2]
    with raises(IndexError, "indexing: index 3 is out of bounds for dim 1 of size 3 (shape (5, 3))"):
        x[:, 3]
    with raises(TypeError, "indexing: index [0, 1] is not supported on a DTensor"):
        x[:, [0, 1]]
    with raises(ValueError, "matmul: x of shape (5, 3) (placed S(0)) and y of shape (5, 3) (placed S(0)) do not contract: 3 != 5"):
        x @ x
    with raises(ValueError, "sum: axis=2 is out of range for a tensor of rank 2; use an axis in [-2, 1]"):
        x.sum(2)
    with raises(TypeError, "softmax: x is a int32 DTensor placed S(0); softmax needs a floating dtype: cast it first"):
        ops.softmax(x.astype("int32"))
    with raises(ValueError, "max: axis=0 of a tensor of shape (0, 3) (placed S(0)) is empty"):
        make(data((0, 3)), mesh8, [S(0)]).max(0)
    with raises(TypeError, "max: the result would be a bool tensor placed P(max), and a Partial needs a numeric dtype"):
        (x > 0).max(0)
    with raises(ValueError, "einsum: equation='ij,jk' needs an explicit output"):
        ops.einsum("ij,jk", x, x)
    with raises(ValueError, "transpose: axes=(0, 0) is not a permutation of range(2)"):
        x.transpose(0, 0)
    with raises(TypeError, "exp: no argument is a DTensor; call jax.numpy.exp on plain arrays"):
        ops.exp(1.0)
    with raises(TypeError, "explain: fn=3 is not callable"):
        ops.explain(3)
    with raises(TypeError, "placed_gradient: g=1 and primal=2 must both be DTensors"):
        ops.placed_gradient(1, 2)
    assert type(x).__hash__ is None  # == is elementwise: unhashable, as jax.Array (Python words the TypeError)
    with pytest.raises(TypeError):
        hash(x)


# --- explain, jit, grad --------------------------------------------------------------------------
def test_explain_prints_the_plan_before_running(mesh8, capsys):
    x, w = make(data((5, 8)), mesh8, [S(1)]), make(data((8, 4)), mesh8, [S(0)])
    out = ops.explain(lambda a, b: ops.relu(a @ b).sum(0), x, w)
    text = capsys.readouterr().out
    assert [s.op for s in out] == ["matmul", "relu", "sum"]
    assert out[0].output == (P("sum"),) and out[0].cost().collectives == 0 and out[0].alternative is None
    # relu is not linear: torch all-reduces the P(sum) to R (a (5, 4) float32 block per device); the
    # cheapest strategy reduce-scatters it to S(0) (8 x 1 x 4 floats per device), and explain shows both
    assert out[1].inputs == ((R,),) and out[1].plans[0].collectives == ("all_reduce",)
    assert out[1].cost().bytes == 5 * 4 * 4
    alt = out[1].alternative
    assert alt.inputs == ((S(0),),) and alt.plans[0].collectives == ("reduce_scatter",) and alt.cost().bytes == 8 * 4 * 4
    assert out[2].output == (R,)
    assert "matmul(S(1), S(0)) -> P(sum) (5, 4)" in text and "P(sum) -> R  [mesh dim 0: P(sum) -> R, all_reduce" in text
    assert "    cheapest: -> S(0)  [128 B per device in 1 collective(s), 112 B traffic]  (placement_strategy('cheapest'))" in text
    assert "P(sum) -> S(0)  [mesh dim 0: P(sum) -> S(0), reduce_scatter" in text
    assert "-> R (5, 4)  [80 B per device in 1 collective(s), 140 B traffic]" in text  # 2 x 80 x 7/8 for the all_reduce
    assert text.startswith(f"3 op(s), {out.cost()}, 140 B traffic to redistribute inputs (the cheapest strategy per op: "
                           f"{out.cheapest_cost()}, 112 B traffic):")
    assert out.cost().bytes == 80 and out.cheapest_cost().bytes == 128  # the padded blocks of 5 rows on 8 ranks
    with ops.placement_strategy("cheapest"):
        cheap = ops.explain(lambda a, b: ops.relu(a @ b).sum(0), x, w, print_out=False)
    assert cheap[1].inputs == ((S(0),),) and cheap[1].alternative is None and cheap[2].output == (P("sum"),)
    assert "(the cheapest" not in str(cheap)


def test_placement_strategy_setting(mesh8):
    """torch's placements by default; ``placement_strategy("cheapest")`` opts into the cheaper ones for the
    ops inside its block only (nested blocks restore the outer setting), and is checked."""
    x = data((8, 6))
    ps = make(x, mesh8, [P("sum")])
    check(ops.exp(ps), np.exp(x), [R], tol=1e-4)
    check(ps + 1, x + 1, [R])
    with ops.placement_strategy("cheapest") as st:
        assert repr(st) == "placement_strategy('cheapest')"
        check(ops.exp(ps), np.exp(x), [S(0)], tol=1e-4)  # reduce_scatter instead of all_reduce
        check(ps + 1, x + 1, [S(0)])
        with ops.placement_strategy("torch"):
            check(ops.tanh(ps), np.tanh(x), [R], tol=1e-4)
        check(ops.relu(ps), np.maximum(x, 0), [S(0)])
    check(ops.relu(ps), np.maximum(x, 0), [R])
    a, b = make(data((9, 8)), mesh8, [S(0)]), make(data((8, 9)), mesh8, [S(0)])
    check(a @ b, data((9, 8)) @ data((8, 9)), [S(0)], tol=1e-4)  # torch all-gathers b
    with ops.placement_strategy("cheapest"):
        check(a @ b, data((9, 8)) @ data((8, 9)), [P("sum")], tol=1e-4)  # an all-to-all of a instead
    with raises(ValueError, "placement_strategy: strategy='fast' is not one of ('torch', 'cheapest'); use 'torch'"):
        ops.placement_strategy("fast")

    def cheap_exp(d):  # the setting entered inside the jitted function is part of what jit traces
        with ops.placement_strategy("cheapest"):
            return ops.exp(d)

    check(jax.jit(cheap_exp)(ps), np.exp(x), [S(0)], tol=1e-4)
    check(jax.jit(ops.exp)(ps), np.exp(x), [R], tol=1e-4)


def test_jit_one_program_and_its_collectives(mesh2x4):
    x, w1, w2 = data((8, 6), 1), data((6, 8), 2) / 4, data((8, 4), 3) / 4
    dx, d1, d2 = make(x, mesh2x4, [S(0), R]), make(w1, mesh2x4, [R, S(1)]), make(w2, mesh2x4, [R, S(0)])

    def f(a, b, c):
        return ops.tanh(a @ b) @ c

    out = jax.jit(f)(dx, d1, d2)
    check(out, np.tanh(x @ w1) @ w2, [S(0), P("sum")], tol=1e-4)
    lowered = jax.jit(f).lower(dx, d1, d2).as_text()
    assert lowered.count("func.func public @main") == 1  # one program for the chain
    got = spmd.collectives(f, dx, d1, d2)
    assert sum(v["count"] for v in got.values()) == 0  # column- then row-parallel: nothing until the Partial is read
    g = lambda a, b, c: f(a, b, c).redistribute(placements=[S(0), R])
    got = spmd.collectives(g, dx, d1, d2)
    assert got["all-reduce"]["count"] == 1 and sum(v["count"] for v in got.values()) == 1
    assert got["all-reduce"]["bytes"] == 4 * 4 * 4  # one (4, 4) float32 block per device


@pytest.mark.parametrize("pa,pb", [([R], [S(1)]), ([S(0)], [R]), ([S(1)], [S(0)]), ([R], [R]), ([P("sum")], [R])])
def test_grad_placements_follow_torch_autograd(mesh8, pa, pb):
    x, w = data((5, 3), 1) / 4, data((3, 8), 2) / 4
    a, b = make(x, mesh8, pa), make(w, mesh8, pb)
    loss = lambda u, v: ops.sum(ops.tanh(u @ v)).full_tensor()
    g = 1 - np.tanh(x @ w) ** 2
    (value, (ga, gb)) = ops.value_and_grad(loss, argnums=(0, 1))(a, b)
    np.testing.assert_allclose(value, np.tanh(x @ w).sum(), rtol=1e-5)
    # Shard stays Shard; Replicate is reduced to Replicate; Partial comes back Replicate
    check(ga, g @ w.T, [p if isinstance(p, Shard) else R for p in pa])
    check(gb, x.T @ g, [p if isinstance(p, Shard) else R for p in pb])
    gj = jax.jit(ops.grad(loss, argnums=1))(a, b)
    check(gj, x.T @ g, [p if isinstance(p, Shard) else R for p in pb])
    # Plain jax.grad: a Replicate value is stored once, so its gradient is already torch's (reduced, Replicate);
    # a Partial input's blocks each hold the whole gradient, which only ops.grad relabels Replicate.
    ja, jb = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    for got, want, pl in ((ja, g @ w.T, pa), (jb, x.T @ g, pb)):
        if any(isinstance(p, Partial) for p in pl):
            check(ops.placed_gradient(got, make(np.zeros(want.shape, np.float32), mesh8, pl)), want,
                  [p if isinstance(p, Shard) else R for p in pl])
        else:
            check(got, want, pl)


# --- a 2-layer MLP, column- then row-parallel, against NumPy and the hand-written @spmd version ----------
def test_mlp_forward_backward_vs_numpy_and_spmd(mesh2x4):
    B, D, H, O = 8, 6, 16, 4
    rng = np.random.default_rng(0)
    x, w1, w2, t = (rng.standard_normal(s).astype(np.float32) for s in [(B, D), (D, H), (H, O), (B, O)])
    dx, dt = make(x, mesh2x4, [S(0), R]), make(t, mesh2x4, [S(0), R])
    d1, d2 = make(w1, mesh2x4, [R, S(1)]), make(w2, mesh2x4, [R, S(0)])

    def loss(w1, w2, x, t):  # DTensor ops, global view; the row-parallel output Replicate, as torch's RowwiseParallel
        d = (ops.relu(x @ w1) @ w2).redistribute(placements=[S(0), R]) - t
        return ((d * d).sum() / (B * O)).full_tensor()

    def local(w1, w2, x, t):  # the same, by hand, on each device's blocks
        d = jax.lax.psum(jax.nn.relu(x @ w1) @ w2, "tp") - t
        return jax.lax.psum(jnp.sum(d * d), "dp") / (B * O)

    hand = spmd.spmd(local, mesh2x4, in_placements=([R, S(1)], [R, S(0)], [S(0), R], [S(0), R]), out_placements=[R, R])
    h = np.maximum(x @ w1, 0)
    d = h @ w2 - t
    want = (d * d).mean()
    gy = 2 * d / (B * O)
    g2 = h.T @ gy
    g1 = x.T @ ((gy @ w2.T) * (h > 0))
    for vg in (jax.value_and_grad, ops.value_and_grad):  # plain jax.grad gives torch's gradient placements too
        value, (a, b) = jax.jit(vg(loss, argnums=(0, 1)))(d1, d2, dx, dt)
        np.testing.assert_allclose(value, want, rtol=1e-5)
        check(a, g1, [R, S(1)], tol=1e-5)  # gradients keep the weights' layout (dp all-reduced)
        check(b, g2, [R, S(0)], tol=1e-5)
    np.testing.assert_allclose(hand(w1, w2, x, t), want, rtol=1e-5)
    fwd, fwd_hand = spmd.collectives(loss, d1, d2, dx, dt), spmd.collectives(hand, w1, w2, x, t)
    assert fwd == fwd_hand  # the same collectives: all_reduce of (4, 4) over tp, of the scalar over dp x tp
    assert {k: fwd["all-reduce"][k] for k in ("count", "bytes")} == {"count": 2, "bytes": 4 * 4 * 4 + 4}
    bwd = spmd.collectives(jax.grad(loss, argnums=(0, 1)), d1, d2, dx, dt)
    bwd_hand = spmd.collectives(jax.grad(hand, argnums=(0, 1)), w1, w2, x, t)
    assert bwd == bwd_hand  # backward too: the tp all-reduce's transpose is free, the weights' dp all-reduce
    assert {k: bwd["all-reduce"][k] for k in ("count", "bytes")} == {"count": 2, "bytes": 4 * 4 * 4 + (6 * 4 + 4 * 4) * 4}


def test_square_of_a_partial_follows_torch(mesh2x4):
    """``d * d`` of a Partial(sum) ``d`` is torch's ``P * R -> P`` (one operand reduced, checked against torch
    2.13: 1 collective, Partial(sum)): the forward has the hand-written collectives, and the backward one
    all-reduce more (the reduced operand's gradient, from the unreduced one, is summed over tp)."""
    rng = np.random.default_rng(1)
    h, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    dh, dw = make(h, mesh2x4, [S(0), S(1)]), make(w, mesh2x4, [R, S(0)])

    def loss(w, h):
        d = h @ w
        assert d.placements == (S(0), P())
        return (d * d).sum().full_tensor()

    (strat,) = [s for s in ops.explain(loss, dw, dh, print_out=False) if s.op == "multiply"]
    assert strat.output == (S(0), P()) and [format_placements(p.dst) for p in strat.plans] == ["S(0)P(sum)", "S(0)R"]
    g = jax.grad(loss)(dw, dh)
    check(g, 2 * h.T @ (h @ w), [R, S(0)], tol=1e-4)
    fwd, bwd = spmd.collectives(loss, dw, dh), spmd.collectives(jax.grad(loss), dw, dh)
    assert {k: fwd["all-reduce"][k] for k in ("count", "bytes")} == {"count": 2, "bytes": 4 * 4 * 4 + 4}
    assert bwd["all-reduce"]["bytes"] == 4 * 4 * 4 + 4 * 4 * 4 + 4 * 4 * 4  # fwd (4, 4) block, its transpose, dw over dp


# --- JAX interop ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pl,spec", [([S(0), S(1)], ("dp", "tp")), ([R, S(0)], ("tp", None)),
                                     ([S(0), S(0)], (("dp", "tp"), None)), ([S(1), R], (None, "dp")), ([R, R], ())])
def test_to_jax_and_from_jax(mesh2x4, pl, spec):
    from jax.sharding import NamedSharding, PartitionSpec

    x = data((8, 12), 3)
    d = make(x, mesh2x4, pl)
    a = d.to_jax()
    assert isinstance(a, jax.Array) and a.sharding.is_equivalent_to(NamedSharding(mesh2x4.jax_mesh, PartitionSpec(*spec)), 2)
    np.testing.assert_array_equal(np.asarray(a), x)
    assert sum(v["count"] for v in spmd.collectives(lambda t: t.to_jax(), d).values()) == 0  # blocks stay put
    back = DTensor.from_jax(a, mesh2x4)
    check(back, x, pl)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t: t.to_jax() * 2)(d)), 2 * x)
    b = jax.device_put(x, NamedSharding(mesh2x4.jax_mesh, PartitionSpec(*spec)))
    check(DTensor.from_jax(b, mesh2x4) + 1, x + 1, pl)


def test_partial_sum_is_jax_unreduced(mesh2x4):
    from jax.sharding import NamedSharding, PartitionSpec

    x = data((8, 6), 4)
    d = make(x, mesh2x4, [S(0), P("sum")])  # a non-trivial split over tp
    a = d.to_jax()
    assert a.sharding.spec == PartitionSpec("dp", None, unreduced={"tp"})
    assert sum(v["count"] for v in spmd.collectives(lambda t: t.to_jax(), d).values()) == 0
    reduced = jax.jit(lambda u: jax.sharding.reshard(u, NamedSharding(a.sharding.mesh, PartitionSpec("dp", None))))(a)
    np.testing.assert_array_equal(np.asarray(reduced), x)  # JAX's reshard sums the unreduced values
    back = DTensor.from_jax(a, mesh2x4)
    assert back.placements == (S(0), P("sum"))
    for u, v in zip(back.local_tensors(), d.local_tensors()):  # the very same per-rank partial values
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    check(back, x)


def test_interop_errors(mesh2x4, mesh8):
    from jax.sharding import NamedSharding, PartitionSpec

    with raises(ValueError, "DTensor.to_jax: placements P(max)R hold Partial values other than sums, which a NamedSharding jax.Array cannot (JAX's unreduced is a sum); reduce them first: x.redistribute(placements=[Replicate(), Replicate()]).to_jax()"):
        make(data((4, 4)), mesh2x4, [P("max"), R]).to_jax()
    with raises(ValueError, "DTensor.to_jax: dim 0 of shape (5, 3) is cut into 8 uneven shards by S(0); a NamedSharding needs even ones"):
        make(data((5, 3)), mesh8, [S(0)]).to_jax()
    with raises(TypeError, "DTensor.from_jax: arr=array("):
        DTensor.from_jax(data((4, 4)), mesh8)
    swapped = jax.device_put(data((8, 4)), NamedSharding(mesh2x4.jax_mesh, PartitionSpec(("tp", "dp"))))
    with raises(ValueError, "DTensor.from_jax: dim 0 is sharded over ('tp', 'dp') (minor mesh dim first)"):
        DTensor.from_jax(swapped, mesh2x4)


def test_op_results_feed_spmd_with_their_placements(mesh2x4):
    x = data((8, 8), 5)
    d = ops.exp(make(x, mesh2x4, [S(0), S(1)]) / 10)  # a DTensor op result, placed S(0)S(1)
    total = spmd.spmd(lambda a: jax.lax.psum(a.sum(), ("dp", "tp")), mesh2x4, out_placements=[R, R])
    np.testing.assert_allclose(total(d), np.exp(x / 10).sum(), rtol=1e-5)  # in_placements taken from the DTensor
    blocks = spmd.spmd(lambda a: a * 2, mesh2x4, out_placements=[S(0), S(1)])(d)
    np.testing.assert_allclose(np.asarray(blocks), 2 * np.exp(x / 10), rtol=1e-5)
