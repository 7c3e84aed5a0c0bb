"""Every collective x every op it accepts x dtype x group, against a NumPy reference.

Inputs are per rank: a global array of shape ``mesh.shape + block`` holds one
block per rank (``X[i, j]`` is the block of the rank at coordinate ``(i, j)``).
The reference computes each rank's result from the blocks of its group's
members, ranked row-major over the group's mesh dims in the order given.

Both forms run: the functional collectives inside ``@spmd`` (all cases of one
group and dtype share ONE compiled program), and the eager ``ProcessGroup``.
Data are small integers, so float sums, products (of +-1, +-2) and means over
2, 4 or 8 ranks are exact, in bfloat16 too (compared via float32).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd import ReduceOp, Shard, init_device_mesh

BLOCK = (8, 8)  # every rank's block: divisible by every group size (2, 4, 8)
FLOAT_FACTOR, INT_FACTOR = 0.5, 3

_MESHES = {
    "x8": ((8,), ("x",)),
    "2x4": ((2, 4), ("dp", "tp")),
}
GROUPS = [("x8", "x"), ("2x4", "dp"), ("2x4", "tp"), ("2x4", ("dp", "tp")), ("2x4", ("tp", "dp"))]
GROUP_IDS = ["x8:x", "2x4:dp", "2x4:tp", "2x4:dp,tp", "2x4:tp,dp"]
DTYPES = ["float32", "bfloat16", "int32", "bool"]

OPS = {
    "float": ["sum", "avg", "product", "min", "max", "premul_sum"],
    "int": ["sum", "product", "min", "max", "band", "bor", "bxor", "premul_sum"],
    "bool": ["sum", "product", "min", "max", "band", "bor", "bxor"],
}


@functools.lru_cache(maxsize=None)
def _mesh(key):
    shape, names = _MESHES[key]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _kind(dtype: str) -> str:
    return {"float32": "float", "bfloat16": "float", "int32": "int", "bool": "bool"}[dtype]


def _op(name: str, kind: str):
    if name == "premul_sum":
        return ReduceOp.PREMUL_SUM(FLOAT_FACTOR if kind == "float" else INT_FACTOR)
    return name


# Data movement does not depend on the dtype: bfloat16 and bool run one case of each of these.
_THIN = {"broadcast-src1", "all_gather-axis1-tiledFalse", "all_gather-axis2-tiledFalse", "all_gather-axis-1-tiledFalse",
         "all_gather-axis0-tiledTrue", "scatter-src0", "gather-dst0", "all_to_all-00", "all_to_all-11",
         "permute-one", "permute-swap"}


def _variants(kind: str, dtype: str = "") -> list[tuple[str, str, dict]]:
    """(case id, collective, kwargs); 'last' stands for the group's last rank."""
    v = []
    for op in OPS[kind]:
        v.append((f"all_reduce-{op}", "all_reduce", {"op": op}))
        v.append((f"reduce_scatter-{op}", "reduce_scatter", {"op": op, "scatter_dim": 0}))
        v.append((f"reduce-{op}", "reduce", {"dst": "last", "op": op}))
    v.append(("reduce_scatter-max-dim1", "reduce_scatter", {"op": "max", "scatter_dim": 1}))
    v.append(("reduce-max-dst0", "reduce", {"dst": 0, "op": "max"}))
    if kind != "bool":
        v.append(("reduce_scatter-sum-dim1", "reduce_scatter", {"op": "sum", "scatter_dim": 1}))
    v += [(f"broadcast-src{s}", "broadcast", {"src": s}) for s in (0, 1, "last")]
    v += [(f"all_gather-axis{a}-tiled{t}", "all_gather", {"axis": a, "tiled": t})
          for a, t in [(0, False), (1, False), (2, False), (-1, False), (0, True), (1, True)]]
    v += [(f"scatter-src{s}", "scatter", {"src": s}) for s in (0, "last")]
    v += [(f"gather-dst{d}", "gather", {"dst": d}) for d in (0, "last")]
    v += [(f"all_to_all-{s}{c}", "all_to_all", {"split_axis": s, "concat_axis": c})
          for s, c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    v += [("permute-shift", "permute", {"pairs": "shift"}), ("permute-one", "permute", {"pairs": "one"}),
          ("permute-swap", "permute", {"pairs": "swap"})]
    v.append(("axis_index", "axis_index", {}))
    if dtype in ("bfloat16", "bool"):
        v = [c for c in v if c[0] not in _THIN]
    return v


def _resolve(kw: dict, n: int, kind: str) -> dict:
    out = {}
    for k, val in kw.items():
        if val == "last":
            val = n - 1
        if k == "op":
            val = _op(val, kind)
        if k == "pairs":
            val = {"shift": tuple((i, (i + 1) % n) for i in range(n)),
                   "one": ((0, n - 1),),
                   "swap": ((0, 1), (1, 0))}[val]
        out[k] = val
    return out


# --- the NumPy reference -----------------------------------------------------------------
def _members(mesh_shape, names, group):
    """For each rank coordinate: (its group's member coords in group-rank order, its group rank)."""
    group = (group,) if isinstance(group, str) else tuple(group)
    gd = [names.index(g) for g in group]
    table = {}
    for coord in np.ndindex(*mesh_shape):
        mem = []
        for gc in itertools.product(*(range(mesh_shape[d]) for d in gd)):
            c = list(coord)
            for d, val in zip(gd, gc):
                c[d] = val
            mem.append(tuple(c))
        table[coord] = (mem, mem.index(coord))
    return table


def _np_reduce(a: np.ndarray, op) -> np.ndarray:
    """Reduce stacked contributions ``a`` (ranks on axis 0) as torch does."""
    name, factor = (op.name, op.factor) if isinstance(op, ReduceOp) else (op, None)
    if a.dtype == np.bool_:  # torch (NCCL): SUM -> or, PRODUCT -> and
        name = {"sum": "bor", "product": "band", "max": "bor", "min": "band"}.get(name, name)
    if name == "sum":
        return a.sum(0, dtype=a.dtype)
    if name == "avg":
        return a.mean(0, dtype=a.dtype)
    if name == "premul_sum":
        return (a * a.dtype.type(factor)).sum(0, dtype=a.dtype)
    if name == "product":
        return a.prod(0, dtype=a.dtype)
    if name in ("max", "min"):
        return getattr(a, name)(0)
    return {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[name].reduce(a, 0)


def reference(coll: str, X: np.ndarray, mesh_shape, names, group, kw: dict) -> np.ndarray:
    """Each rank's result, stacked back to ``mesh_shape + result block``."""
    table = _members(mesh_shape, names, group)
    out = {}
    for coord, (mem, i) in table.items():
        n = len(mem)
        blocks = [X[c] for c in mem]
        if coll == "all_reduce":
            r = _np_reduce(np.stack(blocks), kw["op"])
        elif coll == "broadcast":
            r = blocks[kw["src"]]
        elif coll == "all_gather":
            r = np.concatenate(blocks, kw["axis"]) if kw["tiled"] else np.stack(blocks, kw["axis"])
        elif coll == "reduce":
            r = _np_reduce(np.stack(blocks), kw["op"]) if i == kw["dst"] else X[coord]
        elif coll == "scatter":
            r = blocks[kw["src"]][:n][i]
        elif coll == "gather":
            g = np.stack(blocks)
            r = g if i == kw["dst"] else np.zeros_like(g)
        elif coll == "reduce_scatter":
            r = np.split(_np_reduce(np.stack(blocks), kw["op"]), n, axis=kw["scatter_dim"])[i]
        elif coll == "all_to_all":
            r = np.concatenate([np.split(b, n, axis=kw["split_axis"])[i] for b in blocks], axis=kw["concat_axis"])
        elif coll == "permute":
            src_of = {d: s for s, d in kw["pairs"]}
            r = blocks[src_of[i]] if i in src_of else np.zeros_like(X[coord])
        elif coll == "axis_index":
            r = np.asarray(i, np.int32)
        else:
            raise AssertionError(coll)
        out[coord] = r
    return np.stack([out[c] for c in np.ndindex(*mesh_shape)]).reshape(tuple(mesh_shape) + r.shape)


def _data(mesh_shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Per-rank blocks in the reference's dtype (float32 stands in for bfloat16)."""
    rng = np.random.default_rng(seed)
    shape = tuple(mesh_shape) + BLOCK
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "int32":
        return rng.integers(-100, 100, shape).astype(np.int32)
    return rng.choice(np.array([-2, -1, 1, 2], np.float32), shape)


def _as_input(X: np.ndarray, dtype: str):
    return jnp.asarray(X, dtype=getattr(jnp, dtype) if dtype != "bool" else jnp.bool_)


def _check(got, want: np.ndarray, dtype: str, case: str) -> None:
    """Same shape, same dtype (bfloat16 results against a float32 reference), same values."""
    got = np.asarray(got)
    if dtype == "bfloat16":
        assert got.dtype == jnp.bfloat16, (case, got.dtype)
        got, want = got.astype(np.float32), want.astype(np.float32)
    assert got.dtype == want.dtype, (case, got.dtype, want.dtype)
    assert got.shape == want.shape, (case, got.shape, want.shape)
    np.testing.assert_array_equal(got, want, err_msg=case)


# --- functional form, inside @spmd: one program per (group, dtype) -----------------------
@functools.lru_cache(maxsize=None)
def _functional_results(mesh_key: str, group, dtype: str):
    mesh = _mesh(mesh_key)
    kind = _kind(dtype)
    n = int(np.prod([mesh.size(g) for g in ((group,) if isinstance(group, str) else group)]))
    cases = [(cid, coll, _resolve(kw, n, kind)) for cid, coll, kw in _variants(kind, dtype)]
    # Per-rank layout: mesh dim i shards the array's axis i, so each rank sees its block.
    layout = [Shard(i) for i in range(mesh.ndim)]

    @spmd.spmd(mesh, in_placements=layout, out_placements=layout)
    def run(block):
        x = block.reshape(BLOCK)
        res = {}
        for cid, coll, kw in cases:
            arg = x[:n] if coll == "scatter" else x
            fn = getattr(spmd, coll)
            y = fn(group=group, **kw) if coll == "axis_index" else fn(arg, group=group, **kw)
            res[cid] = jnp.asarray(y).reshape((1,) * mesh.ndim + jnp.shape(y))
        return res

    X = _data(mesh.shape, dtype)
    got = run(_as_input(X, dtype))
    return X, cases, jax.device_get(got)


def _functional_params():
    for (mesh_key, group), gid in zip(GROUPS, GROUP_IDS):
        for dtype in DTYPES:
            for cid, _, _ in _variants(_kind(dtype), dtype):
                yield pytest.param(mesh_key, group, dtype, cid, id=f"{gid}-{dtype}-{cid}")


@pytest.mark.parametrize("mesh_key, group, dtype, cid", list(_functional_params()))
def test_functional(mesh_key, group, dtype, cid):
    X, cases, got = _functional_results(mesh_key, group, dtype)
    mesh = _mesh(mesh_key)
    (coll, kw), = [(coll, kw) for c, coll, kw in cases if c == cid]
    want = reference(coll, X, mesh.shape, mesh.mesh_dim_names, group, kw)
    if coll == "axis_index":
        _check(got[cid], want, "int32", cid)
    else:
        _check(got[cid], want, dtype, cid)


# --- eager ProcessGroup ------------------------------------------------------------------
_EAGER_METHOD = {
    "all_reduce": "allreduce", "broadcast": "broadcast", "all_gather": "all_gather", "reduce": "reduce",
    "scatter": "scatter", "gather": "gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all",
}


def _eager_variants(kind: str, full: bool):
    for cid, coll, kw in _variants(kind):
        if coll not in _EAGER_METHOD:
            continue
        if coll == "all_gather" and kw != {"axis": 0, "tiled": False}:
            continue  # the eager method is torch's: a new leading axis
        if full:
            if coll == "all_reduce":
                yield cid, coll, kw
            continue
        if "op" in kw and kw["op"] not in ("sum", "max"):
            continue
        if cid in ("broadcast-src1", "all_to_all-00", "all_to_all-11"):
            continue
        yield cid, coll, kw


def _eager_params():
    # The eager methods run the functional collectives above (swept fully there): every method on
    # every group in float32, and every all_reduce op in the other dtypes on the flattened group.
    for (mesh_key, group), gid in zip(GROUPS, GROUP_IDS):
        for cid, _, _ in _eager_variants("float", False):
            yield pytest.param(mesh_key, group, "float32", cid, id=f"{gid}-float32-{cid}")
        if gid == "2x4:tp,dp":
            for dtype in ["bfloat16", "int32", "bool"]:
                for cid, _, _ in _eager_variants(_kind(dtype), True):
                    yield pytest.param(mesh_key, group, dtype, cid, id=f"{gid}-{dtype}-{cid}")


@pytest.mark.parametrize("mesh_key, group, dtype, cid", list(_eager_params()))
def test_eager(mesh_key, group, dtype, cid):
    mesh = _mesh(mesh_key)
    pg = mesh.get_group(group)
    n = pg.size
    (coll, kw), = [(coll, _resolve(kw, n, _kind(dtype))) for c, coll, kw in _variants(_kind(dtype)) if c == cid]
    X = _data(mesh.shape, dtype, seed=1)
    t = X[(slice(None),) * mesh.ndim + (slice(0, n),)] if coll == "scatter" else X
    args = {k: v for k, v in kw.items() if k not in ("axis", "tiled")}
    got = getattr(pg, _EAGER_METHOD[coll])(_as_input(t, dtype), **args)
    want = reference(coll, X, mesh.shape, mesh.mesh_dim_names, group, kw)
    _check(got, want, dtype, cid)


def test_eager_accepts_numpy_and_lists(mesh2x4):
    pg = mesh2x4.get_group("tp")
    got = pg.allreduce(np.arange(8, dtype=np.int32).reshape(2, 4))
    np.testing.assert_array_equal(got, [[6] * 4, [22] * 4])
    assert pg.size == 4
    np.testing.assert_array_equal(mesh2x4.get_group("dp").allreduce([[1, 2, 3, 4], [10, 20, 30, 40]]),
                                  [[11, 22, 33, 44]] * 2)


# --- groups given other ways -------------------------------------------------------------
def test_group_forms(mesh2x4):
    """group=None is every mesh dim; an int is a mesh dim; a ProcessGroup is its dims."""
    names = ("dp", "tp")
    pg = mesh2x4.get_group("tp")

    def body(block):
        x = block.reshape(BLOCK)
        return tuple(y.reshape((1, 1) + y.shape) for y in (
            spmd.all_reduce(x), spmd.all_reduce(x, group=1), spmd.all_reduce(x, group=pg),
            spmd.all_reduce(x, "max", group=[0]), spmd.all_gather(x, group=-1),
            jnp.reshape(spmd.axis_index(), ()), jnp.reshape(spmd.axis_index(pg), ())))

    f = jax.jit(jax.shard_map(body, mesh=mesh2x4.jax_mesh, in_specs=P(*names), out_specs=P(*names)))
    X = _data((2, 4), "int32", seed=3)
    got = f(X)
    ref = functools.partial(reference, X=X, mesh_shape=(2, 4), names=names)
    np.testing.assert_array_equal(got[0], ref("all_reduce", group=names, kw={"op": "sum"}))
    np.testing.assert_array_equal(got[1], ref("all_reduce", group="tp", kw={"op": "sum"}))
    np.testing.assert_array_equal(got[2], ref("all_reduce", group="tp", kw={"op": "sum"}))
    np.testing.assert_array_equal(got[3], ref("all_reduce", group="dp", kw={"op": "max"}))
    np.testing.assert_array_equal(got[4], ref("all_gather", group="tp", kw={"axis": 0, "tiled": False}))
    np.testing.assert_array_equal(got[5], np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(got[6], np.tile(np.arange(4), (2, 1)))


def test_replicated_input_contributes_once_per_rank(mesh8):
    """As in torch, a value every rank holds (in_specs P()) is reduced over all its copies."""

    def body(x):
        return (spmd.all_reduce(x, group="x"), spmd.all_reduce(x, "avg", group="x"),
                spmd.all_gather(x, group="x"), spmd.broadcast(x, 3, group="x"))

    x = jnp.arange(3.0)
    f = jax.jit(jax.shard_map(body, mesh=mesh8.jax_mesh, in_specs=P(), out_specs=(P(), P(), P(), P())))
    s, a, g, b = f(x)
    np.testing.assert_array_equal(s, 8 * np.arange(3.0))
    np.testing.assert_array_equal(a, np.arange(3.0))
    np.testing.assert_array_equal(g, np.tile(np.arange(3.0), (8, 1)))
    np.testing.assert_array_equal(b, np.arange(3.0))


def test_broadcast_is_bit_exact(mesh8):
    """NaN payloads, -0.0 and inf survive a broadcast (a masked bit sum, not a float sum)."""
    vals = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], np.float32)
    X = np.stack([np.full(6, i, np.float32) for i in range(8)])
    X[5] = vals
    f = jax.jit(jax.shard_map(lambda b: spmd.broadcast(b, 5, group="x"), mesh=mesh8.jax_mesh,
                              in_specs=P("x"), out_specs=P("x")))
    got = np.asarray(f(X.reshape(8, 6))).reshape(8, 6)
    assert (got.view(np.uint32) == np.tile(vals.view(np.uint32), (8, 1))).all()


# --- gradients ---------------------------------------------------------------------------
GRAD_GROUPS = [("2x4", "tp"), ("2x4", ("tp", "dp")), ("x8", "x")]
# (case id, collective, kwargs, its transpose, the transpose's kwargs, scale of the transpose)
GRAD_CASES = [
    ("all_reduce-sum", "all_reduce", {"op": "sum"}, "all_reduce", {"op": "sum"}, 1),
    ("all_reduce-avg", "all_reduce", {"op": "avg"}, "all_reduce", {"op": "avg"}, 1),
    ("all_reduce-premul", "all_reduce", {"op": ReduceOp.PREMUL_SUM(0.5)}, "all_reduce",
     {"op": ReduceOp.PREMUL_SUM(0.5)}, 1),
    ("all_gather-0-tiled", "all_gather", {"axis": 0, "tiled": True}, "reduce_scatter", {"op": "sum", "scatter_dim": 0}, 1),
    ("all_gather-1-tiled", "all_gather", {"axis": 1, "tiled": True}, "reduce_scatter", {"op": "sum", "scatter_dim": 1}, 1),
    ("reduce_scatter-sum-0", "reduce_scatter", {"op": "sum", "scatter_dim": 0}, "all_gather", {"axis": 0, "tiled": True}, 1),
    ("reduce_scatter-avg-1", "reduce_scatter", {"op": "avg", "scatter_dim": 1}, "all_gather", {"axis": 1, "tiled": True},
     "1/n"),
    ("all_to_all-01", "all_to_all", {"split_axis": 0, "concat_axis": 1}, "all_to_all", {"split_axis": 1, "concat_axis": 0}, 1),
    ("all_to_all-11", "all_to_all", {"split_axis": 1, "concat_axis": 1}, "all_to_all", {"split_axis": 1, "concat_axis": 1}, 1),
]


@functools.lru_cache(maxsize=None)
def _grad_results(mesh_key: str, group):
    """One program per group: every case gets its own input, and jax.grad gives each its gradient."""
    mesh = _mesh(mesh_key)
    names = mesh.mesh_dim_names
    nd = mesh.ndim
    ref = functools.partial(reference, mesh_shape=mesh.shape, names=names, group=group)

    def body(blocks):
        out = {}
        for cid, coll, kw, *_ in GRAD_CASES:
            y = getattr(spmd, coll)(blocks[cid].reshape(BLOCK), group=group, **kw)
            out[cid] = y.reshape((1,) * nd + y.shape)
        return out

    f = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=P(*names), out_specs=P(*names))
    rng = np.random.default_rng(5)
    X, W = {}, {}
    for cid, coll, kw, *_ in GRAD_CASES:
        X[cid] = _data(mesh.shape, "float32", seed=len(X))
        # A random cotangent of the output's shape, different on every rank.
        W[cid] = rng.choice(np.array([-2, -1, 1, 2], np.float32), ref(coll, X=X[cid], kw=kw).shape)

    def loss(xs):
        ys = f(xs)
        return sum(jnp.sum(jnp.asarray(W[c]) * ys[c]) for c in ys), ys

    grads, ys = jax.jit(jax.grad(loss, has_aux=True))(X)
    return ref, X, W, jax.device_get(ys), jax.device_get(grads)


@pytest.mark.parametrize("cid", [c[0] for c in GRAD_CASES])
@pytest.mark.parametrize("mesh_key, group", GRAD_GROUPS, ids=["2x4:tp", "2x4:tp,dp", "x8:x"])
def test_gradient_is_the_analytic_transpose(mesh_key, group, cid):
    """d/dX sum(W * coll(X)) == transpose(W), the transpose computed by the reference on W."""
    ref, X, W, ys, grads = _grad_results(mesh_key, group)
    (coll, kw, transpose, tkw, scale), = [c[1:] for c in GRAD_CASES if c[0] == cid]
    np.testing.assert_array_equal(ys[cid], ref(coll, X=X[cid], kw=kw))
    want = ref(transpose, X=W[cid], kw=tkw)
    if scale == "1/n":
        want = want / _mesh(mesh_key).get_group(group).size
    np.testing.assert_allclose(grads[cid], want, rtol=1e-6, atol=1e-6)


def test_gradient_finite_differences(mesh2x4):
    """A nonlinear loss through all_reduce, all_gather, reduce_scatter and all_to_all: jax.grad vs
    central differences."""
    names = ("dp", "tp")

    def body(block):
        x = block.reshape(4, 4)
        a = spmd.all_reduce(jnp.sin(x), "avg", group="tp")
        b = spmd.all_gather(a * x, axis=0, tiled=True, group="dp")
        c = spmd.reduce_scatter(b ** 2, "sum", scatter_dim=1, group=("tp",))
        d = spmd.all_to_all(c, 0, 1, group="tp")
        return spmd.all_reduce(jnp.sum(d * jnp.cos(d)), group=("dp", "tp"))

    f = jax.jit(jax.shard_map(body, mesh=mesh2x4.jax_mesh, in_specs=P(*names), out_specs=P()))
    x0 = np.random.default_rng(7).normal(size=(2, 4, 4, 4))
    x0 = jnp.asarray(x0, jnp.float32)
    g = np.asarray(jax.grad(f)(x0))
    rng = np.random.default_rng(8)
    eps = 1e-2
    for _ in range(4):
        v = jnp.asarray(rng.normal(size=x0.shape), jnp.float32)
        fd = (f(x0 + eps * v) - f(x0 - eps * v)) / (2 * eps)
        np.testing.assert_allclose(np.sum(g * np.asarray(v)), fd, rtol=2e-2, atol=2e-2)


# --- NaN through MAX/MIN, AVG of narrow floats (issue 10.5, 10.6) ------------------------------------
def _nan_blocks(dtype):
    """8 ranks of 4 values: col 0 NaN on every rank, col 1 NaN on rank 3 only, col 2 finite, col 3 -inf/-0.0 mix."""
    x = np.arange(32, dtype=np.float32).reshape(8, 4) - 10
    x[:, 0] = np.nan
    x[3, 1] = np.nan
    x[:, 3] = -0.0
    x[5, 3] = -np.inf
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_propagate_nan_as_numpy(mesh8, dtype, op):
    x = _nan_blocks(jnp.dtype(dtype))
    want = getattr(np, op)(x.astype(np.float32), axis=0)  # NumPy: NaN wins
    f = spmd.spmd(lambda b: spmd.all_reduce(b, op, group="x"), mesh8, in_placements=Shard(0), out_placements=Shard(0))
    got_region = np.asarray(f(x.reshape(8, 1, 4))).astype(np.float32)
    got_pg = np.asarray(mesh8.get_group().allreduce(x, op)).astype(np.float32)
    for got in (got_region.reshape(8, 4), got_pg):
        for r in range(8):
            np.testing.assert_array_equal(got[r], want, err_msg=f"{op} {dtype} rank {r}")
    if op == "min":  # -inf wins over -0.0; NaN columns come back as NaN, not +-inf
        assert np.isneginf(got_pg[0, 3]) and np.isnan(got_pg[0, :2]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_avg_of_narrow_floats_does_not_overflow(mesh8, dtype):
    """Every rank holds a value whose 8-rank sum overflows the dtype, its mean does not: pre-divided
    (as NCCL's floating AVG), the mean comes back exact; PREMUL_SUM(1/8) too."""
    big = {"float16": 16376.0, "bfloat16": 3.0e38}[dtype]
    x = np.full((8, 2, 8), big, jnp.dtype(dtype))
    want = np.full((2, 8), big, jnp.dtype(dtype))
    pg = mesh8.get_group()
    for got in (pg.allreduce(x, "avg"), pg.allreduce(x, ReduceOp.PREMUL_SUM(1 / 8))):
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32), np.broadcast_to(want, (8, 2, 8)).astype(np.float32))
    rs = np.asarray(pg.reduce_scatter(x, "avg", scatter_dim=1)).astype(np.float32)
    np.testing.assert_array_equal(rs, np.full((8, 2, 1), want[0, 0], np.float32))
