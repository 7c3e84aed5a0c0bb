"""Issue 12 items 1 (64-bit and every gloo dtype), 6 (the names torch programs use) and 7 (object
types) across real processes; writes OUT_DIR/rank{r}.json. NumPy only (no torch needed).

Run with ``spmdrun --standalone --nproc-per-node 2 porting_check.py OUT_DIR`` (any world size >= 2: the
point-to-point checks run between ranks 0 and 1).
"""

import collections
import os
import sys
import time

import ml_dtypes
import numpy as np

import spmd
import spmd.distributed as dist
from _checks import Checks, raises

# item 4: under a launcher, spmd.init_device_mesh refuses a mesh of this process's devices alone, and
# dist.init_device_mesh (torch's) joins the job (init_process_group) first
world = int(os.environ["WORLD_SIZE"])
try:
    spmd.init_device_mesh("cpu", (1,))
    ALONE = "no error"
except RuntimeError as e:
    ALONE = str(e)
JOINED_BEFORE = dist.is_initialized()
MESH = dist.init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
rank = dist.get_rank()


def _same(got, want):
    if isinstance(want, np.ndarray):  # exact: same dtype, same shape, same bits
        g = np.asarray(got)
        return g.dtype == want.dtype and g.shape == want.shape and g.tobytes() == want.tobytes()
    return type(got) is type(want) and got == want


check = Checks(_same)


check("spmd.init_device_mesh before joining is refused", lambda: (
    ALONE.startswith(f"init_device_mesh: this process was started by a launcher with WORLD_SIZE={world} but has not "
                     "joined the job"), True))
check("init_device_mesh joined the job", lambda: (
    [JOINED_BEFORE, dist.is_initialized(), dist.get_world_size(), MESH.size(), len({d.process_index for d in MESH.devices.flat})],
    [False, True, world, world, world]))
check("too big a mesh under a launcher: no XLA_FLAGS advice", lambda: raises(
    lambda: spmd.init_device_mesh("cpu", (2 * world,)), ValueError,
    f"the {world} processes of this job hold {world} cpu device(s) in all: launch more processes"))
try:
    spmd.init_device_mesh("cpu", (2 * world,))
except ValueError as e:
    check("... and no XLA_FLAGS", lambda e=e: ("XLA_FLAGS" in str(e), False))

# --- item 3: distribute_tensor takes mesh rank 0's tensor (torch's src_data_rank=0)
MINE = np.random.default_rng(rank).normal(size=(2 * world, 3))  # different on every rank
RANK0 = np.random.default_rng(0).normal(size=(2 * world, 3))
check("Shard(0): every rank's rows are rank 0's", lambda: (
    np.asarray(spmd.distribute_tensor(MINE, MESH, [spmd.Shard(0)]).to_local()), RANK0[2 * rank:2 * rank + 2]))
check("Replicate: every replica is rank 0's", lambda: (
    np.asarray(spmd.distribute_tensor(MINE, MESH, [spmd.Replicate()]).to_local()), RANK0))
check("src_data_rank=1", lambda: (
    np.asarray(spmd.distribute_tensor(MINE, MESH, [spmd.Replicate()], src_data_rank=1).to_local()),
    np.random.default_rng(1).normal(size=(2 * world, 3))))
check("src_data_rank=None keeps each process's value", lambda: (
    np.asarray(spmd.distribute_tensor(MINE, MESH, [spmd.Replicate()], src_data_rank=None).to_local()), MINE))
SPECIAL = np.array([-0.0, np.nan, 5e-324, 1.0 + rank])
check("bit-exact from rank 0 (-0.0, NaN, denormal)", lambda: (
    np.asarray(spmd.distribute_tensor(SPECIAL, MESH, [spmd.Replicate()]).to_local()),
    np.array([-0.0, np.nan, 5e-324, 1.0])))
check("from_local(run_check=True): replicas take coordinate 0's tensor, as torch", lambda: (
    np.stack([np.asarray(spmd.DTensor.from_local(MINE, MESH, [spmd.Replicate()], run_check=True).to_local()),
              np.asarray(spmd.DTensor.from_local(MINE, MESH, [spmd.Replicate()]).to_local())]),
    np.stack([RANK0, MINE])))
BIG = np.arange(2 * world, dtype=np.int64) + 2 ** 50 + rank
check("int64 DTensor across processes: shards, full_tensor", lambda: (
    [np.asarray(spmd.distribute_tensor(BIG, MESH, [spmd.Shard(0)]).to_local()),
     np.asarray(spmd.distribute_tensor(BIG, MESH, [spmd.Shard(0)]).full_tensor())][1],
    np.arange(2 * world, dtype=np.int64) + 2 ** 50))
check("int64 Partial(sum) from_local -> full_tensor", lambda: (
    np.asarray(spmd.DTensor.from_local(np.array([2 ** 50 + rank]), MESH, [spmd.Partial()]).full_tensor()),
    np.array([world * 2 ** 50 + world * (world - 1) // 2])))

# --- item 1: every dtype torch's gloo takes (and int16/uint16/uint32/uint64) keeps dtype and value
DTYPES = [np.int64, np.float64, np.uint8, np.int8, np.int16, np.int32, np.float16, ml_dtypes.bfloat16, np.bool_,
          np.complex64, np.complex128, np.uint16, np.uint32, np.uint64]


def x_of(r, dt):
    dt = np.dtype(dt)
    base = np.arange(4) + r
    if dt == np.bool_:
        return (base % 2 == 0)
    if dt.kind in "iu":
        big = 2 ** 40 if dt.itemsize == 8 else 0
        return (base + big).astype(dt)
    if dt.kind == "c":
        return (base * (1 + 1e-12) + 1j * r).astype(dt)
    return (base * (1 + 1e-12) + 0.25).astype(dt)


for dt in DTYPES:
    name = np.dtype(dt).name
    xs = [x_of(r, dt) for r in range(world)]
    if np.dtype(dt) == np.bool_:
        total = np.any(np.stack(xs), 0)
    else:
        total = np.sum(np.stack(xs), 0, dtype=dt)
    check(f"{name} all_reduce sum", lambda dt=dt, total=total: (dist.all_reduce(x_of(rank, dt)), total))
    check(f"{name} broadcast", lambda dt=dt, xs=xs: (dist.broadcast(x_of(rank, dt), src=world - 1), xs[-1]))
    check(f"{name} all_gather", lambda dt=dt, xs=xs: (np.stack(dist.all_gather(None, x_of(rank, dt))), np.stack(xs)))
    if np.dtype(dt).itemsize < 8 and np.dtype(dt) not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_)):
        continue  # the other paths move bytes by width: 64-bit, bfloat16 and bool cover what differs
    if rank < 2:  # ranks 0 -> 1 (any world size)
        check(f"{name} send/recv", lambda dt=dt, xs=xs: (
            dist.recv(np.zeros(4, dt), src=0) if rank == 1 else (dist.send(x_of(rank, dt), dst=1), xs[0])[1], xs[0]))
    if np.dtype(dt).kind not in "cb":
        check(f"{name} all_reduce max", lambda dt=dt, xs=xs: (dist.all_reduce(x_of(rank, dt), op=dist.ReduceOp.MAX),
                                                              np.max(np.stack(xs), 0)))
check("float64 torch's example: 4*(1+1e-12) - 4 keeps 4e-12", lambda: (
    np.asarray(dist.all_reduce(np.array([1 + 1e-12]) * (4 / world))) - 4, np.array([4 * (1 + 1e-12) - 4])))
check("int64 2**40 + rank summed exactly", lambda: (
    dist.all_reduce(np.array([2 ** 40 + rank])), np.array([world * 2 ** 40 + world * (world - 1) // 2])))
check("int64 reduce_scatter_tensor", lambda: (
    dist.reduce_scatter_tensor(None, np.arange(2 * world, dtype=np.int64) + 2 ** 50),
    (np.arange(2 * world, dtype=np.int64)[2 * rank:2 * rank + 2] + 2 ** 50) * world))
check("int64 scatter", lambda: (
    dist.scatter(np.zeros(2, np.int64), [np.full(2, 2 ** 45 + i) for i in range(world)] if rank == 0 else None, src=0),
    np.full(2, 2 ** 45 + rank)))
check("complex MAX refused before any work", lambda: raises(
    lambda: dist.all_reduce(np.ones(2, np.complex128), op=dist.ReduceOp.MAX), (TypeError, ValueError),
    "complex"))

# --- item 7: object types
check("Counter arrives as Counter", lambda: (
    dist.all_gather_object([None] * world, collections.Counter({"r": rank}))[world - 1],
    collections.Counter({"r": world - 1})))
check("OrderedDict / deque / bytearray keep their types", lambda: (
    [type(o).__name__ for o in dist.broadcast_object_list(
        [collections.OrderedDict(a=1), collections.deque([1]), bytearray(b"x")] if rank == 0 else [None] * 3, src=0)],
    ["OrderedDict", "deque", "bytearray"]))
Point = collections.namedtuple("Point", "x y")
check("namedtuple refused with the allow_pickle hint", lambda: raises(
    lambda: dist.all_gather_object([None] * world, Point(1, 2)), TypeError, "allow_pickle=True"))

SOLO = dist.new_group([0])
if rank == 0:
    check("object collective in a group of one", lambda: (dist.all_gather_object([None], {"a": 1}, group=SOLO), [{"a": 1}]))
else:
    import warnings  # noqa: E402

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_none = [dist.all_gather_object([None], 1, group=SOLO), dist.broadcast_object_list([None], src=0, group=SOLO),
                    dist.send_object_list([1], dst=0, group=SOLO), dist.barrier(group=SOLO)]
    check("non-member object collectives warn and do nothing, as torch", lambda: (
        [got_none, dist.recv_object_list([None], group=SOLO), sum("is not a member" in str(w.message) for w in caught)],
        [[None, None, None, None], -1, 4]))

# --- item 6: the names
check("is_torchelastic_launched / get_node_local_rank", lambda: (
    [dist.is_torchelastic_launched(), dist.get_node_local_rank()],
    [os.environ.get("SPMD_TEST_BACKEND", "gloo") != "mpi", int(os.environ.get("LOCAL_RANK", rank))]))  # mpiexec: not torchelastic
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0)
if rank == 0:
    store.set("greeting", "hello from 0")
check("TCPStore set/get across ranks", lambda: (store.get("greeting"), b"hello from 0"))
check("TCPStore add is atomic across ranks", lambda: (
    (store.add("count", rank + 1), dist.barrier(), int(store.get("count")))[2], world * (world + 1) // 2))
fs = dist.PrefixStore("p", dist.FileStore("/tmp/spmd-porting-store"))
check("FileStore/PrefixStore wait + check", lambda: (
    (fs.set(f"k{rank}", str(rank)), fs.wait([f"k{r}" for r in range(world)], timeout=30),
     fs.check([f"k{r}" for r in range(world)]))[2], True))
check("Work.get_future", lambda: (dist.all_reduce(np.array([rank]), async_op=True).get_future().wait()[0],
                                  np.array([world * (world - 1) // 2])))
check("all_reduce_coalesced (one all-reduce per dtype)", lambda: (
    [np.asarray(t).tolist() for t in dist.all_reduce_coalesced([np.full(2, rank, np.float32), np.array([2 ** 40 + rank])])],
    [[float(world * (world - 1) // 2)] * 2, [world * 2 ** 40 + world * (world - 1) // 2]]))
mine, subgroups = dist.new_subgroups(group_size=1)
check("new_subgroups(1)", lambda: ([dist.get_process_group_ranks(g) for g in subgroups], [[r] for r in range(world)]))
check("collective in a subgroup of one", lambda: (dist.all_reduce(np.array([rank + 5]), group=mine), np.array([rank + 5])))
if rank == 0:
    dist.send_object_list([collections.Counter("aab"), {"to": 1}], dst=1)
    dist.send_object_list(["second"], dst=1)
    back = [None]
    check("recv_object_list(src=None) names the sender", lambda: ([dist.recv_object_list(back), back], [1, ["pong"]]))
elif rank == 1:
    got = [None, None]
    check("send/recv_object_list keep order and types", lambda: (
        [dist.recv_object_list(got, src=0), got], [0, [collections.Counter("aab"), {"to": 1}]]))
    one = [None]
    check("second message", lambda: ([dist.recv_object_list(one, src=0), one], [0, ["second"]]))
    dist.send_object_list(["pong"], dst=0)
if rank < 2:
    check("recv_object_list times out naming the sender", lambda: raises(
        lambda: dist.recv_object_list([None], src=1 - rank, timeout=0.2), TimeoutError,
        f"recv_object_list: rank {rank} waited 0.2 s for objects from rank {1 - rank}, which sent none"))
check("monitored_barrier, everyone on time", lambda: (dist.monitored_barrier(timeout=30), None))
if rank == 1:
    time.sleep(1.2)
check("monitored_barrier names the late rank", lambda: raises(
    lambda: dist.monitored_barrier(timeout=0.5), RuntimeError, "rank(s) [1] failed to pass the monitored barrier"))
with dist.CommDebugMode() as mode:
    dist.all_reduce(np.ones(3, np.float32))
    dist.all_gather(None, np.ones(3, np.int64))
    dist.barrier()
check("CommDebugMode counts what ran", lambda: (mode.get_comm_counts(), {"all-reduce": 1, "all-gather": 1}))

# DDP: ranks start from different parameters; after construction they hold rank 0's, and training on
# each rank's half of the batch gives what one process gets on the whole batch.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


def apply(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def loss_fn(p, x, y):
    return jnp.mean((apply(p, x) - y) ** 2)


def init(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (3, 4)), "b": jnp.zeros(4), "v": jax.random.normal(k2, (4, 1))}


ddp = dist.DistributedDataParallel(apply, init(100 + rank), optimizer=optax.sgd(0.1))
check("DDP broadcasts rank 0's params", lambda: (np.asarray(ddp.params["w"]), np.asarray(init(100)["w"])))
X = np.asarray(jax.random.normal(jax.random.key(7), (4 * world, 3)))
Y = np.asarray(jax.random.normal(jax.random.key(8), (4 * world, 1)))
ref, opt = init(100), optax.sgd(0.1)
ref_state = opt.init(ref)
for step in range(3):
    lo = ddp.step(loss_fn, X[4 * rank:4 * rank + 4], Y[4 * rank:4 * rank + 4])
    g = jax.grad(loss_fn)(ref, X, Y)
    upd, ref_state = opt.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, upd)
check("DDP 3 steps == one process on the whole batch", lambda: (
    bool(all(np.allclose(ddp.params[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)), True))
check("DDP forward", lambda: (bool(np.allclose(ddp(X), apply(ref, X), rtol=1e-5, atol=1e-6)), True))

check.write(sys.argv[1], rank)
dist.destroy_process_group()
