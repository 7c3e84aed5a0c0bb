"""spmd.collectives: each collective lowers to exactly the expected XLA collective, with the
expected bytes per device (nccl-tests convention)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from spmd import Replicate, Shard
from spmd._inspect import KINDS, hlo_collectives

BLOCK = (16, 8)  # per rank; 512 bytes in float32


def _program(mesh, group, f):
    """A jitted shard_map over per-rank blocks (leading axes = mesh shape) running ``f`` on each."""
    names = mesh.mesh_dim_names
    nd = mesh.ndim

    def body(block):
        y = f(block.reshape(block.shape[nd:]), group)
        return y.reshape((1,) * nd + y.shape)

    return jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=P(*names), out_specs=P(*names)))


def _only(counts, kind, count=1):
    """The single kind of collective in ``counts``: (its count, its bytes); every other kind is zero."""
    others = {k: v["count"] for k, v in counts.items() if k != kind and v["count"]}
    assert not others, f"expected only {kind}, also found {others}"
    assert counts[kind]["count"] == count, counts
    return counts[kind]["bytes"]


# (name, function of (block, group), expected kind, expected bytes as a function of (block bytes, group size))
CASES = [
    ("all_reduce-sum", lambda x, g: spmd.all_reduce(x, "sum", group=g), "all-reduce", lambda b, n: b),
    ("all_reduce-avg", lambda x, g: spmd.all_reduce(x, "avg", group=g), "all-reduce", lambda b, n: b),
    ("all_reduce-max", lambda x, g: spmd.all_reduce(x, "max", group=g), "all-reduce", lambda b, n: b),
    ("all_reduce-premul", lambda x, g: spmd.all_reduce(x, spmd.ReduceOp.PREMUL_SUM(0.5), group=g), "all-reduce",
     lambda b, n: b),
    ("all_reduce-product", lambda x, g: spmd.all_reduce(x, "product", group=g), "all-gather", lambda b, n: n * b),
    ("broadcast", lambda x, g: spmd.broadcast(x, 1, group=g), "all-reduce", lambda b, n: b),
    ("reduce", lambda x, g: spmd.reduce(x, 0, group=g), "all-reduce", lambda b, n: b),
    ("all_gather", lambda x, g: spmd.all_gather(x, group=g), "all-gather", lambda b, n: n * b),
    ("all_gather-tiled-1", lambda x, g: spmd.all_gather(x, axis=1, tiled=True, group=g), "all-gather",
     lambda b, n: n * b),
    ("gather", lambda x, g: spmd.gather(x, 0, group=g), "all-gather", lambda b, n: n * b),
    ("reduce_scatter-sum", lambda x, g: spmd.reduce_scatter(x, "sum", group=g), "reduce-scatter", lambda b, n: b),
    ("reduce_scatter-avg-1", lambda x, g: spmd.reduce_scatter(x, "avg", scatter_dim=1, group=g), "reduce-scatter",
     lambda b, n: b),
    ("reduce_scatter-max", lambda x, g: spmd.reduce_scatter(x, "max", group=g), "all-to-all", lambda b, n: b),
    ("all_to_all", lambda x, g: spmd.all_to_all(x, 0, 1, group=g), "all-to-all", lambda b, n: b),
    ("scatter", lambda x, g: spmd.scatter(x[: _n(g)], 0, group=g), "all-to-all", lambda b, n: n * b // BLOCK[0]),
    ("permute", lambda x, g: spmd.permute(x, [(i, (i + 1) % _n(g)) for i in range(_n(g))], group=g),
     "collective-permute", lambda b, n: b),
]

_GROUP_SIZES = {"x": 8, "tp": 4, "dp": 2, ("dp", "tp"): 8, ("tp", "dp"): 8}


def _n(group) -> int:
    return _GROUP_SIZES[group]


@pytest.mark.parametrize("name, f, kind, nbytes", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("which, group", [("mesh8", "x"), ("mesh2x4", "tp"), ("mesh2x4", ("tp", "dp"))],
                         ids=["x8:x", "2x4:tp", "2x4:tp,dp"])
def test_one_collective_each(request, which, group, name, f, kind, nbytes):
    mesh = request.getfixturevalue(which)
    x = jnp.ones(mesh.shape + BLOCK, jnp.float32)
    got = _only(spmd.collectives(_program(mesh, group, f), x), kind)
    assert got == nbytes(4 * np.prod(BLOCK), _n(group)), (name, got)


def test_bytes_follow_the_dtype(mesh8):
    # (XLA:CPU promotes bf16 collectives to f32, and the count reports what is compiled: use f16.)
    f = _program(mesh8, "x", lambda x, g: spmd.all_gather(x, group=g))
    assert _only(spmd.collectives(f, jnp.ones((8,) + BLOCK, jnp.float16)), "all-gather") == 8 * 2 * np.prod(BLOCK)
    assert _only(spmd.collectives(f, jnp.ones((8,) + BLOCK, jnp.int8)), "all-gather") == 8 * np.prod(BLOCK)


def test_same_hlo_as_hand_written(mesh8):
    """The spmd collectives compile to what hand-written lax does."""
    pairs = [
        (lambda x, g: spmd.all_reduce(x, group=g), lambda x, g: lax.psum(x, g)),
        (lambda x, g: spmd.all_gather(x, tiled=True, group=g), lambda x, g: lax.all_gather(x, g, tiled=True)),
        (lambda x, g: spmd.reduce_scatter(x, group=g), lambda x, g: lax.psum_scatter(x, g, tiled=True)),
        (lambda x, g: spmd.all_to_all(x, 0, 1, group=g), lambda x, g: lax.all_to_all(x, g, 0, 1, tiled=True)),
    ]
    x = jnp.ones((8,) + BLOCK, jnp.float32)
    for mine, hand in pairs:
        assert spmd.collectives(_program(mesh8, "x", mine), x) == spmd.collectives(_program(mesh8, "x", hand), x)


def test_through_spmd_decorator(mesh2x4):
    @spmd.spmd(mesh2x4, in_placements=[Replicate(), Shard(0)], out_placements=[Replicate(), Replicate()])
    def f(x):
        return spmd.all_gather(spmd.all_reduce(x, group="dp"), tiled=True, group="tp")

    x = jnp.arange(64.0).reshape(16, 4)
    counts = spmd.collectives(f, x)
    assert {k: counts["all-reduce"][k] for k in ("count", "bytes")} == {"count": 1, "bytes": 4 * 16}
    assert {k: counts["all-gather"][k] for k in ("count", "bytes")} == {"count": 1, "bytes": 4 * 64}
    assert sum(v["count"] for v in counts.values()) == 2
    np.testing.assert_array_equal(f(x), 2 * np.arange(64.0).reshape(16, 4))


def test_no_collective_for_local_work(mesh2x4):
    @spmd.spmd(mesh2x4, in_placements=[Shard(0), Shard(1)], out_placements=[Shard(0), Shard(1)])
    def f(x):
        return 2 * x + spmd.axis_index("tp")

    counts = spmd.collectives(f, jnp.ones((4, 8)))
    assert all(v["count"] == 0 for v in counts.values()), counts
    assert set(counts) == set(KINDS)


# --- the HLO parser on its own -----------------------------------------------------------
_HLO = """HloModule m, num_partitions=8
ENTRY main {
  %p = f32[16,8]{1,0} parameter(0)
  %ar = f32[16,8]{1,0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ars = bf16[32]{0} all-reduce-start(%q), replica_groups={}, to_apply=%add
  %ag = (f32[2,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%r), replica_groups=[1,8]<=[8], dimensions={0}
  %rs = f32[2,8]{1,0} reduce-scatter(%p), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %rs2 = f32[1,8]{1,0} reduce-scatter(%p), replica_groups={}, dimensions={0}, to_apply=%add
  %a2a = (s32[4]{0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, /*index=5*/s32[4]{0}) all-to-all(%a, %b), replica_groups={{0,1}}
  %cp = u8[100]{0} collective-permute-start(%s), source_target_pairs={{0,1}}
  ROOT %t = tuple()
}
"""


def test_hlo_parser():
    got = hlo_collectives(_HLO)
    assert {k: got["all-reduce"][k] for k in ("count", "bytes")} == {"count": 2, "bytes": 16 * 8 * 4 + 32 * 2}
    assert {k: got["all-gather"][k] for k in ("count", "bytes")} == {"count": 1, "bytes": 16 * 8 * 4}
    # Input of a reduce-scatter = result x group size (4 from the iota groups, 8 = all partitions).
    assert {k: got["reduce-scatter"][k] for k in ("count", "bytes")} == {"count": 2, "bytes": 2 * 8 * 4 * 4 + 1 * 8 * 4 * 8}
    assert {k: got["all-to-all"][k] for k in ("count", "bytes")} == {"count": 1, "bytes": 6 * 16}
    assert {k: got["collective-permute"][k] for k in ("count", "bytes")} == {"count": 1, "bytes": 100}
    assert hlo_collectives("HloModule empty") == {k: {"count": 0, "bytes": 0, "buffers": 0} for k in KINDS}
