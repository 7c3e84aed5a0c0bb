"""Collectives that would hang or return garbage: ``guard.py MODE``.

MODE: ``late`` (the last rank sleeps instead of calling all_reduce), ``stop`` (the last
rank SIGSTOPs itself), ``mismatch`` (rank 0 all_reduce, the others all_gather),
``dtype`` (the last rank sends int32, the others float32), ``ops`` (the first call: all_reduce with
sum on rank 0, max on the others), ``cost`` (times a 4 KiB
all_reduce; prints ``us_per_call <float>`` on rank 0). Every rank prints ``pid <pid>`` first.
"""

import os
import signal
import sys
import time

import numpy as np

import spmd.distributed as dist

mode = sys.argv[1]
print(f"pid {os.getpid()}", flush=True)
dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
last = rank == world - 1
x = np.ones(4, np.float32)
if mode == "ops":  # the group's first call differs: sum on rank 0, max on the others
    dist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
dist.all_reduce(x)  # every rank gets here: programs compiled, gloo connected
print("first all_reduce done", flush=True)
if mode == "late":
    if last:
        time.sleep(60)
    dist.all_reduce(x)
elif mode == "stop":
    if last:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(x)
elif mode == "mismatch":
    if rank == 0:
        dist.all_reduce(x)
    else:
        dist.all_gather(None, x)
elif mode == "dtype":
    dist.all_reduce(x.astype(np.int32) if last else x)
elif mode == "cost":
    y = np.ones(1024, np.float32)  # 4 KiB
    for _ in range(20):
        dist.all_reduce(y)
    times = []
    for _ in range(7):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(y)
        times.append((time.perf_counter() - t0) / 100)
    if rank == 0:
        print(f"us_per_call {sorted(times)[len(times) // 2] * 1e6:.1f}", flush=True)
print("second collective done", flush=True)
