"""A program compiled across the processes (its collectives run over gloo on every backend): prints its
result as ``full [...]``; gloo prints its connection lines to stdout as it connects."""

import numpy as np

import spmd
import spmd.distributed as dist
from placements import Shard

dist.init_process_group()
mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),))
t = spmd.DTensor.from_local(np.full(2, dist.get_rank() + 1, np.float32), mesh, [Shard(0)])
# one write per line: print("full", x) writes its parts apart, and two ranks sharing mpiexec's stdout interleave them
print(f"full {np.asarray(t.full_tensor()).tolist()}", flush=True)
dist.destroy_process_group()
