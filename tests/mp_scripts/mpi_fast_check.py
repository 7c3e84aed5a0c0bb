"""backend="mpi"'s fast path and async requests, and the launch checks of a re-joined group; writes
OUT_DIR/rank{r}.json. Run under ``mpi_run.py`` (any world size >= 2).

Repeated eager calls on the same buffers (the cached MPI call of ``spmd.distributed._mpi_fast``) give
NumPy's values call after call, are numbered as the full path numbers them, and step aside for
CommDebugMode; every async collective is an MPI request whose ``wait()`` gives NumPy's values; then
the group is joined again with a wrong ``WORLD_SIZE`` (refused), and with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
where a mismatched op on a call the fast path would have made is refused on every rank.
"""

import os
import sys

import numpy as np

import spmd
import spmd.distributed as dist
from _checks import Checks, raises
from spmd.distributed import _guard, _mpi_fast

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
rng = np.random.default_rng(0)  # the same stream on every rank: each rank computes every rank's input


def _same(got, want):
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, np.ndarray):
        return np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
    return type(got) is type(want) and got == want


check = Checks(_same)


def inputs(step, shape, dtype=np.float32):
    """Every rank's input of call ``step``, by rank (integers stored in ``dtype``: sums are exact)."""
    r = np.random.default_rng(step)
    return [r.integers(-50, 50, size=shape).astype(dtype) for _ in range(world)]


def repeated():
    """Five calls of each collective on the same buffers: each call's values, the cache's entries."""
    got, want = [], []
    t = np.empty(6, np.float32)
    g = np.empty((world, 3), np.int64)
    rs = np.empty(2, np.float64)
    a2a = np.empty(world, np.int32)
    b = np.empty(5, np.int16)
    for step in range(5):
        xs = inputs(step, 6)
        t[:] = xs[rank]
        got.append(dist.all_reduce(t) is t)
        want.append(True)
        got.append(t.copy())
        want.append(np.sum(xs, axis=0))
        ys = inputs(100 + step, 3, np.int64)
        got.append(dist.all_gather_into_tensor(g, ys[rank]).copy())
        want.append(np.stack(ys))
        zs = inputs(200 + step, 2 * world, np.float64)
        got.append(dist.reduce_scatter_tensor(rs, zs[rank], op=dist.ReduceOp.PRODUCT).copy())
        want.append(np.prod(zs, axis=0)[2 * rank:2 * rank + 2])
        ws = inputs(300 + step, world, np.int32)
        got.append(dist.all_to_all_single(a2a, ws[rank]).copy())
        want.append(np.array([ws[r][rank] for r in range(world)], np.int32))
        vs = inputs(400 + step, 5, np.int16)
        b[:] = vs[rank]
        got.append(dist.broadcast(b, src=world - 1).copy())
        want.append(vs[world - 1])
    names = sorted({k[0] for k in _mpi_fast._ENTRIES})
    return got + [names], want + [["all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast",
                                   "reduce_scatter_tensor"]]
check("repeated calls on one buffer: NumPy's values every call, from the cache", repeated)


def numbered():
    """The cached calls take their numbers from the group's counter, as the full path does."""
    wd = _guard._WATCHDOG
    ranks = tuple(range(world))
    before = wd.counter(ranks)
    x = np.ones(3, np.float32)
    dist.all_reduce(x)
    dist.all_reduce(x)
    n0 = next(before)  # the next number, drawn: the full path's next call gets n0 + 1
    dist.all_reduce(x.astype(np.float64))  # a new shape/dtype: the full path
    n1 = next(before)
    dist.all_reduce(x)
    n2 = next(before)
    return [n1 - n0, n2 - n1, x], [2, 2, np.full(3, float(world) ** 3, np.float32)]
check("cached calls are numbered in the group's sequence", numbered)


def steps_aside():
    """Inside CommDebugMode every call is counted (the full path); MAX of floats (a step after the
    transfer) and a read-only array are never cached and still right."""
    x = np.full(4, rank, np.float32)
    dist.all_reduce(x)
    with dist.CommDebugMode() as mode:
        dist.all_reduce(x)
        dist.all_reduce(x)
    m = np.array([rank, -rank, np.nan if rank == 1 else 0.0, 1, 1], np.float32)
    outs = [dist.all_reduce(m.copy(), op="max") for _ in range(3)]
    ro = np.ones(2, np.float32)
    ro.flags.writeable = False
    r2 = [dist.all_reduce(ro) for _ in range(3)]
    keys = {k for k in _mpi_fast._ENTRIES if k[0] == "all_reduce" and k[2] in ((5,), (2,))}
    s = world * (world - 1) / 2
    return ([mode.get_total_counts(), x, *outs, *r2, len(keys), ro],
            [2, np.full(4, s * world * world, np.float32), *[np.array([world - 1, 0, np.nan, 1, 1], np.float32)] * 3,
             *[np.full(2, world, np.float32)] * 3, 0, np.ones(2, np.float32)])
check("CommDebugMode, MAX of floats and read-only arrays take the full path", steps_aside)


def torch_tensors():
    """CPU torch tensors take the cached calls too (their NumPy views); a tensor that requires grad, a view of
    another and a bfloat16 one take the full path, with the same values."""
    try:
        import torch
    except ImportError:
        return True, True
    t = torch.zeros(5, dtype=torch.float64)
    g = torch.zeros(world, 2, dtype=torch.int32)
    sums, gathered = [], []
    for step in range(3):
        xs = inputs(600 + step, 5, np.float64)
        t.copy_(torch.from_numpy(xs[rank]))
        dist.all_reduce(t)
        sums.append(t.numpy().copy())
        ys = inputs(700 + step, 2, np.int32)
        dist.all_gather_into_tensor(g, torch.from_numpy(ys[rank]))
        gathered.append(g.numpy().copy())
    cached = sorted(k[0] for k in _mpi_fast._ENTRIES
                    if (k[1], k[2]) in ((np.dtype(np.float64), (5,)), (np.dtype(np.int32), (world, 2))))
    big = torch.zeros(4)
    view = big[:2]
    bf = torch.ones(3, dtype=torch.bfloat16)
    for _ in range(2):
        view.fill_(1.0)
        dist.all_reduce(view)
        dist.all_reduce(bf)
    return ([sums, gathered, cached, big.numpy(), bf.float().numpy()],
            [[np.sum(inputs(600 + s, 5, np.float64), 0) for s in range(3)],
             [np.stack(inputs(700 + s, 2, np.int32)) for s in range(3)], ["all_gather_into_tensor", "all_reduce"],
             np.array([world, world, 0, 0], np.float32), np.full(3, float(world) ** 2, np.float32)])
check("torch tensors: cached calls on their NumPy views, the full path for views / bfloat16", torch_tensors)


# --- async_op=True: an MPI request per call, in flight together, NumPy's values at wait()
def async_all():
    xs, ys, zs, ws = inputs(500, 4), inputs(501, 2, np.int64), inputs(502, 2 * world, np.float64), inputs(503, world)
    vs, us = inputs(504, 3, np.int32), inputs(505, 3, np.int64)
    u = us[rank].copy()
    a = xs[rank].copy()
    g = np.empty(2 * world, np.int64)
    rs = np.empty(2, np.float64)
    t = np.empty(world, np.float32)
    b = vs[rank].copy()
    works = [dist.all_reduce(a, async_op=True), dist.all_gather_into_tensor(g, ys[rank], async_op=True),
             dist.reduce_scatter_tensor(rs, zs[rank], async_op=True),
             dist.all_to_all_single(t, ws[rank], async_op=True), dist.broadcast(b, src=0, async_op=True),
             dist.all_reduce(np.full(2, 2.0 * rank, np.float32), op="avg", async_op=True),
             dist.reduce(u, dst=world - 1, async_op=True)]
    pending = [not w.is_completed() for w in works[:5] + works[6:]]
    for w in reversed(works):
        w.wait()
    return ([pending, a, g, rs, t, b, works[5].result()[0], works[0].result()[0] is a, u, works[6].result()[0] is u],
            [[True] * 6, np.sum(xs, 0), np.concatenate(ys), np.sum(zs, 0)[2 * rank:2 * rank + 2],
             np.array([ws[r][rank] for r in range(world)], np.float32), vs[0], np.full(2, world - 1.0, np.float32),
             True, np.sum(us, 0) if rank == world - 1 else us[rank], True])
check("async collectives: MPI requests, NumPy's values at wait()", async_all)
dist.destroy_process_group()

# --- joining again: a WORLD_SIZE that disagrees with MPI is refused on every rank
os.environ["WORLD_SIZE"] = str(world + 1)
check("WORLD_SIZE disagreeing with the MPI launch is refused", lambda: raises(
    dist.init_process_group, ValueError,
    f"init_process_group: the environment variable WORLD_SIZE={world + 1} disagrees with the MPI launch "
    f"(world size {world}); unset WORLD_SIZE under mpiexec"))
os.environ["WORLD_SIZE"] = str(world)

# --- DETAIL: every call is checked across ranks, the fast path is off
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
dist.init_process_group()
x = np.ones(4, np.float32)
for _ in range(3):
    dist.all_reduce(x)
check("DETAIL: nothing cached", lambda: ([len(_mpi_fast._ENTRIES), x], [0, np.full(4, float(world) ** 3, np.float32)]))
mine_op = "sum" if rank == 0 else "product"
check("DETAIL: a mismatched op on a repeated call is refused on every rank", lambda: raises(
    lambda: dist.all_reduce(x, op=mine_op), ValueError,
    f"all_reduce: the ranks of Group(WORLD) disagree on call #"))
del os.environ["TORCH_DISTRIBUTED_DEBUG"]
dist.barrier()
check.write(sys.argv[1], rank)
dist.destroy_process_group()
