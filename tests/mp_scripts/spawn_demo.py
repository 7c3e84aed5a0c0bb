"""spmd.spawn, as torch.multiprocessing.spawn: one fn per rank; a failing rank raises in the parent."""

import numpy as np

import spmd
import spmd.distributed as dist


def train(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    total = dist.all_reduce(np.float32(rank + 1))
    print(f"spawned rank {dist.get_rank()}/{dist.get_world_size()} sum {float(total)}", flush=True)
    dist.destroy_process_group()


def fails(rank):
    if rank == 1:
        raise ValueError(f"bad rank {rank}")


if __name__ == "__main__":
    spmd.spawn(train, args=(2,), nprocs=2, join=True)
    try:
        spmd.spawn(fails, nprocs=2)
    except dist.ProcessRaisedException as e:
        last = [l for l in str(e).splitlines() if l.strip()][-1]
        print(f"caught ProcessRaisedException from process {e.error_index}: {last}", flush=True)
