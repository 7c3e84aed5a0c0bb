"""Fuzz the public in-process API with random arguments, good and bad.

Every argument is drawn from one of two pools: values the parameter accepts,
and values it must refuse. A call whose arguments all come from the good pools
must run (and give the right value where that is cheap to know); a call with at
least one bad argument must raise a ``TypeError`` or ``ValueError`` that this
project raises: the raising frame is in ``spmd``/``placements`` and the message
starts with the public name that was called. Never a raw JAX/NumPy/XLA error,
and never a silent result.

Bounded: fixed ``max_examples``, derandomized (the same examples every run), no
example database; about 20-30 s in all.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd
from spmd import DeviceMesh, DTensor, Partial, ReduceOp, Replicate, Shard, distribute_tensor, init_device_mesh

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
PROJECT = ("spmd", "placements")
R = Replicate()


@pytest.fixture(scope="module")
def meshes():
    return {1: init_device_mesh("cpu", (4,), mesh_dim_names=("x",)),
            2: init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))}


# --- the oracle ---------------------------------------------------------------------------------
def _raising_module(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__", "?")


def outcome(call, bad: list[str], names: tuple[str, ...]):
    """Run ``call``. ``bad`` lists the bad arguments drawn (empty: every argument is good);
    ``names`` are the public names a message may start with. Returns the result of a good call."""
    try:
        result = call()
    except (TypeError, ValueError) as e:
        if not bad:
            raise AssertionError(f"good arguments refused: {type(e).__name__}: {e}") from e
        module = _raising_module(e)
        assert module.split(".")[0] in PROJECT, f"{type(e).__name__} raised in {module}, not by the project: {e}"
        head = re.match(r"([\w.]+): ", str(e))
        assert head and head.group(1) in names, f"the message does not start with one of {names}: {e}"
        return None
    assert not bad, f"bad {bad} accepted silently"
    return result


class Args:
    """Draws a call's arguments: at most one of them (``fault``, drawn first; None for none) comes
    from its bad pool, so that the error it must raise has one cause."""

    def __init__(self, data, names):
        self.data, self.fault, self.bad = data, data.draw(st.sampled_from((None, *names))), []

    def __call__(self, name: str, good, bad):
        if name != self.fault:
            return self.data.draw(good)
        self.bad.append(name)
        return self.data.draw(bad)


def pick(*values):
    return st.sampled_from(values)


# Wrong kinds of value, for any argument that takes something else.
JUNK = (None, 1.5, "x", b"x", {"a": 1}, object(), 1j, float("nan"), [object()])
NOT_ARRAYS = (None, "abc", b"ab", np.array(["a", "b"]), np.array([object(), object()]), [[1.0, 2.0], [3.0]],
              {"a": 1}, np.zeros(2, "datetime64[s]"))


# --- placements -------------------------------------------------------------------------------------
PARTIAL_OK = ("sum", "avg", "max", "min", "product", "SUM", "Max", ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN)
PARTIAL_BAD = ("mean", "band", "bxor", "premul_sum", ReduceOp.BOR, ReduceOp.PREMUL_SUM(2.0), 3, True, ["sum"]) + JUNK


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_fuzz_placement_constructors(data):
    kind = data.draw(pick("Shard", "Partial", "Replicate", "PREMUL_SUM"))
    a = Args(data, [kind])
    if kind == "Shard":
        v = a(kind, st.integers(-5, 5), pick(True, False, 0.0, "0", [0], (0,), *JUNK))
        got = outcome(lambda: Shard(v), a.bad, ("Shard",))
        assert a.bad or (got.dim == v and str(got) == f"S({v})")
    elif kind == "Partial":
        v = a(kind, pick(*PARTIAL_OK), pick(*PARTIAL_BAD))
        got = outcome(lambda: Partial(v), a.bad, ("Partial",))
        assert a.bad or got.reduce_op == (v.name if isinstance(v, ReduceOp) else v.lower())
    elif kind == "Replicate":
        args = a(kind, st.just(()), st.lists(pick(0, 1, -1, "x", None, Shard(0)), min_size=1, max_size=2).map(tuple))
        got = outcome(lambda: Replicate(*args), a.bad, ("Replicate",))
        assert a.bad or got == R
    else:
        v = a(kind, pick(0.5, 2, -1.0, 0), pick("2", None, [1.0], True, 1j, b"1"))
        got = outcome(lambda: ReduceOp.PREMUL_SUM(v), a.bad, ("ReduceOp.PREMUL_SUM",))
        assert a.bad or got.factor == v


# --- meshes -------------------------------------------------------------------------------------------
GOOD_SHAPES = ((8,), (2, 4), (4, 2), (2, 2, 2), (1,), (3,), (1, 8), [2, 4])
BAD_SHAPES = ((16,), (3, 3), (0,), (), (-2,), (2.0,), "2x4", None, (True,), ((2,),), (2, None))
GOOD_IDS = st.sampled_from([(1,), (4,), (2, 2), (2, 4), (8,), (2, 2, 2)]).flatmap(
    lambda s: st.permutations(range(8)).map(lambda p: np.array(p[: int(np.prod(s))]).reshape(s).tolist()))
BAD_IDS = ([[0, 1], [2]], [[0, 1], [2, 3, 4]], [0, 0], [0, 8], [-1, 0], [0.5, 1.0], [["a", "b"]], None, [], [[]],
           3, "01", [0, None], [[0, 1], [2, 2]], np.array([0.0, 1.0]))


def _names(a: Args, ndim: int):
    good = pick(None, tuple(f"d{i}" for i in range(ndim)), [f"n{i}" for i in range(ndim)])
    bad = pick(tuple(f"d{i}" for i in range(ndim + 1)), ("a",) * max(ndim, 2), (1,) * ndim, ("",) * ndim, "d0", 7)
    return a("mesh_dim_names", good, bad)


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_fuzz_meshes(data):
    if data.draw(st.booleans()):
        a = Args(data, ["device_type", "mesh_shape", "mesh_dim_names"])
        device_type = a("device_type", pick("cpu"), pick("xpu", "", 0, None, ["cpu"], b"cpu"))
        shape = a("mesh_shape", pick(*GOOD_SHAPES), pick(*BAD_SHAPES))
        names = _names(a, len(shape) if isinstance(shape, (tuple, list)) else 1)
        got = outcome(lambda: init_device_mesh(device_type, shape, mesh_dim_names=names), a.bad, ("init_device_mesh",))
        assert a.bad or (got.shape == tuple(shape) and got.size() == int(np.prod(shape)))
        return
    a = Args(data, ["device_type", "mesh", "mesh_dim_names"])
    device_type = a("device_type", pick("cpu"), pick("xpu", "", 0, None, ["cpu"], b"cpu"))
    ids = a("mesh", GOOD_IDS, pick(*BAD_IDS))
    names = _names(a, 1 if a.fault == "mesh" else np.ndim(ids))
    got = outcome(lambda: DeviceMesh(device_type, ids, mesh_dim_names=names), a.bad, ("DeviceMesh",))
    assert a.bad or np.vectorize(lambda d: d.id)(got.devices).tolist() == ids


@settings(max_examples=100, **SETTINGS)
@given(st.data())
def test_fuzz_mesh_lookups(meshes, data):
    """mesh[dims], mesh.get_group(dims), mesh.size(dims) on a (dp=2, tp=4) mesh."""
    mesh = meshes[2]
    method = data.draw(pick("__getitem__", "get_group", "size"))
    a = Args(data, ["dims"])
    sizes = {"dp": 2, "tp": 4, 0: 2, 1: 4, -1: 4, -2: 2}
    good = pick("dp", "tp", 0, 1, -1, -2, ("tp", "dp"), ["dp"], (0, 1), *(() if method == "__getitem__" else (None,)))
    dims = a("dims", good, pick("pp", 2, -3, ("dp", "dp"), (), 1.5, True, object(), b"dp", ("dp", "pp"), [0, 2]))
    got = outcome(lambda: getattr(mesh, method)(dims), a.bad, (f"DeviceMesh.{method}",))
    if got is None:
        return
    items = (dims,) if isinstance(dims, (str, int)) else ("dp", "tp") if dims is None else tuple(dims)
    n = int(np.prod([sizes[d] for d in items]))
    assert (got if method == "size" else got.size if method == "get_group" else got.size()) == n


# --- collectives inside @spmd -----------------------------------------------------------------------
BLOCK = (8, 8)  # every rank's block: both dims divisible by every group size (2, 4, 8)
GROUPS_OK = {None: 8, "dp": 2, "tp": 4, 0: 2, 1: 4, -1: 4, ("dp", "tp"): 8, ("tp", "dp"): 8, ("tp",): 4}
GROUPS_BAD = ("pp", 2, -3, ("tp", "tp"), (), 1.5, True, ("dp", "pp"), object(), b"dp")
DTYPES = ("float32", "int32", "bool", "complex64")
OPS_OK = {
    "float32": ("sum", "avg", "product", "min", "max", ReduceOp.PREMUL_SUM(0.5), "SUM", ReduceOp.MAX),
    "int32": ("sum", "product", "min", "max", "band", "bor", "bxor", ReduceOp.PREMUL_SUM(2)),
    "bool": ("sum", "product", "min", "max", "band", "bor", "bxor"),
    "complex64": ("sum", "avg", "product", ReduceOp.PREMUL_SUM(0.5)),
}
OPS_BAD = {  # ops the dtype does not allow, then ops that are no op at all
    "float32": ("band", "bor", "bxor"),
    "int32": ("avg", ReduceOp.PREMUL_SUM(0.5)),
    "bool": ("avg", ReduceOp.PREMUL_SUM(2)),
    "complex64": ("max", "min", "band", ReduceOp.MIN),
}
OPS_JUNK = ("mean", "premul_sum", 1, None, ["sum"], 1.5)
# The arguments each collective takes besides the input and the group.
ARGS = {"all_reduce": ("op",), "broadcast": ("src",), "all_gather": ("tiled", "axis"), "reduce": ("dst", "op"),
        "scatter": ("src",), "gather": ("dst",), "reduce_scatter": ("op", "scatter_dim"),
        "all_to_all": ("split_axis", "concat_axis"), "permute": ("pairs",), "axis_index": ()}


def _collective_kwargs(a: Args, coll: str, n: int, dtype: str) -> dict:
    """Keyword arguments of ``coll`` for a group of ``n`` ranks and an input of rank 2."""
    kw = {}
    for name in ARGS[coll]:
        if name == "op":
            kw[name] = a(name, pick(*OPS_OK[dtype]), pick(*OPS_BAD[dtype], *OPS_JUNK))
        elif name in ("src", "dst"):
            kw[name] = a(name, st.integers(0, n - 1) | st.integers(0, n - 1).map(np.int64),
                         pick(n, n + 3, -1, 1.0, "0", None, True, [0], np.float32(0)))
        elif name == "tiled":
            kw[name] = a(name, pick(True, False), pick("yes", None, 1))
        elif name == "pairs":
            good = st.permutations(range(n)).flatmap(
                lambda p: st.integers(1, n).map(lambda k: [(i, p[i]) for i in range(k)]))
            twice = [(0, 1), (2, 1)] if n > 2 else [(0, 1), (1, 1)]
            kw[name] = a(name, good, pick([(0, 1, 0)], [(0, n)], twice, 3, "ab", [(0.5, 1)], [0, 1], None))
        else:  # an axis of the input (all_gather's may also be the new one)
            ndim = 3 if name == "axis" and kw.get("tiled") is False else 2
            kw[name] = a(name, st.integers(-ndim, ndim - 1), pick(ndim, -ndim - 1, 1.5, "0", None, True))
    return kw


@settings(max_examples=80, **SETTINGS)
@given(st.data())
def test_fuzz_collectives_in_spmd(meshes, data):
    mesh = meshes[2]
    coll = data.draw(pick(*ARGS))
    dtype = data.draw(pick(*DTYPES))
    a = Args(data, ["group", *(() if coll == "axis_index" else ("x",)), *ARGS[coll]])
    group = a("group", pick(*GROUPS_OK), pick(*GROUPS_BAD))
    n = 4 if a.fault == "group" else GROUPS_OK[group]
    const = a("x", st.just(None), pick(*NOT_ARRAYS))  # a bad input replaces the block
    kw = _collective_kwargs(a, coll, n, dtype)
    fn = getattr(spmd, coll)

    def body(block):
        x = const if a.fault == "x" else block.astype(dtype)[:n] if coll == "scatter" else block.astype(dtype)
        y = fn(group=group) if coll == "axis_index" else fn(x, group=group, **kw)
        return jnp.reshape(y, (1, 1) + jnp.shape(y))

    layout = [Shard(0), Shard(1)]
    f = spmd.spmd(body, mesh, in_placements=layout, out_placements=layout)
    outcome(lambda: np.asarray(f(jnp.ones((2 * BLOCK[0], 4 * BLOCK[1])))), a.bad, (coll, "spmd"))


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_fuzz_spmd_decorator(meshes, data):
    """@spmd itself: the mesh, the argument's placements and the result's placements."""
    mesh_ndim = data.draw(pick(1, 2))
    mesh = meshes[mesh_ndim]
    a = Args(data, ["mesh", "in_placements", "out_placements", "check_vma"])
    m = a("mesh", st.just(mesh), pick("mesh", None, mesh.jax_mesh, 3, [mesh]))
    layouts = st.lists(pick(R, Shard(0), Shard(1), Shard(-1)), min_size=mesh_ndim, max_size=mesh_ndim)
    bad = st.one_of(st.lists(pick(R, Shard(0)), min_size=mesh_ndim + 1, max_size=mesh_ndim + 1),
                    st.tuples(pick(Shard(2), Shard(-3), "S0", None, Partial()), layouts).map(
                        lambda t: [t[0], *t[1][1:]]),
                    pick("S0", 7, [[R] * mesh_ndim, [R] * mesh_ndim]))
    pin = a("in_placements", layouts, bad)
    pout = a("out_placements", st.just(pin), bad)
    vma = a("check_vma", pick(True, False), pick("no", 1, None, np.bool_(True)))
    x = jnp.arange(64.0).reshape(8, 8)
    got = outcome(lambda: np.asarray(spmd.spmd(lambda v: v * 2, m, in_placements=pin, out_placements=pout,
                                               check_vma=vma)(x)), a.bad, ("spmd",))
    if got is not None:
        np.testing.assert_array_equal(got, 2 * np.asarray(x))


# --- the eager ProcessGroup ---------------------------------------------------------------------------
METHODS = {"allreduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather", "reduce": "reduce",
           "scatter": "scatter", "gather": "gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_fuzz_process_group(meshes, data):
    mesh = meshes[2]
    method = data.draw(pick(*METHODS))
    coll = METHODS[method]
    dtype = data.draw(pick("float32", "int32", "complex64"))
    pg = mesh.get_group(data.draw(pick(None, "dp", "tp", ("tp", "dp"))))
    n = pg.size
    shape = mesh.shape + ((n, 8) if coll == "scatter" else BLOCK)
    good_t = (np.arange(int(np.prod(shape))).reshape(shape) % 5).astype(dtype)
    names = [m for m in ARGS[coll] if m not in ("tiled", "axis")]  # the eager all_gather stacks on a new axis 0
    a = Args(data, ["t", *names])
    uneven = (good_t[..., :3, :],) if coll in ("scatter", "reduce_scatter", "all_to_all") else ()
    t = a("t", st.just(good_t), pick(*NOT_ARRAYS, good_t[0], good_t.astype(str), *uneven))
    kw = {k: v for k, v in _collective_kwargs(a, coll, n, dtype).items() if k in names}
    outcome(lambda: np.asarray(getattr(pg, method)(t, **kw)), a.bad, (f"ProcessGroup.{method}", coll))


# --- DTensor: distribute_tensor, from_local, redistribute ----------------------------------------------
PARTIAL_FOR = {"float32": ("sum", "avg", "max", "min", "product"), "int32": ("sum", "max", "min", "product"),
               "bool": (), "complex64": ("sum", "avg", "product")}
PARTIAL_REFUSED = {"float32": (), "int32": ("avg",), "bool": ("sum", "max"), "complex64": ("max", "min")}


def _placements(a: Args, mesh_ndim: int, ndim: int, dtype: str, name: str = "placements"):
    """A placement list: a good one fits the mesh, the tensor rank and the dtype (one Partial op);
    a bad one does not."""
    ops = PARTIAL_FOR[dtype]
    one = [R] + [Shard(d) for d in range(-ndim, ndim)] + [Partial(op) for op in ops]
    # a list shorter than the mesh is good too: torch completes it with Replicate() on the trailing dims
    good = st.lists(pick(*one), min_size=max(mesh_ndim - 1, 0), max_size=mesh_ndim).filter(
        lambda pl: len({p.reduce_op for p in pl if isinstance(p, Partial)}) <= 1)
    rest = st.lists(pick(*one[: 1 + 2 * ndim]), min_size=mesh_ndim - 1, max_size=mesh_ndim - 1)
    bad = [
        st.lists(pick(*one), min_size=mesh_ndim + 1, max_size=mesh_ndim + 1),
        st.tuples(pick(Shard(ndim), Shard(-ndim - 1), "R", None, Shard), rest).map(lambda t: [t[0], *t[1]]),
        pick("S0", 0, Shard(0) if mesh_ndim > 1 else "R"),
    ]
    if PARTIAL_REFUSED[dtype]:  # a Partial op the dtype does not allow
        bad += [st.tuples(pick(*(Partial(op) for op in PARTIAL_REFUSED[dtype])), rest).map(lambda t: [t[0], *t[1]])] * 2
    if mesh_ndim > 1 and dtype == "float32":  # Partial ops that may not mix
        bad.append(st.just([Partial("max"), Partial("sum")]))
    return a(name, good, st.one_of(bad))


def _data(shape, dtype: str):
    v = (np.arange(int(np.prod(shape))) % 7 - 3).reshape(shape)
    return v.astype(dtype) if dtype != "bool" else v > 0


SHAPES = ((8, 4), (5, 3), (7,), (2, 9))


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_fuzz_distribute_tensor(meshes, data):
    mesh_ndim = data.draw(pick(1, 2))
    mesh = meshes[mesh_ndim]
    dtype = data.draw(pick(*DTYPES))
    x_good = _data(data.draw(pick(*SHAPES)), dtype)
    a = Args(data, ["x", "device_mesh", "placements"])
    x = a("x", st.just(x_good), pick(*NOT_ARRAYS))
    m = a("device_mesh", st.just(mesh), pick("cpu", None, mesh.jax_mesh, 2))
    pl = _placements(a, mesh_ndim, x_good.ndim, dtype)
    dt = outcome(lambda: distribute_tensor(x, m, pl), a.bad, ("distribute_tensor",))
    if dt is not None:
        np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x_good)


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_fuzz_from_local(meshes, data):
    mesh = meshes[1]
    dtype = data.draw(pick("float32", "int32", "complex64"))
    locs = [_data((2, 3), dtype) + r for r in range(4)]
    bad_lists = (locs[:3], locs + locs[:1], locs[:3] + [locs[3][:1]], locs[:3] + [locs[3].astype(bool)],
                 locs[:3] + [locs[3][0]], [x.astype(str) for x in locs], [None] * 4, np.stack(locs), None, "abcd")
    a = Args(data, ["locals", "device_mesh", "placements", "shape", "run_check"])
    ls = a("locals", st.just(locs), pick(*bad_lists))
    m = a("device_mesh", st.just(mesh), pick("cpu", None, mesh.jax_mesh, meshes[2]))
    pl = _placements(a, 1, 2, dtype)
    shape = a("shape", st.just(None), pick("8x3", (-8, 3), (8,), (8, 3, 1), (9, 3), 1.5))
    run_check = a("run_check", pick(False, True), pick("no", 1, None))
    resolved = [R] if pl is None or pl == [] else pl
    if not a.bad and run_check is False and isinstance(resolved, list) and resolved[0] == R:
        a.bad.append("locals (different tensors under Replicate without run_check)")
    dt = outcome(lambda: DTensor.from_local(ls, m, pl, shape=shape, run_check=run_check), a.bad,
                 ("DTensor.from_local",))
    if dt is None:
        return
    p, stack = dt.placements[0], np.stack(locs)
    want = (np.concatenate(locs, p.dim) if isinstance(p, Shard) else locs[0] if isinstance(p, Replicate)
            else {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0),
                  "product": stack.prod(0)}[p.reduce_op].astype(dtype))
    np.testing.assert_allclose(np.asarray(dt.full_tensor()), want, rtol=1e-6)


@settings(max_examples=50, **SETTINGS)
@given(st.data())
def test_fuzz_redistribute(meshes, data):
    mesh_ndim = data.draw(pick(1, 2))
    mesh = meshes[mesh_ndim]
    dtype = data.draw(pick("float32", "int32"))
    x = _data(data.draw(pick(*SHAPES)), dtype)
    src = data.draw(st.lists(pick(R, Shard(0), Shard(x.ndim - 1)), min_size=mesh_ndim, max_size=mesh_ndim))
    if data.draw(st.booleans()):
        src[0] = Partial("sum")
    dt = distribute_tensor(x, mesh, src)
    planned = data.draw(st.booleans())  # plan_redistribute(dt, placements) instead of dt.redistribute
    a = Args(data, ["dt" if planned else "device_mesh", "placements"])
    if planned:
        d = a("dt", st.just(dt), pick(x, None, "dt", [dt]))
    else:
        m = a("device_mesh", st.just(None), pick("cpu", mesh.jax_mesh, 2))  # another DeviceMesh is a cross-mesh move
    dst = _placements(a, mesh_ndim, x.ndim, dtype)
    padded = [*dst, *[R] * (mesh_ndim - len(dst))] if isinstance(dst, list) else dst
    if not a.bad and any(s != d and s.is_partial() and d.is_partial() for s, d in zip(dt.placements, padded)):
        a.bad.append("placements (a Partial op switch)")
    if planned:
        plan = outcome(lambda: spmd.plan_redistribute(d, dst), a.bad, ("plan_redistribute",))
        assert plan is None or (plan.src, plan.dst) == (dt.placements, tuple(
            Shard(p.dim % x.ndim) if isinstance(p, Shard) else p for p in padded))
        return
    out = outcome(lambda: dt.redistribute(m, dst), a.bad, ("DTensor.redistribute",))
    if out is not None:
        np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
