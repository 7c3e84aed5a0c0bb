"""Every c10d collective against NumPy, on every rank; writes OUT_DIR/rank{r}.json.

Run with ``spmdrun --nproc-per-node N [--devices-per-proc K] collectives_check.py OUT_DIR``.
Each rank can compute every rank's input, so each checks its own result.
"""

import fractions
import json
import os
import sys
import warnings

import numpy as np

import spmd.distributed as dist
from _checks import Checks, raises

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()


def _show(x):
    if isinstance(x, (list, tuple)):
        return [_show(v) for v in x]
    return None if x is None else np.asarray(x).tolist()


def _same(got, want):
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return False
    if w.dtype.kind == "f":
        return np.allclose(g, w, rtol=1e-5, atol=1e-6)
    return np.array_equal(g, w)


check = Checks(_same, _show)


def x_of(r, dtype=np.float32, shape=(2, 3)):
    """Rank r's input."""
    base = np.arange(np.prod(shape)).reshape(shape)
    if dtype == np.bool_:
        return ((base + r) % 3 == 0)
    if np.dtype(dtype).kind in "iu":
        return ((base * (r + 1) + r) % 7 + 1).astype(dtype)
    return (base * (r + 1) + 0.5 * r).astype(dtype)


ALL = [x_of(r) for r in range(world)]
NP_OPS = {
    "sum": lambda a: np.sum(a, 0),
    "avg": lambda a: np.mean(a, 0),
    "product": lambda a: np.prod(a, 0),
    "min": lambda a: np.min(a, 0),
    "max": lambda a: np.max(a, 0),
    "band": lambda a: np.bitwise_and.reduce(a, 0),
    "bor": lambda a: np.bitwise_or.reduce(a, 0),
    "bxor": lambda a: np.bitwise_xor.reduce(a, 0),
}

# --- basics
check("rank/world/backend", lambda: ([rank, world, dist.get_backend(), dist.is_initialized()],
                                     [int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ.get("SPMD_TEST_BACKEND", "gloo"), True]))

# --- all_reduce: every op, float and int; bool; premul_sum
for op in ("sum", "avg", "product", "min", "max"):
    check(f"all_reduce {op} f32", lambda op=op: (dist.all_reduce(x_of(rank), op=getattr(dist.ReduceOp, op.upper())),
                                                  NP_OPS[op](np.stack(ALL))))
for op in ("sum", "product", "min", "max", "band", "bor", "bxor"):
    check(f"all_reduce {op} i32", lambda op=op: (dist.all_reduce(x_of(rank, np.int32), op=op),
                                                  NP_OPS[op](np.stack([x_of(r, np.int32) for r in range(world)])).astype(np.int32)))
check("all_reduce max bool", lambda: (dist.all_reduce(x_of(rank, np.bool_), op="max"),
                                      np.any(np.stack([x_of(r, np.bool_) for r in range(world)]), 0)))
check("all_reduce premul_sum", lambda: (dist.all_reduce(x_of(rank), op=dist.ReduceOp.PREMUL_SUM(0.5)),
                                        0.5 * np.sum(np.stack(ALL), 0)))
check("all_reduce scalar", lambda: (dist.all_reduce(np.float32(rank + 1)), np.float32(world * (world + 1) / 2)))
w = dist.all_reduce(x_of(rank), async_op=True)
check("all_reduce async_op", lambda: (w.result()[0] if w.wait() else None, np.sum(np.stack(ALL), 0)))

# --- in place, as torch: a writable NumPy buffer is updated (async_op too); a dropped JAX result warns
def in_place():
    t = x_of(rank).copy()
    dist.all_reduce(t)
    u = x_of(rank).copy()
    work = dist.all_reduce(u, op="max", async_op=True)
    work.wait()
    b = x_of(rank).copy()
    dist.broadcast(b, src=0)
    outs = [np.zeros((2, 3), np.float32) for _ in range(world)]
    firsts = list(outs)
    dist.all_gather(outs, x_of(rank))
    same_buffers = all(a is b for a, b in zip(outs, firsts))
    return [t, u, b, outs, same_buffers], [np.sum(np.stack(ALL), 0), np.max(np.stack(ALL), 0), ALL[0], ALL, True]
check("in place: all_reduce, async all_reduce, broadcast, all_gather buffers", in_place)


def dropped_jax_result():
    import jax.numpy as jnp
    x = jnp.asarray(x_of(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_reduce(x)  # noqa: the dropped result is the point
        y = dist.all_reduce(x)
    kinds = [w.category.__name__ for w in caught]
    return [kinds, y], [["DiscardedResultWarning"], np.sum(np.stack(ALL), 0)]
check("dropped result of a jax input warns once", dropped_jax_result)


def bad_op_on_one_rank():
    # validated before any communication: the same TypeError as in one process, on that rank only
    if rank != world - 1:
        return True, True
    return raises(lambda: dist.all_reduce(x_of(rank, np.int32), op="avg"), TypeError, "all_reduce")
check("bad op on one rank raises TypeError before communicating", bad_op_on_one_rank)

# --- broadcast from every source, bit-exact
for src in range(world):
    check(f"broadcast src={src}", lambda src=src: (dist.broadcast(x_of(rank), src=src), ALL[src]))
check("broadcast int", lambda: (dist.broadcast(x_of(rank, np.int32), src=world - 1), x_of(world - 1, np.int32)))

# --- all_gather
tl = [None] * world
check("all_gather list", lambda: (dist.all_gather(tl, x_of(rank)), ALL))
check("all_gather fills list", lambda: (tl, ALL))
check("all_gather_into_tensor cat", lambda: (dist.all_gather_into_tensor(None, x_of(rank)), np.concatenate(ALL, 0)))
check("all_gather_into_tensor stacked", lambda: (dist.all_gather_into_tensor(np.zeros((world, 2, 3)), x_of(rank)), np.stack(ALL)))

# --- reduce
dst = world - 1
check("reduce sum", lambda: (dist.reduce(x_of(rank), dst=dst), np.sum(np.stack(ALL), 0) if rank == dst else ALL[rank]))
check("reduce max", lambda: (dist.reduce(x_of(rank), dst=0, op=dist.ReduceOp.MAX), np.max(np.stack(ALL), 0) if rank == 0 else ALL[rank]))

# --- scatter / gather
src = 1 % world
pieces = [x_of(10 + i) for i in range(world)]
check("scatter", lambda: (dist.scatter(np.zeros((2, 3), np.float32), pieces if rank == src else None, src=src), pieces[rank]))
check("gather", lambda: (dist.gather(x_of(rank), [None] * world if rank == dst else None, dst=dst), ALL if rank == dst else []))

# --- reduce_scatter
ins = lambda r: [x_of(r * world + j) for j in range(world)]  # noqa: E731
check("reduce_scatter sum", lambda: (dist.reduce_scatter(None, ins(rank)), np.sum([ins(r)[rank] for r in range(world)], 0)))
check("reduce_scatter max", lambda: (dist.reduce_scatter(None, ins(rank), op="max"), np.max([ins(r)[rank] for r in range(world)], 0)))
big = lambda r: x_of(r, shape=(2 * world, 3))  # noqa: E731
check("reduce_scatter_tensor sum", lambda: (dist.reduce_scatter_tensor(None, big(rank)),
                                           np.sum([big(r) for r in range(world)], 0)[2 * rank: 2 * rank + 2]))
check("reduce_scatter_tensor avg", lambda: (dist.reduce_scatter_tensor(None, big(rank), op=dist.ReduceOp.AVG),
                                           np.mean([big(r) for r in range(world)], 0)[2 * rank: 2 * rank + 2]))

# --- all_to_all
check("all_to_all", lambda: (dist.all_to_all([None] * world, ins(rank)), [ins(r)[rank] for r in range(world)]))
check("all_to_all_single", lambda: (dist.all_to_all_single(None, big(rank)),
                                   np.concatenate([big(r)[2 * rank: 2 * rank + 2] for r in range(world)], 0)))

# --- point to point
nxt, prv = (rank + 1) % world, (rank - 1) % world
if world > 1:
    def ring():
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x_of(rank), nxt), dist.P2POp(dist.irecv, np.zeros((2, 3), np.float32), prv)])
        return works[1].tensor, ALL[prv]
    check("batch_isend_irecv ring", ring)

    def pairs():
        peer = rank ^ 1
        if peer >= world:
            return None, None
        if rank % 2 == 0:
            dist.send(x_of(rank), dst=peer)
            return dist.recv(np.zeros((2, 3), np.float32), src=peer), ALL[peer]
        got = dist.recv(np.zeros((2, 3), np.float32), src=peer)
        dist.send(x_of(rank), dst=peer)
        return got, ALL[peer]
    check("send/recv pairs", pairs)

    def isend_irecv():
        a = dist.isend(x_of(rank, np.int32), dst=nxt)
        b = dist.irecv(np.zeros((2, 3), np.int32), src=prv)
        a.wait()
        b.wait()
        return b.tensor, x_of(prv, np.int32)
    check("isend/irecv", isend_irecv)

# --- groups
if world >= 2:
    members = [0, world - 1]
    g = dist.new_group(members)
    check("new_group rank/size", lambda: ([dist.get_rank(g), dist.get_world_size(g)],
                                          [members.index(rank), 2] if rank in members else [-1, -1]))
    if rank in members:
        check("group all_reduce", lambda: (dist.all_reduce(x_of(rank), group=g), ALL[0] + ALL[world - 1]))
        check("group broadcast", lambda: (dist.broadcast(x_of(rank), src=world - 1, group=g), ALL[world - 1]))
        check("group all_gather", lambda: (dist.all_gather(None, x_of(rank), group=g), [ALL[0], ALL[world - 1]]))
        dist.barrier(group=g)
    else:
        def non_member():  # torch: a warning, nothing done, None
            t = x_of(rank)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = dist.all_reduce(t, group=g)
            warned = [str(w.message) for w in caught if issubclass(w.category, dist.NotAMemberWarning)]
            return [got is None, len(warned), np.array_equal(t, x_of(rank))], [True, 1, True]
        check("group non-member warns and does nothing", non_member)
if world == 4:
    g2 = dist.new_group([1, 2, 3])
    if rank != 0:
        check("group of 3 reduce_scatter", lambda: (dist.reduce_scatter(None, [x_of(j) for j in range(3)], group=g2),
                                                    3 * x_of(rank - 1)))

# --- objects
obj = {"rank": rank, "t": (rank, "x"), "a": np.arange(3) * rank, 5: [1.5, None, b"\x00\x01"], "s": {rank}}
check("all_gather_object", lambda: (json.dumps(repr(dist.all_gather_object([None] * world, obj))),
                                    json.dumps(repr([{"rank": r, "t": (r, "x"), "a": np.arange(3) * r, 5: [1.5, None, b"\x00\x01"], "s": {r}} for r in range(world)]))))
check("broadcast_object_list", lambda: (repr(dist.broadcast_object_list([rank, {"k": rank}], src=world - 1)),
                                       repr([world - 1, {"k": world - 1}])))
check("gather_object", lambda: (repr(dist.gather_object(rank * 10, None, dst=0)), repr([r * 10 for r in range(world)] if rank == 0 else None)))
check("scatter_object_list", lambda: (repr(dist.scatter_object_list([None], [f"to{r}" for r in range(world)] if rank == 0 else None, src=0)), repr(f"to{rank}")))
check("all_gather_object pickle opt-in", lambda: (repr(dist.all_gather_object(None, fractions.Fraction(rank, 7), allow_pickle=True)),
                                                  repr([fractions.Fraction(r, 7) for r in range(world)])))

check("all_gather_object refuses non-JSON", lambda: raises(
    lambda: dist.all_gather_object(None, fractions.Fraction(1, 3)), TypeError, "allow_pickle=True"))

dist.barrier()
check.write(sys.argv[1], rank)
dist.destroy_process_group()
