"""The seed's six collectives across processes, as a torch.distributed script ported by its imports.

    spmdrun --standalone --nproc-per-node 4 examples/mp_collectives.py

Each process is one rank (spmdrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun
does). The tensors are NumPy buffers, written in place as torch writes its tensors; with torch
installed, ``torch.tensor`` inputs work the same. Every rank prints each result beside the value
torch's tutorial promises, with world size N: all_reduce -> [1+2+...+N], broadcast -> [0],
all_gather -> [[0], ..., [N-1]], reduce -> rank 0 gets the sum, scatter -> rank i gets [i],
gather -> rank 0 gets [[0], ..., [N-1]].
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

import spmd.distributed as dist  # noqa: E402  (was: import torch.distributed as dist)


def main() -> None:
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # 1. all_reduce: every rank gets 1 + 2 + ... + world_size.
    tensor = np.array([rank + 1], dtype=np.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"all_reduce: {tensor.tolist()}", flush=True)

    # 2. broadcast from rank 0.
    tensor = np.array([rank], dtype=np.float32) if rank == 0 else np.zeros(1, np.float32)
    dist.broadcast(tensor, src=0)
    print(f"broadcast: {tensor.tolist()}", flush=True)

    # 3. all_gather: every rank gets every rank's tensor.
    tensor = np.array([rank], dtype=np.int64)
    tensor_list = [np.zeros(1, np.int64) for _ in range(world_size)]
    dist.all_gather(tensor_list, tensor)
    print(f"all_gather: {[t.tolist() for t in tensor_list]}", flush=True)

    # 4. reduce to rank 0: rank 0 gets the sum, the others keep their input.
    tensor = np.array([rank + 1], dtype=np.int64)
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    print(f"reduce: {tensor.tolist()}", flush=True)

    # 5. scatter from rank 0: rank i gets [i].
    scatter_list = [np.array([i], dtype=np.float32) for i in range(world_size)] if rank == 0 else None
    tensor = np.zeros(1, np.float32)
    dist.scatter(tensor, scatter_list, src=0)
    print(f"scatter: {tensor.tolist()}", flush=True)

    # 6. gather to rank 0.
    tensor = np.array([rank], dtype=np.float32)
    gather_list = [np.zeros(1, np.float32) for _ in range(world_size)] if rank == 0 else None
    dist.gather(tensor, gather_list, dst=0)
    if rank == 0:
        print(f"gather: {[t.tolist() for t in gather_list]}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
