"""What backend="mpi" adds to the shared checks; writes OUT_DIR/rank{r}.json.

Run with ``mpiexec -n 4 python mpi_check.py OUT_DIR`` (``-`` as OUT_DIR: join and stop). NaN and -0.0
through MAX / MIN (every float dtype), AVG / PREMUL_SUM on narrow floats, 64-bit values, jax / torch
inputs, tagged isend / irecv as MPI requests, overlapping groups as communicators, a mismatched recv,
and ``@spmd`` / DTensor programs across the MPI ranks (their collectives on gloo).
"""

import sys

import jax
import ml_dtypes
import numpy as np

import spmd
import spmd.distributed as dist
from _checks import Checks, raises

dist.init_process_group("mpi")
if sys.argv[1] == "-":
    sys.exit(0)
from mpi4py import MPI  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()


def _same(got, want):
    if isinstance(want, np.ndarray):  # exact: dtype, shape and bits (NaN and -0.0 included)
        g = np.asarray(got)
        return g.dtype == want.dtype and g.shape == want.shape and g.tobytes() == want.tobytes()
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return type(got) is type(want) and got == want


check = Checks(_same, lambda x: repr(x))
check("rank/world from MPI", lambda: ([rank, world, dist.get_backend()],
                                      [MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), "mpi"]))

# --- MAX / MIN keep NaN, order -0.0 < +0.0, on every float dtype (MPI's own float MAX does neither)
for dt in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
    name = np.dtype(dt).name
    v = np.array([1.0 + rank, -0.0 if rank else 0.0, -1.0 - rank, 2.0], dt)
    if rank == 1:
        v[3] = np.nan
    want_max = np.array([float(world), 0.0, -1.0, np.nan], dt)
    want_min = np.array([1.0, -0.0, -float(world), np.nan], dt)
    check(f"all_reduce max keeps NaN {name}", lambda v=v, w=want_max: (dist.all_reduce(v.copy(), op="max"), w))
    check(f"all_reduce min keeps NaN {name}", lambda v=v, w=want_min: (dist.all_reduce(v.copy(), op="min"), w))
    check(f"reduce max keeps NaN {name}", lambda v=v, w=want_max: (
        dist.reduce(v.copy(), dst=world - 1, op="max"), w if rank == world - 1 else v))
    check(f"avg {name}", lambda dt=dt: (dist.all_reduce(np.full(3, 2.0 * (rank + 1), dt), op="avg"),
                                        np.full(3, world + 1.0, dt)))
    check(f"premul_sum {name}", lambda dt=dt: (dist.all_reduce(np.full(3, 4.0, dt), op=dist.ReduceOp.PREMUL_SUM(0.25)),
                                               np.full(3, float(world), dt)))
check("reduce_scatter_tensor max keeps NaN", lambda: (
    dist.reduce_scatter_tensor(None, np.where(np.arange(2 * world) == rank, np.nan, rank).astype(np.float32), op="max"),
    np.array([np.nan, np.nan], np.float32) if 2 * rank < world else np.full(2, world - 1, np.float32)))
check("int64 sum exact", lambda: (dist.all_reduce(np.array([2 ** 50 + rank, -(2 ** 60)], np.int64)),
                                  np.array([world * 2 ** 50 + world * (world - 1) // 2, -(2 ** 60) * world], np.int64)))
check("uint64 bxor", lambda: (dist.all_reduce(np.array([2 ** 63 + rank], np.uint64), op="bxor"),
                              np.array([np.bitwise_xor.reduce([2 ** 63 + r for r in range(world)], dtype=np.uint64)], np.uint64)))
check("bool product is and", lambda: (dist.all_reduce(np.array([True, rank != 1]), op="product"), np.array([True, False])))
check("complex sum", lambda: (dist.all_reduce(np.array([1 + 1j * rank], np.complex64)),
                              np.array([world + 1j * world * (world - 1) / 2], np.complex64)))
check("bfloat16 broadcast bit for bit", lambda: (
    dist.broadcast(np.array([np.nan, -0.0, rank], ml_dtypes.bfloat16), src=2),
    np.array([np.nan, -0.0, 2], ml_dtypes.bfloat16)))
check("avg on ints refused before communicating", lambda: raises(
    lambda: dist.all_reduce(np.ones(2, np.int32), op="avg"), TypeError, "AVG only on floating inputs"))

# --- jax in, jax out (64-bit kept); in place on NumPy / torch buffers
x64 = jax.numpy.asarray(np.float32([rank]))
check("jax input gives a jax.Array", lambda: ([type(dist.all_reduce(x64)).__name__ == "ArrayImpl"
                                               or isinstance(dist.all_reduce(x64), jax.Array)], [True]))
check("jax input value", lambda: (np.asarray(dist.all_reduce(x64)), np.float32([world * (world - 1) / 2])))


def in_place_numpy():
    t = np.full((2, 2), rank, np.float64)
    same = dist.all_reduce(t, op="max") is t
    g = np.zeros((world, 3), np.int32)
    dist.all_gather_into_tensor(g, np.full(3, rank, np.int32))
    return [same, t, g], [True, np.full((2, 2), world - 1.0), np.repeat(np.arange(world, dtype=np.int32)[:, None], 3, 1)]
check("in place on NumPy buffers", in_place_numpy)

try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    def in_place_torch():
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        b = torch.zeros(2, dtype=torch.int64) + rank
        dist.broadcast(b, src=1)
        w = dist.all_reduce(u := torch.ones(2, dtype=torch.bfloat16), async_op=True)
        w.wait()
        return [t.numpy(), b.numpy(), u.float().numpy()], [
            np.full(3, world * (world - 1) / 2, np.float32), np.array([1, 1], np.int64), np.full(2, world, np.float32)]
    check("in place on torch tensors (bfloat16 async too)", in_place_torch)

# --- async_op=True: MPI requests in flight together, waited for in any order
def in_flight():
    a, b = np.full(4, rank, np.float32), np.full(2, rank, np.int64)
    g = np.zeros(world * 2, np.float32)
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.broadcast(b, src=world - 1, async_op=True)
    wg = dist.all_gather_into_tensor(g, np.full(2, rank, np.float32), async_op=True)
    pending = [not w.is_completed() for w in (wa, wb, wg)]
    for w in (wg, wb, wa):
        w.wait()
    return [pending, a, b, g, wa.result()[0] is a], [
        [True, True, True], np.full(4, world * (world - 1) / 2, np.float32), np.full(2, world - 1, np.int64),
        np.repeat(np.arange(world, dtype=np.float32), 2), True]
check("async collectives in flight together", in_flight)


def async_lists():
    """The list collectives (and the calls with a step after the transfer) as MPI requests: every rank but the
    last starts them all and only then tells the last rank, which starts its own after hearing from every other
    rank. Were a call to wait for its peers, the others would never tell: the last rank gives up after 20 s
    (the check fails) and calls anyway, so nothing hangs."""
    import time

    last, comm = world - 1, MPI.COMM_WORLD
    heard = []
    if rank == last:
        flags = np.zeros(last, np.int32)
        reqs = [comm.Irecv(flags[r:r + 1], source=r, tag=901) for r in range(last)]
        deadline = time.monotonic() + 20
        while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
            time.sleep(0.005)
        heard = [bool(MPI.Request.Testall(reqs))]
    lst, out_s, out_rs = [np.zeros(2, np.float32) for _ in range(world)], np.zeros(3), np.zeros(2, np.int64)
    ga = [np.zeros(2, np.int32) for _ in range(world)]
    entries = list(lst)
    avg_buf = np.full(2, 2.0 * rank, np.float32)
    nan_in = jax.numpy.asarray(np.array([rank, np.nan if rank == 1 else 0.0], np.float32))
    works = [
        dist.all_gather(lst, np.array([rank, 10 * rank], np.float32), async_op=True),
        dist.all_gather(None, np.array([2 ** 40 + rank], np.int64), async_op=True),
        dist.gather(np.full(2, rank, np.int32), ga if rank == 1 else None, dst=1, async_op=True),
        dist.scatter(out_s, [np.full(3, 100.0 + i) for i in range(world)] if rank == 2 else None, src=2, async_op=True),
        dist.reduce_scatter(out_rs, [np.full(2, rank * i, np.int64) for i in range(world)], async_op=True),
        dist.all_to_all(None, [np.array([10 * rank + j]) for j in range(world)], async_op=True),
        dist.all_reduce(avg_buf, op="avg", async_op=True),
        dist.all_reduce(nan_in, op="max", async_op=True),
    ]
    pending = [not w.is_completed() for w in works]
    if rank != last:
        comm.Isend(np.ones(1, np.int32), dest=last, tag=901).Wait()
    for w in reversed(works):
        w.wait()
    if rank == last:
        MPI.Request.Waitall(reqs)
    got = [w.result()[0] for w in works]
    got[-1] = [type(got[-1]).__name__ == "ArrayImpl" or isinstance(got[-1], jax.Array), np.asarray(got[-1])]
    return [heard, pending, got, [got[0] is lst, all(a is b for a, b in zip(lst, entries)), got[3] is out_s,
                                  got[4] is out_rs, got[6] is avg_buf, got[2] is ga if rank == 1 else got[2] == []]], [
        [True] if rank == last else [], [True] * len(works), [
            [np.array([r, 10 * r], np.float32) for r in range(world)],
            [np.array([2 ** 40 + r], np.int64) for r in range(world)],
            [np.full(2, r, np.int32) for r in range(world)] if rank == 1 else [],
            np.full(3, 100.0 + rank),
            np.full(2, rank * world * (world - 1) // 2, np.int64),
            [np.array([10 * j + rank]) for j in range(world)],
            np.full(2, world - 1.0, np.float32),
            [True, np.array([world - 1, np.nan], np.float32)]],
        [True] * 6]
check("async list collectives return before the peers call", async_lists)

# --- point to point: MPI requests, tags match out of order, a mismatched size is refused
nxt, prv = (rank + 1) % world, (rank - 1) % world
def tagged():
    a = dist.isend(np.full(2, 10 * rank + 1, np.int64), dst=nxt, tag=1)
    b = dist.isend(np.full(2, 10 * rank + 2, np.int64), dst=nxt, tag=2)
    r2 = dist.irecv(np.zeros(2, np.int64), src=prv, tag=2)
    r1 = dist.irecv(np.zeros(2, np.int64), src=prv, tag=1)
    for w in (r1, r2, a, b):
        w.wait()
    return [r1.tensor, r2.tensor], [np.full(2, 10 * prv + 1, np.int64), np.full(2, 10 * prv + 2, np.int64)]
check("isend/irecv tags match out of order", tagged)


def bigger_recv():
    if rank == 0:
        dist.send(np.ones(2, np.float32), dst=1)
        return True, True
    if rank == 1:
        return raises(lambda: dist.recv(np.zeros(3, np.float32), src=0), dist.PeerError, "received 8 bytes")
    return True, True
check("recv into a bigger buffer is refused", bigger_recv)

# --- groups as communicators: overlapping groups, created by their members only
g01, g12 = dist.new_group([0, 1]), dist.new_group([1, 2])
if rank in (0, 1):
    check("group [0,1] all_reduce", lambda: (dist.all_reduce(np.array([rank + 1]), group=g01), np.array([3])))
if rank in (1, 2):
    check("group [1,2] all_gather", lambda: (dist.all_gather(None, np.array([rank]), group=g12), [np.array([1]), np.array([2])]))
g023 = dist.new_group([0, 2, 3])
if rank in (0, 2, 3):
    check("group [0,2,3] broadcast from global rank 3", lambda: (dist.broadcast(np.array([rank]), src=3, group=g023),
                                                                 np.array([3])))
    dist.barrier(group=g023)
    check("object collectives in a group (1 MB, MPI bytes)", lambda: (
        [dist.broadcast_object_list([b"x" * (1 << 20) if rank == 0 else None], src=0, group=g023)[0][-3:],
         dist.all_gather_object(None, {"r": rank, "b": bytes(rank)}, group=g023)],
        [b"xxx", [{"r": r, "b": bytes(r)} for r in (0, 2, 3)]]))
mine, _ = dist.new_subgroups(group_size=2)
check("subgroups of 2 all_reduce", lambda: (dist.all_reduce(np.array([rank]), group=mine),
                                            np.array([(rank // 2) * 4 + 1])))

# --- @spmd and DTensor across the MPI ranks (XLA's collectives on gloo)
mesh = spmd.init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
G = np.arange(world * 3, dtype=np.float32).reshape(world, 3)
dt = spmd.DTensor.from_local(G[rank:rank + 1], mesh, [spmd.Shard(0)])
summed = spmd.spmd(lambda b: spmd.all_reduce(b, "sum", group="x"), mesh, in_placements=[spmd.Shard(0)],
                   out_placements=[spmd.Replicate()])
check("@spmd psum across the MPI ranks", lambda: (np.asarray(summed(dt).addressable_data(0)), G.sum(0, keepdims=True)))
check("DTensor full_tensor", lambda: (np.asarray(dt.full_tensor()), G))
def late_barrier():
    if rank == world - 1:
        import time
        time.sleep(1.0)
        dist.barrier()  # the one the others gave up on
        return True, True
    return raises(lambda: dist.barrier(timeout=0.3), TimeoutError, "waited 0.3 s at a barrier of Group(WORLD)")
check("barrier (MPI_Ibarrier) times out naming its limit", late_barrier)
check("all_gather_object", lambda: (repr(dist.all_gather_object(None, {"r": rank})), repr([{"r": r} for r in range(world)])))

def listeners():
    """Every socket this process listens on (alone: not the launcher's, which it inherits) is on loopback."""
    import os
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        return "no ss here", "no ss here"
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=20).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line and line.count("pid=") == 1]
    bad = [a for a in mine if not a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") in ("127.0.0.1", "::1")]
    return [bool(mine), bad], [True, []]
check("this rank listens on loopback only", listeners)

dist.barrier()
check.write(sys.argv[1], rank)
dist.destroy_process_group()
