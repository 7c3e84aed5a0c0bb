"""DTensor API: construction, local views, full_tensor, repr/visualize, pytree/jit, torch parity, errors."""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from placements import Partial, Replicate, Shard, shard_size_and_offset
from spmd import DTensor, distribute_tensor, plan_redistribute
from _torch_ref import run_torch_ranks

R = Replicate()


def data(shape, dtype=np.float32):
    return (np.arange(int(np.prod(shape))) % 11 - 5).reshape(shape).astype(dtype)


@pytest.fixture(scope="module")
def mesh4():
    return spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))


@pytest.fixture(scope="module")
def mesh3():
    return spmd.init_device_mesh("cpu", (3,), mesh_dim_names=("x",))


# --- construction and local views ------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 5, 8, 10, 17])
def test_distribute_uneven_local_tensors_follow_torch_chunk(mesh8, n):
    x = data((n, 3))
    dt = distribute_tensor(x, mesh8, [Shard(0)])
    locs = dt.local_tensors()
    assert len(locs) == 8
    for r, t in enumerate(locs):
        size, off = shard_size_and_offset(n, 8, r)
        assert t.shape == (size, 3)
        np.testing.assert_array_equal(np.asarray(t), x[off : off + size])
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


def test_local_shapes_match_torch_shard_math(mesh2x4):
    torch_pt = pytest.importorskip("torch.distributed.tensor.placement_types")
    x = data((10, 7))
    for pl in ([Shard(0), Shard(0)], [Shard(1), Shard(0)], [R, Shard(1)], [Shard(0), R]):
        dt = distribute_tensor(x, mesh2x4, pl)
        for r, t in enumerate(dt.local_tensors()):
            i, j = divmod(r, 4)
            shape = list(x.shape)
            for k, (p, c) in enumerate(zip(pl, (i, j))):
                if isinstance(p, Shard):
                    shape[p.dim] = torch_pt.Shard.local_shard_size_and_offset(shape[p.dim], (2, 4)[k], c)[0]
            assert t.shape == tuple(shape)


def test_from_local_even_infers_shape(mesh4):
    locs = [np.full((2, 3), r, np.int32) for r in range(4)]
    dt = DTensor.from_local(locs, mesh4, [Shard(0)])
    assert dt.shape == (8, 3) and dt.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), np.concatenate(locs))


def test_from_local_uneven_with_shape_and_callable(mesh4):
    x = data((5, 2))
    dt = DTensor.from_local(lambda r: x[2 * r : 2 * r + 2], mesh4, [Shard(0)], shape=(5, 2))
    assert [t.shape for t in dt.local_tensors()] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)


def test_from_local_jax_arrays_and_partial_ops(mesh4):
    locs = [jnp.arange(6.0).reshape(2, 3) * (r + 1) for r in range(4)]
    stack = np.stack([np.asarray(l) for l in locs])
    for op, ref in [("sum", stack.sum(0)), ("avg", stack.mean(0)), ("max", stack.max(0)), ("min", stack.min(0)),
                    ("product", stack.prod(0))]:
        dt = DTensor.from_local(locs, mesh4, [Partial(op)])
        np.testing.assert_allclose(np.asarray(dt.full_tensor()), ref, rtol=1e-6)
        rs = dt.redistribute(placements=[Shard(1)])
        assert [t.shape for t in rs.local_tensors()] == [(2, 1), (2, 1), (2, 1), (2, 0)]
        np.testing.assert_allclose(np.asarray(rs.full_tensor()), ref, rtol=1e-6)


def test_from_local_run_check_copies_coordinate_zero_along_replicate(mesh2x4):
    locs = [np.full((2,), r, np.int32) for r in range(8)]
    dt = DTensor.from_local(locs, mesh2x4, [Shard(0), R], run_check=True)
    got = [int(t[0]) for t in dt.local_tensors()]
    assert got == [0, 0, 0, 0, 4, 4, 4, 4]


@pytest.mark.parametrize("op,others", [("sum", 0), ("product", 1), ("avg", None), ("max", None), ("min", None)])
def test_replicate_to_partial_is_local_and_exact(mesh2x4, op, others):
    x = data((3, 4), np.float32) + 0.25
    dt = distribute_tensor(x, mesh2x4, [R, R]).redistribute(placements=[R, Partial(op)])
    for r, t in enumerate(dt.local_tensors()):
        want = x if (r % 4 == 0 or others is None) else np.full_like(x, others)
        np.testing.assert_array_equal(np.asarray(t), want)
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), x)
    # PRODUCT has no all-reduce in XLA: it gathers, then multiplies locally.
    assert plan_redistribute(dt, [R, R]).collectives == (
        ("all_gather",) if op == "product" else ("all_reduce",))


def test_distribute_partial_matches_replicate_then_partial(mesh2x4):
    x = data((4, 4), np.int32)
    a = distribute_tensor(x, mesh2x4, [Partial("sum"), Shard(1)])
    b = distribute_tensor(x, mesh2x4, [R, Shard(1)]).redistribute(placements=[Partial("sum"), Shard(1)])
    for s, t in zip(a.local_tensors(), b.local_tensors()):
        np.testing.assert_array_equal(np.asarray(s), np.asarray(t))
    np.testing.assert_array_equal(np.asarray(a.full_tensor()), x)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.float32, np.bool_])
def test_dtypes_bit_exact(mesh3, dtype):
    x = (data((7, 2)) > 0) if dtype == np.bool_ else data((7, 2), dtype)
    dt = distribute_tensor(x, mesh3, [Shard(0)])
    for dst in ([Shard(1)], [R], [Shard(0)]):
        out = dt.redistribute(placements=dst)
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)


def test_integer_partial_sum_exact(mesh8):
    big = np.array([2**24 + 1, -(2**24) + 3, 7], np.int32)  # not exact in float32
    dt = DTensor.from_local([big * (r + 1) for r in range(8)], mesh8, [Partial("sum")])
    np.testing.assert_array_equal(np.asarray(dt.full_tensor()), big * 36)
    np.testing.assert_array_equal(np.asarray(dt.redistribute(placements=[Shard(0)]).full_tensor()), big * 36)


# --- pytree / jit ------------------------------------------------------------------------------
def test_pytree_and_jit(mesh2x4):
    x = data((10, 6))
    dt = distribute_tensor(x, mesh2x4, [Shard(0), Shard(1)])
    leaves, tree = jax.tree_util.tree_flatten(dt)
    assert len(leaves) == 1
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.placements == dt.placements and back.shape == dt.shape

    @jax.jit
    def f(d):
        return d.redistribute(placements=[Shard(1), R])

    out = f(dt)
    assert isinstance(out, DTensor) and out.placements == (Shard(1), R)
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)

    @jax.jit
    def g(v):
        return distribute_tensor(v, mesh2x4, [Shard(0), Partial("sum")]).full_tensor()

    np.testing.assert_array_equal(np.asarray(g(jnp.asarray(x))), x)


def test_dtensor_through_spmd(mesh8):
    x = data((16, 3))
    dt = distribute_tensor(x, mesh8, [Shard(0)])

    @spmd.spmd(mesh8, out_placements=[Partial("sum")])
    def f(t):
        return t.sum(axis=0)

    out = f(dt)
    assert isinstance(out, DTensor) and out.placements == (Partial("sum"),)
    np.testing.assert_allclose(np.asarray(out.redistribute(placements=[R]).full_tensor()), x.sum(0))


# --- plan, repr, visualize -------------------------------------------------------------------------
def test_plan_redistribute(mesh2x4):
    dt = distribute_tensor(data((8, 8)), mesh2x4, [Shard(0), Shard(1)])
    p = plan_redistribute(dt, [Shard(0), Shard(0)])
    assert p is plan_redistribute(dt, [Shard(0), Shard(-2)])  # the same (cached) plan: Shard(-2) is Shard(0)
    assert str(p).startswith("S(0)S(1) -> S(0)S(0)")
    assert p.collectives == ("all_to_all",)
    assert p.cost().bytes == 4 * 2 * 4  # the 4x2 float32 block is the all_to_all buffer


def test_repr_and_visualize(mesh4):
    dt = distribute_tensor(data((5, 2)), mesh4, [Shard(0)])
    assert repr(dt) == "DTensor(shape=(5, 2), dtype=float32, placements=S(0), mesh=DeviceMesh('cpu', x=4))"
    text = dt.visualize(print_out=False)
    assert text.splitlines()[1:] == [
        "block       shape   ranks",
        "----------  ------  -----",
        "[0:2, 0:2]  (2, 2)  0",
        "[2:4, 0:2]  (2, 2)  1",
        "[4:5, 0:2]  (1, 2)  2",
        "(empty)     (0, 2)  3",
    ]
    p = distribute_tensor(data((2,)), mesh4, [Partial("max")]).visualize(print_out=False)
    assert "[0:2]  (2,)   0, 1, 2, 3" in p and "partial: P(max) over mesh dim 0 (x)" in p


def test_visualize_2d_mesh(mesh2x4, capsys):
    distribute_tensor(data((4, 8)), mesh2x4, [Shard(0), R]).visualize()
    out = capsys.readouterr().out
    assert "[0:2, 0:8]  (2, 8)  0, 1, 2, 3" in out and "[2:4, 0:8]  (2, 8)  4, 5, 6, 7" in out


# --- bad inputs: messages name the argument, the value and the fix ---------------------------------
def raises(exc, msg):
    return pytest.raises(exc, match=re.escape(msg))


def test_error_messages(mesh4, mesh2x4, mesh8):
    x = data((8, 4))
    dt = distribute_tensor(x, mesh4, [Shard(0)])
    with raises(ValueError, "distribute_tensor: placements=S(0)S(0)R has 3 placement(s) but the mesh has 2 dim(s)"):
        distribute_tensor(x, mesh2x4, [Shard(0), Shard(0), Replicate()])
    with raises(ValueError, "distribute_tensor: placements[0]=Shard(dim=2) is out of range for a tensor of rank 2; use a dim in [-2, 1]"):
        distribute_tensor(x, mesh4, [Shard(2)])
    with raises(TypeError, "distribute_tensor: device_mesh='cpu' must be a DeviceMesh"):
        distribute_tensor(x, "cpu", [Shard(0)])
    with raises(TypeError, "distribute_tensor: placements='S0' is not a placement list; pass a list of 1 placement(s) such as [Shard(0)]"):
        distribute_tensor(x, mesh4, "S0")
    with raises(ValueError, "DTensor.from_local: locals has 3 tensor(s) but DeviceMesh('cpu', x=4) has 4 ranks"):
        DTensor.from_local([x[:2]] * 3, mesh4, [Shard(0)])
    with raises(ValueError, "DTensor.from_local: locals[3] has shape (1, 4) but placements S(0) of a global shape (8, 4) give rank 3 the shape (2, 4); give shape= (the global shape) for uneven shards"):
        DTensor.from_local([x[:2], x[:2], x[:2], x[:1]], mesh4, [Shard(0)])
    with raises(ValueError, "DTensor.from_local: locals[3] has shape (3, 4) but placements S(0) of a global shape (9, 4) give rank 3 the shape (0, 4); check shape= or the locals"):
        DTensor.from_local([x[:3], x[:3], x[:3], x[:3]], mesh4, [Shard(0)], shape=(9, 4))
    with raises(TypeError, "DTensor.from_local: locals=an array of shape (8, 4) is not a sequence of local tensors; in a single-process run pass a list of 4 arrays"):
        DTensor.from_local(x, mesh4, [Shard(0)])
    with raises(TypeError, "DTensor.from_local: locals have different dtypes ['float32', 'int32']; cast them to one dtype"):
        DTensor.from_local([x[:2], x[:2], x[:2], x[:2].astype(np.int32)], mesh4, [Shard(0)])
    with raises(ValueError, "DTensor.from_local: locals have different ranks [1, 2]"):
        DTensor.from_local([x[:2], x[:2], x[:2], x[0]], mesh4, [Shard(0)])
    with raises(ValueError, "DTensor.from_local: shape=(8,) has 1 dim(s) but the local tensors have 2; give the global shape of the same rank"):
        DTensor.from_local([x[:2]] * 4, mesh4, [Shard(0)], shape=(8,))
    with raises(TypeError, "DTensor.from_local: shape='8x4' must be a tuple of ints"):
        DTensor.from_local([x[:2]] * 4, mesh4, [Shard(0)], shape="8x4")
    with raises(TypeError, "DTensor.from_local: device_mesh=None must be a DeviceMesh"):
        DTensor.from_local([x[:2]] * 4)
    p = DTensor.from_local([x] * 4, mesh4, [Partial("sum")])
    with raises(ValueError, "DTensor.redistribute: placements[0]=P(max) would switch mesh dim 0 from P(sum) to P(max); switching a Partial op is refused (as in torch): redistribute to Replicate (or Shard) first"):
        p.redistribute(placements=[Partial("max")])
    with raises(ValueError, "Partial: reduce_op='mean' is not a reduce op; use one of"):
        Partial("mean")
    with raises(ValueError, "Partial: reduce_op='band' cannot be a partial placement; use one of 'sum', 'avg', 'max', 'min', 'product'"):
        Partial("band")
    with raises(ValueError, "DTensor.redistribute: placements=RR has 2 placement(s) but the mesh has 1 dim(s)"):
        dt.redistribute(mesh8, [R, R])  # another mesh is allowed (tests/test_ops.py), checked against that mesh
    with raises(ValueError, "DTensor.redistribute: placements is needed, e.g. placements=[Replicate()] * 1"):
        dt.redistribute()
    with raises(ValueError, "distribute_tensor: placements=P(sum)P(max) mixes Partial ops ['max', 'sum']; a DTensor may mix only 'sum' and 'avg' (as in torch)"):
        distribute_tensor(x, mesh2x4, [Partial("sum"), Partial("max")])
    with raises(TypeError, "distribute_tensor: placements[0]=P(avg) on a int32 tensor is refused (torch allows AVG only on floating dtypes); use Partial('sum') and divide, or cast to a float dtype"):
        distribute_tensor(x.astype(np.int32), mesh4, [Partial("avg")])
    with raises(TypeError, "distribute_tensor: placements[0]=P(sum) on a bool tensor is refused"):
        distribute_tensor(x > 0, mesh4, [Partial("sum")])
    with raises(ValueError, "DTensor.to_local: this process holds all 4 ranks of DeviceMesh('cpu', x=4), so there is no single local tensor; use .local_tensors()[rank]"):
        dt.to_local()
    with pytest.raises(TypeError, match="(?s)" + re.escape("plan_redistribute: dt=") + ".*" + re.escape(
            " must be a DTensor; make one with distribute_tensor(x, mesh, placements).")):  # (x in NumPy's repr)
        plan_redistribute(x, [R])
    with raises(ValueError, "distribute_tensor: x is already a DTensor placed S(0), not R; call x.redistribute(placements=...) instead"):
        distribute_tensor(dt, mesh4, [R])
    with raises(TypeError, "DTensor.redistribute: placements[0]='R' is not a placement; use Shard(dim), Replicate() or Partial(op)"):
        dt.redistribute(placements=["R"])


# --- torch parity: the same numbers as torch DTensor in 4 gloo processes ----------------------------
TORCH_WORKER = textwrap.dedent(
    """
    import os, sys, pickle
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, DTensor, Shard, Replicate, Partial

    def x_of(shape):
        n = 1
        for s in shape: n *= s
        return (torch.arange(n) % 11 - 5).reshape(shape).to(torch.float32)

    def main(rank, port, out, cases):
        S, R, P = Shard, Replicate, Partial
        CASES = eval(cases)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4)
        results = []
        for mshape, shape, src, dst in CASES:
            mesh = init_device_mesh("cpu", mshape)
            x = x_of(shape)
            if any(isinstance(p, Partial) for p in src):
                # per-rank partial values: (rank + 1) * x
                local_rep = distribute_tensor(x, mesh, [Replicate()] * len(mshape)).to_local() * (rank + 1)
                dt = DTensor.from_local(local_rep, mesh, src, run_check=False)
            else:
                dt = distribute_tensor(x, mesh, src)
            out_dt = dt.redistribute(mesh, dst)
            results.append(out_dt.to_local().numpy())
        save(out, rank, results)

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=4, join=True)
    """
)

TORCH_CASES = [
    ((4,), (5, 3), "[S(0)]", "[S(1)]"),
    ((4,), (10, 3), "[S(0)]", "[R()]"),
    ((4,), (6, 5), "[S(1)]", "[S(0)]"),
    ((4,), (5, 2), "[P('sum')]", "[S(0)]"),
    ((4,), (5, 2), "[P('max')]", "[R()]"),
    ((4,), (3, 2), "[P('min')]", "[S(1)]"),
    ((2, 2), (5, 3), "[S(0), S(1)]", "[S(1), S(0)]"),
    ((2, 2), (7, 3), "[S(0), S(0)]", "[R(), S(0)]"),
    ((2, 2), (5, 3), "[P('sum'), S(0)]", "[S(1), R()]"),
    ((4,), (5, 2), "[P('product')]", "[R()]"),
    ((2, 2), (3, 5), "[S(1), S(0)]", "[S(0), S(1)]"),
    ((2, 2), (5, 5), "[S(0), S(0)]", "[S(1), S(1)]"),
]


def test_same_numbers_as_torch_dtensor(tmp_path):
    pytest.importorskip("torch")
    cases = "[" + ", ".join(f"({m!r}, {s!r}, {a}, {b})" for m, s, a, b in TORCH_CASES) + "]"
    torch_out = run_torch_ranks(tmp_path, TORCH_WORKER, [cases], timeout=180)
    S, P = Shard, Partial
    for i, (mshape, shape, src, dst) in enumerate(TORCH_CASES):
        mesh = spmd.init_device_mesh("cpu", mshape)
        src_pl = eval(src, {"S": S, "P": P, "R": Replicate})
        dst_pl = eval(dst, {"S": S, "P": P, "R": Replicate})
        x = data(shape)
        if any(isinstance(p, Partial) for p in src_pl):
            dt = DTensor.from_local([x * (r + 1) for r in range(4)], mesh, src_pl)
        else:
            dt = distribute_tensor(x, mesh, src_pl)
        ours = dt.redistribute(placements=dst_pl).local_tensors()
        for r in range(4):
            np.testing.assert_array_equal(np.asarray(ours[r]), torch_out[r][i], err_msg=f"case {i} rank {r}")


# --- NaN, narrow AVG and -0.0 through Partial (issue 10.5-10.7) ---------------------------------------
@pytest.mark.parametrize("op", ["max", "min"])
def test_partial_max_min_keep_nan(mesh8, op):
    locals_ = [np.array([np.nan, np.nan if r == 3 else r, r - 4.0], np.float32) for r in range(8)]
    want = getattr(np, op)(np.stack(locals_), axis=0)
    np.testing.assert_array_equal(np.asarray(DTensor.from_local(locals_, mesh8, [Partial(op)]).full_tensor()), want)
    x = np.array([np.nan, 1.0, -0.0], np.float32)  # R -> P(op) -> R keeps the value, NaN and -0.0 included
    back = distribute_tensor(x, mesh8, [R]).redistribute(placements=[Partial(op)]).redistribute(placements=[R])
    got = np.asarray(back.full_tensor())
    np.testing.assert_array_equal(got, x)
    assert np.signbit(got[2])


def test_partial_avg_float16_does_not_overflow(mesh8):
    x = np.full((3,), 16376.0, np.float16)  # 8 x 16376 overflows float16, the mean does not
    np.testing.assert_array_equal(np.asarray(distribute_tensor(x, mesh8, [Partial("avg")]).full_tensor()), x)
    np.testing.assert_array_equal(np.asarray(DTensor.from_local([x] * 8, mesh8, [Partial("avg")]).full_tensor()), x)


def test_negative_zero_through_partial(mesh8):
    """R -> P(sum) fills the other ranks with -0.0 (the IEEE additive identity), so the partition itself is
    exact; P(product|max|min) -> R keep -0.0. (XLA:CPU's float all-reduce sum starts at +0.0: README.)"""
    x = np.array([-0.0, 2.0], np.float32)
    for op in ("sum", "avg", "product", "max", "min"):
        dt = distribute_tensor(x, mesh8, [R]).redistribute(placements=[Partial(op)])
        firsts = [np.asarray(t)[0] for t in dt.local_tensors()]
        assert np.signbit(firsts[0]) and all(np.signbit(v) or (op == "product" and v == 1) for v in firsts), op
        if op in ("product", "max", "min"):
            assert np.signbit(np.asarray(dt.redistribute(placements=[R]).full_tensor())[0]), op


def test_short_placement_list_is_padded_with_replicate_as_torch(mesh2x4):
    # torch's distribute_tensor / from_local / redistribute complete a short list with Replicate()
    x = data((8, 4))
    dt = distribute_tensor(x, mesh2x4, [Shard(0)])
    assert dt.placements == (Shard(0), Replicate())
    assert [t.shape for t in dt.local_tensors()] == [(4, 4)] * 4 + [(4, 4)] * 4
    np.testing.assert_array_equal(np.asarray(dt.local_tensors()[5]), x[4:])
    out = dt.redistribute(placements=[Replicate()])
    assert out.placements == (Replicate(), Replicate())
    np.testing.assert_array_equal(np.asarray(out.full_tensor()), x)
    loc = DTensor.from_local([x[:4]] * 4 + [x[4:]] * 4, mesh2x4, [Shard(0)])
    assert loc.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(np.asarray(loc.full_tensor()), x)
