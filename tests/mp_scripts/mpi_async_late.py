"""An async collective whose peer never calls it (under ``mpi_run.py``, ``SPMD_TIMEOUT`` short): the call returns
at once (``returned``), its ``wait()`` ends this rank with the named timeout message; ``wait returned`` never prints."""

import time

import numpy as np

import spmd.distributed as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
dist.all_reduce(np.ones(1, np.float32))  # the group's first call: every rank meets here (signatures compared)
if rank == world - 1:
    time.sleep(60)
else:
    w = dist.all_gather([np.zeros(2, np.float32) for _ in range(world)], np.ones(2, np.float32), async_op=True)
    print(f"returned pending={not w.is_completed()}", flush=True)
    w.wait()
print("wait returned", flush=True)
