"""The seed's torch.distributed examples, ported by changing the imports (run with spmdrun -n 4)."""

import numpy as np

import spmd.distributed as dist

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
print(f"Rank {rank}/{world_size}")

# 1. all_reduce: [1+2+3+4] = [10] on all ranks
tensor = np.array([rank + 1])
tensor = dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
print(f"all_reduce {np.asarray(tensor).tolist()}")

# 2. broadcast: [0] on all ranks
tensor = np.array([rank], np.float32) if rank == 0 else np.zeros(1, np.float32)
tensor = dist.broadcast(tensor, src=0)
print(f"broadcast {np.asarray(tensor).tolist()}")

# 3. all_gather: [[0], [1], [2], [3]] on all ranks
tensor = np.array([rank])
tensor_list = [np.zeros(1, np.int32) for _ in range(world_size)]
dist.all_gather(tensor_list, tensor)
print(f"all_gather {[np.asarray(t).tolist() for t in tensor_list]}")

# 4. reduce: rank 0 gets [10], the others keep theirs
tensor = np.array([rank + 1])
tensor = dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
print(f"reduce {np.asarray(tensor).tolist()}")

# 5. scatter: rank i gets [i]
scatter_list = [np.array([i], np.float32) for i in range(world_size)] if rank == 0 else None
tensor = np.zeros(1, np.float32)
tensor = dist.scatter(tensor, scatter_list, src=0)
print(f"scatter {np.asarray(tensor).tolist()}")

# 6. gather: rank 0 gets [[0], [1], [2], [3]]
tensor = np.array([rank])
gather_list = [np.zeros(1, np.int32) for _ in range(world_size)] if rank == 0 else None
gather_list = dist.gather(tensor, gather_list, dst=0)
print(f"gather {None if gather_list is None else [np.asarray(t).tolist() for t in gather_list]}")

dist.destroy_process_group()
