"""Collectives whose ranks disagree after the group's first call: ``fingerprint_check.py OUT_DIR [off|mixed]``.

Every rank makes the same good calls, then, at a warm call, a call that differs on the last rank (the op,
the shape, the dtype, the collective); each must raise a ValueError on every rank naming each rank's call,
leave the tensors as they were (no data moved) and leave the group usable (the next good call is right).
With ``off`` the job runs with ``init_process_group(check_collectives=False)``: the same op mismatch
raises nothing; with ``mixed`` rank 0 checks and rank 1 does not, and both refuse to join. Written for 2
ranks; runs on gloo (spmdrun) and mpi (mpi_run.py).
"""

import os
import sys

import numpy as np

import spmd.distributed as dist
from _checks import Checks, raises

out_dir = sys.argv[1]
off = sys.argv[2:] == ["off"]
check = Checks(lambda got, want: got == want)
if sys.argv[2:] == ["mixed"]:  # the ranks' settings differ: every rank refuses to join, naming who checks
    from jax._src import distributed as jdist

    rank = int(os.environ["RANK"])
    fresh = jdist.global_state.client is None  # the join starts JAX's runtime (mpi_run.py chains jobs in one process)
    check("mixed settings refused", lambda: raises(
        lambda: dist.init_process_group(check_collectives=rank == 0), ValueError,
        "init_process_group: the ranks disagree on check_collectives: ranks [0] check every collective, ranks [1] "
        "do not (init_process_group(check_collectives=...), else SPMD_CHECK_COLLECTIVES); a rank that checks would "
        "pair its fingerprint with another rank's data. Give every rank the same setting."))
    check("not joined after the refusal", lambda: (dist.is_initialized(), False))
    # the runtime the refused join started is shut down (one started before it is left as it was)
    check("runtime as before the refusal", lambda: (jdist.global_state.client is None, fresh))
    if fresh:  # the runtime is gone: a new join says so (JAX's runtime does not start twice in one process)
        check("no join after the shutdown", lambda: raises(
            lambda: dist.init_process_group(check_collectives=rank == 0), RuntimeError,
            f"init_process_group: JAX's distributed runtime of this process (rank {rank} of 2) was shut down (after "
            "a refused join, or by jax.distributed.shutdown()); it cannot be started again in one process: start a "
            "new process."))
    check.write(out_dir, rank)
    sys.exit(0)
dist.init_process_group(check_collectives=False if off else None)
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2, "written for 2 ranks"
last = rank == world - 1
G = "Group(WORLD)"


def sig(name, *, shape=(4,), dtype="float32", **opts):
    parts = [f"{k}={v}" for k, v in opts.items()] + [f"dtype={dtype}", f"shape={shape}"]
    return f"{name}({', '.join(parts)})"


def disagree(fn, seq, r0, r1, before, moves=False):
    """``fn()`` raises the mismatch's ValueError naming rank 0's call ``r0`` and rank 1's ``r1``; the
    tensor ``before`` returns is unchanged (unless ``moves``: an async call on mpi starts its transfer before the
    fingerprints are compared; on gloo the async call runs the checked program, which moves nothing)."""
    x, want = before()
    try:
        fn(x)
    except ValueError as e:
        says = (f"the ranks of {G} disagree on call #{seq} (seen on rank {rank}): rank 0 called {r0}; rank 1 called "
                f"{r1}. Every rank of the group must call the same collectives in the same order, with the same op, "
                "src/dst, dtype and shape; no data was exchanged. (Every call is checked; "
                "init_process_group(check_collectives=False) or SPMD_CHECK_COLLECTIVES=0 turns the check off.)")
        return (says if says in str(e) else str(e), moves or bool(np.array_equal(x, want))), (says, True)
    return "no error", "a ValueError"


def ones(shape=(4,), dtype=np.float32):
    x = np.full(shape, rank + 1, dtype)
    return x, x.copy()


good = np.full(4, 3.0, np.float32)  # 1 + 2
for i in range(3):  # calls #0..#2: the group's first call (checked through the coordination service) and warm ones
    check(f"good all_reduce #{i}", lambda: (dist.all_reduce(ones()[0]).tolist(), good.tolist()))

if off:
    def mixed():
        x = ones()[0]
        dist.all_reduce(x, op=dist.ReduceOp.MAX if last else dist.ReduceOp.SUM)
        return "no error", "no error"

    check("off: a different op raises nothing", mixed)
    check("off: the state says so", lambda: (dist._state.current().check_collectives, False))
    dist.destroy_process_group()  # joining again reuses the runtime (it failed on gloo: backends already set up)
    dist.init_process_group(check_collectives=False)
    check("off: joined again after destroy", lambda: (dist.all_reduce(ones()[0]).tolist(), good.tolist()))
    check.write(out_dir, rank)
    dist.destroy_process_group()
    sys.exit(0)

# call #3: the case: sum on rank 0, max on rank 1, on a warm call (the fast path on mpi for rank 0)
check("op differs", lambda: disagree(
    lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX if last else dist.ReduceOp.SUM), 3,
    sig("all_reduce", op="sum"), sig("all_reduce", op="max"), ones))
check("usable after op differs", lambda: (dist.all_reduce(ones()[0]).tolist(), good.tolist()))  # call #4
# call #5: a warm shape mismatch names both shapes (it was blamed on a dead rank, and gloo aborted)
check("shape differs", lambda: disagree(
    lambda x: dist.all_reduce(x), 5, sig("all_reduce", op="sum", shape=(4,)), sig("all_reduce", op="sum", shape=(5,)),
    lambda: ones((5,) if last else (4,))))
check("usable after shape differs", lambda: (dist.all_reduce(ones()[0]).tolist(), good.tolist()))  # call #6
# call #7: a dtype mismatch (it returned garbage on the int32 rank)
check("dtype differs", lambda: disagree(
    lambda x: dist.all_reduce(x), 7, sig("all_reduce", op="sum"), sig("all_reduce", op="sum", dtype="int32"),
    lambda: ones(dtype=np.int32 if last else np.float32)))
# call #8: another collective: broadcast on rank 0, all_reduce on rank 1
check("collective differs", lambda: disagree(
    lambda x: dist.all_reduce(x) if last else dist.broadcast(x, src=0), 8,
    sig("broadcast", src=0), sig("all_reduce", op="sum"), ones))
# call #9: the root differs
check("root differs", lambda: disagree(
    lambda x: dist.broadcast(x, src=1 if last else 0), 9, sig("broadcast", src=0), sig("broadcast", src=1), ones))
# call #10: async (on mpi it returns before the peers call: the fingerprints are compared at wait())
check("async op differs", lambda: disagree(
    lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX if last else dist.ReduceOp.SUM, async_op=True).wait(), 10,
    sig("all_reduce", op="sum"), sig("all_reduce", op="max"), ones, moves=dist.get_backend() == "mpi"))
check("usable at the end", lambda: (dist.all_reduce(ones()[0]).tolist(), good.tolist()))  # call #11
check.write(out_dir, rank)
dist.destroy_process_group()
