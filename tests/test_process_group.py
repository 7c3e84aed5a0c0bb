"""The seed's eager API: ProcessGroup on per-rank arrays, with the seed's six examples' numbers."""

import numpy as np
import pytest

from spmd import ReduceOp, init_device_mesh

WORLD = 4
RANKS = np.arange(WORLD)


@pytest.fixture(scope="module")
def pg():
    """torch's WORLD of 4 ranks: one block per rank on the leading axis."""
    return init_device_mesh("cpu", (WORLD,)).get_group()


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_seed_1_all_reduce(pg, dtype):
    tensor = (RANKS + 1).reshape(WORLD, 1).astype(dtype)  # torch.tensor([rank + 1])
    out = pg.allreduce(tensor, op=ReduceOp.SUM)
    np.testing.assert_array_equal(out, [[10]] * WORLD)  # [1+2+3+4] = [10] on every rank
    assert out.dtype == dtype


def test_seed_2_broadcast(pg):
    tensor = np.array([[0.0] if rank == 0 else np.zeros(1) for rank in RANKS], np.float32)
    np.testing.assert_array_equal(pg.broadcast(tensor, src=0), [[0.0]] * WORLD)
    # The same with values that tell the ranks apart.
    np.testing.assert_array_equal(pg.broadcast((RANKS + 7.0).reshape(WORLD, 1), src=2), [[9.0]] * WORLD)


def test_seed_3_all_gather(pg):
    tensor = RANKS.reshape(WORLD, 1).astype(np.int32)  # torch.tensor([rank])
    out = pg.all_gather(tensor)
    assert out.shape == (WORLD, WORLD, 1)
    for rank in RANKS:
        np.testing.assert_array_equal(out[rank], [[0], [1], [2], [3]])


def test_seed_4_reduce(pg):
    tensor = (RANKS + 1).reshape(WORLD, 1).astype(np.int32)
    out = pg.reduce(tensor, dst=0, op=ReduceOp.SUM)
    np.testing.assert_array_equal(out[0], [10])  # rank 0: [10]
    np.testing.assert_array_equal(out[1:], [[2], [3], [4]])  # the others: unchanged


def test_seed_5_scatter(pg):
    scatter_list = np.stack([np.array([i]) for i in range(WORLD)])  # rank 0's list [[0], [1], [2], [3]]
    blocks = np.zeros((WORLD, WORLD, 1), np.float32)  # the other ranks pass nothing: zeros stand in
    blocks[0] = scatter_list
    out = pg.scatter(blocks, src=0)
    np.testing.assert_array_equal(out, [[0], [1], [2], [3]])  # rank i: [i]


def test_seed_6_gather(pg):
    tensor = RANKS.reshape(WORLD, 1).astype(np.float32)
    out = pg.gather(tensor, dst=0)
    np.testing.assert_array_equal(out[0], [[0], [1], [2], [3]])  # rank 0's gather_list
    np.testing.assert_array_equal(out[1:], np.zeros((WORLD - 1, WORLD, 1)))  # the others get no list (zeros)


def test_reduce_scatter_and_all_to_all(pg):
    x = np.arange(WORLD * WORLD * 2, dtype=np.int32).reshape(WORLD, WORLD * 2)
    rs = pg.reduce_scatter(x, op="sum")
    total = x.sum(0)
    np.testing.assert_array_equal(rs, total.reshape(WORLD, 2))
    a2a = pg.all_to_all(x.reshape(WORLD, WORLD, 2))
    np.testing.assert_array_equal(a2a, x.reshape(WORLD, WORLD, 2).transpose(1, 0, 2))
    mx = pg.reduce_scatter(x, op=ReduceOp.MAX, scatter_dim=0)
    np.testing.assert_array_equal(mx, x.max(0).reshape(WORLD, 2))


def test_size_and_mesh(pg):
    assert pg.size == WORLD
    assert pg.dims == ("dim_0",)
    assert pg.mesh.shape == (WORLD,)


def test_groups_run_independently_on_a_2d_mesh(mesh2x4):
    """Along "tp" each dp row is its own group of 4; along "dp" each tp column is a group of 2."""
    rank = np.arange(8).reshape(2, 4, 1).astype(np.int32)
    np.testing.assert_array_equal(mesh2x4.get_group("tp").allreduce(rank + 1)[..., 0], [[10] * 4, [26] * 4])
    np.testing.assert_array_equal(mesh2x4.get_group("dp").allreduce(rank + 1)[..., 0], [[6, 8, 10, 12]] * 2)
    np.testing.assert_array_equal(mesh2x4.get_group().allreduce(rank + 1)[..., 0], [[36] * 4] * 2)
    g = mesh2x4.get_group("tp").all_gather(rank)
    assert g.shape == (2, 4, 4, 1)
    np.testing.assert_array_equal(g[1, 2, :, 0], [4, 5, 6, 7])
    b = mesh2x4.get_group("dp").broadcast(rank, src=1)
    np.testing.assert_array_equal(b[..., 0], [[4, 5, 6, 7]] * 2)


def test_programs_are_cached(pg):
    from spmd._program import _cached

    x = (RANKS + 1).reshape(WORLD, 1).astype(np.float32)
    pg.allreduce(x)
    before = _cached.cache_info()
    for _ in range(3):
        pg.allreduce(x)
    after = _cached.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3


def test_seed_demo_ops_from_strings(pg):
    x = (RANKS + 1).reshape(WORLD, 1).astype(np.int32)
    for op, want in [("sum", 10), ("product", 24), ("max", 4), ("min", 1), ("band", 0), ("bor", 7), ("bxor", 4)]:
        np.testing.assert_array_equal(pg.allreduce(x, op)[:, 0], [want] * WORLD, err_msg=op)
    np.testing.assert_allclose(pg.allreduce(x.astype(np.float32), "avg")[:, 0], [2.5] * WORLD)
    np.testing.assert_allclose(pg.allreduce(x.astype(np.float32), ReduceOp.PREMUL_SUM(0.5))[:, 0], [5.0] * WORLD)


@pytest.mark.slow  # the script test_examples.py::test_seed_collectives runs and checks line by line
def test_seed_collectives_example_runs():
    """examples/seed_collectives.py runs on its own (it asks for 8 CPU devices itself) and prints the
    seed's numbers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "seed_collectives.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()

    def line(prefix):
        (found,) = [ln for ln in lines if ln.startswith(prefix)]
        return found

    assert "8 cpu devices" in lines[0]
    assert line("1. all_reduce").endswith("rank 0: [10]  rank 1: [10]  rank 2: [10]  rank 3: [10]")
    assert line("2. broadcast").endswith("rank 0: [0.0]  rank 1: [0.0]  rank 2: [0.0]  rank 3: [0.0]")
    assert line("3. all_gather").count("[[0], [1], [2], [3]]") == 4
    assert line("4. reduce").endswith("rank 0: [10]  rank 1: [2]  rank 2: [3]  rank 3: [4]")
    assert line("5. scatter").endswith("rank 0: [0]  rank 1: [1]  rank 2: [2]  rank 3: [3]")
    assert "rank 0: [[0], [1], [2], [3]]  rank 1: [[0], [0], [0], [0]]" in line("6. gather")
    assert line("7. all_reduce inside @spmd").endswith("[10]")
    assert line("S(0) on").endswith("local block (2, 4) of (8, 4)")
    assert line("S(0) -> R:").endswith("True")
    assert line("P(sum) -> R").endswith("[112.0, 120.0, 128.0, 136.0]")
    assert line("S(0)S(1) on").endswith("local block (4, 1) of (8, 4)")
    assert line("S(0)S(1) -> RR:").endswith("True")
    assert "'all-gather': {'count': 2" in line("collectives of that program")


def test_group_of_a_sub_mesh(mesh2x4):
    """mesh["tp"] is the row of rank 0 (devices 0..3): its group takes one block per tp rank."""
    sub = mesh2x4["tp"]
    pg = sub.get_group()
    assert pg.size == 4 and pg.dims == ("tp",)
    out = pg.allreduce((RANKS + 1).reshape(WORLD, 1))
    np.testing.assert_array_equal(out, [[10]] * WORLD)
    assert sorted(d.id for d in out.sharding.device_set) == [0, 1, 2, 3]


def test_cached_program_does_not_let_a_bool_or_float_rank_through(pg):
    """src=0 / src=1 cached first: src=False / src=1.0 still get their own validation (issue 10.12)."""
    import re

    x = (RANKS + 1).reshape(WORLD, 1).astype(np.float32)
    np.testing.assert_array_equal(pg.broadcast(x, src=0)[:, 0], [1.0] * WORLD)
    np.testing.assert_array_equal(pg.broadcast(x, src=1)[:, 0], [2.0] * WORLD)
    with pytest.raises(TypeError, match=re.escape("broadcast: src=False must be an int rank in the group")):
        pg.broadcast(x, src=False)
    with pytest.raises(TypeError, match=re.escape("broadcast: src=1.0 must be an int rank in the group")):
        pg.broadcast(x, src=1.0)
    with pytest.raises(TypeError, match=re.escape("reduce: dst=True must be an int rank in the group")):
        pg.reduce(x, dst=True)
