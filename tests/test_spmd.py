"""@spmd: decorator and call forms, placements of arguments and results, pytrees, jax.jit,
jax.grad (and JAX's replicated-gradient trap), Partial results as DTensor."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import DTensor, Partial, Replicate, Shard

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def test_decorator_and_call_forms(mesh8):
    seen = []

    def double(x):
        seen.append(x.shape)
        return 2 * x

    x = jnp.arange(16.0)
    a = spmd.spmd(mesh8, in_placements=S0, out_placements=S0)(double)
    b = spmd.spmd(double, mesh8, in_placements=S0, out_placements=S0)
    c = spmd.spmd(double, mesh=mesh8, in_placements=[S0], out_placements=[S0])

    @spmd.spmd(mesh8, in_placements=S0, out_placements=S0)
    def d(x):
        return double(x)

    for f in (a, b, c, d):
        np.testing.assert_array_equal(f(x), 2 * np.arange(16.0))
    assert set(seen) == {(2,)}  # each device sees its local block of 16 / 8 rows
    assert d.__name__ == "d"
    # A call is the jitted function's (one Python frame around it, for the non-array argument's message): its
    # lower / trace / eval_shape forward to the jitted function, and its compiled program gives the values.
    assert type(d.jitted) is type(jax.jit(double)) and d.__wrapped__.__name__ == "d"
    assert d.lower(x).as_text() == d.jitted.lower(x).as_text()
    assert d.eval_shape(x).shape == (16,) and d.trace(x).out_info.shape == (16,)
    # jax.grad copies a function's attributes onto its gradient: a region's live on its class, so none leak.
    assert not hasattr(jax.grad(lambda v: d(v).sum()), "lower")
    np.testing.assert_array_equal(d.lower(x).compile()(x), 2 * np.arange(16.0))


def test_placements_on_a_2d_mesh(mesh2x4):
    x = jnp.arange(8 * 16.0).reshape(8, 16)
    shapes = {}

    def record(name):
        def f(x):
            shapes[name] = x.shape
            return x
        return f

    for name, pl in [("S0S1", [S0, S1]), ("S1S0", [S1, S0]), ("RS1", [R, S1]), ("S0R", [S0, R]), ("RR", [R, R]),
                     ("S0S0", [S0, S0]), ("S1S1", [S1, S1])]:
        f = spmd.spmd(record(name), mesh2x4, in_placements=pl, out_placements=pl)
        np.testing.assert_array_equal(f(x), x, err_msg=name)  # a round trip through the blocks
    assert shapes == {"S0S1": (4, 4), "S1S0": (2, 8), "RS1": (8, 4), "S0R": (4, 16), "RR": (8, 16),
                      "S0S0": (1, 16), "S1S1": (8, 2)}


def test_nested_shards_follow_torch_order(mesh2x4):
    """(Shard(0), Shard(0)): dp cuts first, then tp cuts each dp chunk: rank r holds chunk r."""

    @spmd.spmd(mesh2x4, in_placements=[S0, S0], out_placements=[S0, S0])
    def label(x):
        return jnp.full(x.shape, spmd.axis_index(("dp", "tp")), jnp.int32)

    np.testing.assert_array_equal(label(jnp.zeros(16)), np.repeat(np.arange(8), 2))

    @spmd.spmd(mesh2x4, in_placements=[S1, S0], out_placements=[S1, S0])
    def coords(x):
        return jnp.stack([jnp.full(x.shape, spmd.axis_index("dp")), jnp.full(x.shape, spmd.axis_index("tp"))])[0]

    got = coords(jnp.zeros((4, 2)))
    np.testing.assert_array_equal(got, [[0, 1]] * 4)


def test_collectives_inside(mesh2x4):
    @spmd.spmd(mesh2x4, in_placements=[S0, S1], out_placements=[R, R])
    def total(x):
        return spmd.all_reduce(x.sum(), group=("dp", "tp"))

    @spmd.spmd(mesh2x4, in_placements=[S0, S1], out_placements=[S0, R])
    def gather_cols(x):
        return spmd.all_gather(x, axis=1, tiled=True, group="tp")

    x = jnp.arange(8 * 12.0).reshape(8, 12)
    np.testing.assert_allclose(total(x), x.sum())
    np.testing.assert_array_equal(gather_cols(x), x)


def test_pytrees_in_and_out(mesh2x4):
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
    batch = (jnp.arange(8 * 3.0).reshape(8, 3), jnp.arange(8.0))

    @spmd.spmd(mesh2x4, in_placements=([R, R], ([S0, R], [S0, R])), out_placements=({"y": [S0, R], "n": [R, R]}))
    def f(params, batch):
        x, t = batch
        y = x @ params["w"] + params["b"] + t[:, None]
        return {"y": y, "n": spmd.all_reduce(jnp.asarray(x.shape[0]), group="dp")}

    out = f(params, batch)
    np.testing.assert_allclose(out["y"], batch[0] @ params["w"] + params["b"] + batch[1][:, None])
    assert int(out["n"]) == 8
    # A prefix per leaf of a dict also works.
    g = spmd.spmd(lambda p: jax.tree.map(lambda a: 2 * a, p), mesh2x4,
                  in_placements={"w": [R, S1], "b": [S0, R]}, out_placements={"w": [R, S1], "b": [S0, R]})
    got = g(params)
    np.testing.assert_array_equal(got["w"], 2 * params["w"])
    np.testing.assert_array_equal(got["b"], 2 * params["b"])


def test_composes_with_jit(mesh8):
    calls = []

    @spmd.spmd(mesh8, in_placements=S0, out_placements=S0)
    def f(x):
        calls.append(1)
        return jnp.sin(x) + spmd.all_reduce(x.sum(), group="x")

    x = jnp.arange(16.0)
    want = np.sin(np.arange(16.0)) + np.arange(16.0).sum()
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: f(x) * 2)(x), 2 * want, rtol=1e-6)
    n = len(calls)
    f(x + 1)  # same shapes: no new trace
    assert len(calls) == n


def test_composes_with_grad(mesh2x4):
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    x = jnp.arange(8 * 3.0).reshape(8, 3) / 10

    @spmd.spmd(mesh2x4, in_placements=([R, R], [S0, R]), out_placements=[R, R])
    def loss(w, x):
        local = jnp.sum(jnp.tanh(x @ w) ** 2)
        return spmd.all_reduce(local, group="dp")

    def reference(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    np.testing.assert_allclose(loss(w, x), reference(w, x), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(loss)(w, x), jax.grad(reference)(w, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss, argnums=1)(w, x), jax.grad(reference, argnums=1)(w, x), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(w, x), jax.grad(reference)(w, x), rtol=1e-5, atol=1e-6)


def test_replicated_gradient_trap(mesh8):
    """Inside the region, the gradient of a Replicate parameter is ALREADY summed over the devices.

    A DDP step ported from torch that then averages it (all_reduce(g, "avg")) gets the sum of the
    local gradients, not their mean: divide by the group size instead, and do not all_reduce again.
    """
    w = jnp.array([0.5, -1.0, 2.0])
    x = jnp.arange(16 * 3.0).reshape(16, 3) / 16
    y = jnp.arange(16.0) / 4

    def local_loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    @spmd.spmd(mesh8, in_placements=(R, S0, S0), out_placements=(R, R))
    def grads(w, x, y):
        g = jax.grad(local_loss)(w, x, y)
        return g, spmd.all_reduce(g, "avg", group="x")

    g_inside, g_avg = grads(w, x, y)
    per_rank = [jax.grad(local_loss)(w, x[2 * r: 2 * r + 2], y[2 * r: 2 * r + 2]) for r in range(8)]
    summed = np.sum(per_rank, axis=0)
    np.testing.assert_allclose(g_inside, summed, rtol=1e-5)
    np.testing.assert_allclose(g_avg, summed, rtol=1e-5)  # the trap: "avg" of the already-summed gradient
    # The data-parallel gradient torch's DDP gives (mean of local grads = grad of the global mean loss):
    np.testing.assert_allclose(g_inside / 8, jax.grad(local_loss)(w, x, y), rtol=1e-5)


@pytest.mark.parametrize("op, want", [("sum", 120.0), ("avg", 15.0), ("max", 29.0), ("min", 1.0)])
def test_partial_result_is_a_dtensor(mesh8, op, want):
    @spmd.spmd(mesh8, in_placements=S0, out_placements=Partial(op))
    def f(x):
        return x.sum(keepdims=True)

    x = jnp.arange(16.0)
    d = f(x)
    assert d.placements == (Partial(op),) and d.shape == (1,) and d.device_mesh == mesh8
    locals_ = [float(t[0]) for t in d.local_tensors()]
    assert locals_ == [float(x[2 * r] + x[2 * r + 1]) for r in range(8)]  # unreduced until asked
    np.testing.assert_allclose(d.full_tensor(), [want])


@pytest.mark.parametrize("op, want", [("sum", 120.0), ("max", 29.0)])
def test_scalar_partial_result(mesh8, op, want):
    # A loss returned unreduced: a 0-d Partial DTensor.
    d = spmd.spmd(lambda x: x.sum(), mesh8, in_placements=S0, out_placements=Partial(op))(jnp.arange(16.0))
    assert d.shape == () and d.placements == (Partial(op),)
    assert [float(t) for t in d.local_tensors()] == [4.0 * r + 1 for r in range(8)]
    np.testing.assert_array_equal(d.full_tensor(), want)
    np.testing.assert_array_equal(d.redistribute(placements=[Replicate()]).local_tensors()[5], want)


def test_partial_and_shard_on_a_2d_mesh(mesh2x4):
    @spmd.spmd(mesh2x4, in_placements=[S1, S0], out_placements=[Partial(), S0])
    def f(x):
        return x.sum(axis=1)  # partial over dp (the columns it summed), rows sharded over tp

    x = jnp.arange(8 * 6.0).reshape(8, 6)
    d = f(x)
    assert isinstance(d, DTensor) and d.shape == (8,) and d.placements == (Partial(), S0)
    np.testing.assert_allclose(d.full_tensor(), x.sum(axis=1))


def test_partial_dtensor_feeds_another_region(mesh8):
    partial = spmd.spmd(lambda x: x * 1.0, mesh8, in_placements=S0, out_placements=Partial())(jnp.arange(8.0))

    @spmd.spmd(mesh8, out_placements=R)
    def reduce_it(d):
        return spmd.all_reduce(d, group="x")

    np.testing.assert_allclose(reduce_it(partial), [28.0])


def test_wrong_replicate_claims_raise(mesh8, mesh2x4):
    f = spmd.spmd(lambda x: 2 * x, mesh8, in_placements=S0, out_placements=R)
    with pytest.raises(ValueError, match=re.escape(
            "spmd: out_placements (leaf 0)=R says the result is replicated over ['x'], but it differs across "
            "those ranks; make it Partial or Shard there, or all_reduce it first.")):
        f(jnp.arange(8.0))
    g = spmd.spmd(lambda x: x.sum(keepdims=True), mesh2x4, in_placements=[S0, S0], out_placements=[Partial(), R])
    with pytest.raises(ValueError, match=re.escape(
            "spmd: out_placements (leaf 0)=P(sum)R says the result is replicated over ['tp'], but it differs")):
        g(jnp.arange(8.0))
    # A default (None) out placement means Replicate, and is checked the same way.
    h = spmd.spmd(lambda x: x, mesh8, in_placements=S0)
    with pytest.raises(ValueError, match=re.escape("says the result is replicated over ['x']")):
        h(jnp.arange(8.0))
    # A value made replicated by a collective passes.
    ok = spmd.spmd(lambda x: spmd.all_gather(x, tiled=True, group="x"), mesh8, in_placements=S0, out_placements=R)
    np.testing.assert_array_equal(ok(jnp.arange(8.0)), np.arange(8.0))


# --- nothing silently replicated, out_placements checked as DTensor placements (issue 10.11) ------------
def test_check_vma_false_does_not_silently_replicate(mesh8):
    from jax import lax

    x = np.arange(8.0, dtype=np.float32)
    msg = "spmd: out_placements (leaf 0)=R says the result is replicated over ['x'], but it differs across those ranks"
    with pytest.raises(ValueError, match=re.escape(msg)):  # was device 0's value, silently
        spmd.spmd(lambda b: b * 2, mesh8, in_placements=S0, out_placements=R, check_vma=False)(x)
    total = spmd.spmd(lambda b: spmd.all_reduce(b, group="x"), mesh8, in_placements=S0, out_placements=R, check_vma=False)
    np.testing.assert_array_equal(np.asarray(total(x)), [28.0])

    def scan(b):  # traceable only with check_vma=False (its carry changes vma type)
        return lax.scan(lambda c, _: (c + b, None), jnp.zeros(1), None, length=2)[0]

    np.testing.assert_array_equal(
        np.asarray(spmd.spmd(scan, mesh8, in_placements=S0, out_placements=S0, check_vma=False)(x)), 2 * x
    )
    msg = "spmd: out_placements (leaf 0)=R says the result is replicated over ['x'], but with check_vma=False nothing checks it"
    with pytest.raises(ValueError, match=re.escape(msg)):
        spmd.spmd(scan, mesh8, in_placements=S0, out_placements=R, check_vma=False)(x)


@pytest.mark.parametrize(
    "out,dtype,exc,msg",
    [
        (Partial("avg"), np.int32, TypeError, "spmd: out_placements (leaf 0)[0]=P(avg) on a int32 tensor is refused"),
        (Partial("sum"), np.bool_, TypeError, "spmd: out_placements (leaf 0)[0]=P(sum) on a bool tensor is refused"),
        ([Partial("sum"), Partial("max")], np.float32, ValueError,
         "spmd: out_placements (leaf 0)=P(sum)P(max) mixes Partial ops ['max', 'sum']"),
    ],
)
def test_out_placements_get_the_dtensor_checks(mesh8, mesh2x4, out, dtype, exc, msg):
    mesh = mesh2x4 if isinstance(out, list) else mesh8
    f = spmd.spmd(lambda b: b, mesh, in_placements=[S0] * mesh.ndim, out_placements=out)
    with pytest.raises(exc, match=re.escape(msg)):  # at trace time, not at full_tensor()
        f(np.ones(8, dtype))


# --- uneven DTensor arguments (issue 13.4) -------------------------------------------------------------
UNEVEN = [((8,), (5, 3), [S0]), ((8,), (3, 10), [S1]), ((3,), (7, 2), [S0]), ((2, 4), (10, 3), [S0, S0]),
          ((2, 4), (5, 7), [S1, S0]), ((2, 4), (3, 9), [R, S1])]


@pytest.mark.parametrize("mesh_shape, shape, pl", UNEVEN, ids=str)
def test_uneven_dtensor_arguments(mesh_shape, shape, pl):
    """An uneven DTensor arrives as its padded block with the padding zero (sums exact), even when an op left
    garbage there; spmd.local_shape is each device's torch.chunk shape (masks for max and counts)."""
    mesh = spmd.init_device_mesh("cpu", mesh_shape)
    names = mesh.mesh_dim_names
    sharded = tuple(n for n, p in zip(names, pl) if p != R)  # a Replicate dim's copies are not summed
    x = (np.arange(np.prod(shape)) % 11 - 6).reshape(shape).astype(np.float32)
    dt = spmd.distribute_tensor(x, mesh, pl) * 2 + 1  # an op result: its padding holds 1s, not zeros
    locals_ = dt.local_tensors()
    assert len({t.shape for t in locals_}) > 1  # uneven indeed

    @spmd.spmd(mesh, out_placements=([R] * len(mesh_shape), [R] * len(mesh_shape), [S0] * len(mesh_shape)))
    def stats(a):
        n = spmd.local_shape(dt.shape, dt.placements)
        valid = jnp.ones(a.shape, bool)
        for d in range(a.ndim):
            valid &= jax.lax.broadcasted_iota(jnp.int32, a.shape, d) < n[d]
        biggest = spmd.all_reduce(jnp.where(valid, a, -jnp.inf).max(), "max", group=names)
        return spmd.all_reduce(a.sum(), group=sharded), biggest, n[None]

    total, biggest, shapes = stats(dt)
    np.testing.assert_array_equal(total, (2 * x + 1).sum())
    np.testing.assert_array_equal(biggest, (2 * x + 1).max())
    np.testing.assert_array_equal(np.asarray(shapes), [t.shape for t in locals_])  # rank order


def test_uneven_contraction_is_exact(mesh8):
    """x @ w over an unevenly sharded contraction dim (10 over 8 ranks, two ranks empty): the zero padding
    contributes nothing, as the hand-written Megatron row-parallel matmul needs."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 10)).astype(np.float32), rng.standard_normal((10, 3)).astype(np.float32)
    dx, dw = spmd.distribute_tensor(x, mesh8, [S1]) + 0, spmd.distribute_tensor(w, mesh8, [S0]) + 0
    y = spmd.spmd(lambda a, b: spmd.all_reduce(a @ b), mesh8, out_placements=[R])(dx, dw)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-6)
    partial = spmd.spmd(lambda a, b: a @ b, mesh8, out_placements=[Partial()])(dx, dw)
    np.testing.assert_allclose(np.asarray(partial.full_tensor()), x @ w, rtol=1e-5, atol=1e-6)


def test_local_shape_outside_a_region_and_bad_placements(mesh8):
    with pytest.raises(ValueError, match=re.escape("spmd.local_shape: called outside an SPMD region")):
        spmd.local_shape((5, 3), [S0])
    with pytest.raises(ValueError, match=re.escape("spmd.local_shape: placements")):
        spmd.spmd(lambda a: spmd.local_shape((5,), [Shard(3)]), mesh8, in_placements=[S0], out_placements=[R])(
            jnp.ones(8))
