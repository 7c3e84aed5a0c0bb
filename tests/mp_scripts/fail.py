"""A rank that fails mid-collective: ``fail.py MODE``; MODE in raise, exit, hard, idle, ok, sleep, restart, linger
(``linger PATH``: every rank waits until PATH exists after its collectives, then runs one more: the job
must still work).

Every rank prints ``pid <pid>`` first so that tests can check none is left.
"""

import os
import sys
import time

import numpy as np

import spmd.distributed as dist

mode = sys.argv[1]
print(f"pid {os.getpid()}", flush=True)
dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
x = dist.all_reduce(np.ones(4, np.float32))  # everyone gets here
print(f"first all_reduce {np.asarray(x).tolist()}", flush=True)
if mode == "restart":
    attempt = int(os.environ["SPMD_RESTART_COUNT"])
    print(f"attempt {attempt}", flush=True)
    if attempt == 0 and rank == world - 1:
        raise RuntimeError(f"boom from rank {rank} on attempt {attempt}")
elif mode == "idle":  # the last rank dies while the others are not in a collective
    if rank == world - 1:
        os._exit(7)
    time.sleep(60)
elif rank == world - 1 and mode != "ok":
    time.sleep(0.5)  # the others are inside the next all_reduce by now
    if mode == "raise":
        raise RuntimeError(f"boom from rank {rank}")
    if mode == "exit":
        sys.exit(3)
    if mode == "hard":
        os._exit(7)
y = dist.all_reduce(np.ones(4, np.float32))
print(f"second all_reduce {np.asarray(y).tolist()}", flush=True)
if mode == "sleep":
    time.sleep(60)
if mode == "linger":  # until the file named by the argument exists (at most 60 s)
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.1)
    z = dist.all_reduce(np.ones(4, np.float32))
    print(f"after linger {np.asarray(z).tolist()}", flush=True)
