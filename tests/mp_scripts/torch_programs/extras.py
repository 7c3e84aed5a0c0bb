"""What torch programs use besides tensor collectives: object collectives (a word count as a
Counter, configs as dicts), launch queries, a TCPStore, subgroups, coalesced all-reduce, the
monitored barrier and Work.get_future."""
import collections
import datetime
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()

counts = collections.Counter("spmd" if rank == 0 else "jax")
gathered = [None] * size
dist.all_gather_object(gathered, counts)
total = sum(gathered, collections.Counter())
print(f"rank {rank}: all_gather_object {type(gathered[1]).__name__} {sorted(total.items())}")
config = [{"lr": 0.1, "layers": (2, 3)}, collections.OrderedDict(b=1, a=2)] if rank == 0 else [None, None]
dist.broadcast_object_list(config, src=0)
print(f"rank {rank}: broadcast_object_list {config[0]} {type(config[1]).__name__} {list(config[1].items())}")
out = [None] * size if rank == 0 else None
dist.gather_object({"rank": rank, "ids": {rank, rank + 10}}, out, dst=0)
print(f"rank {rank}: gather_object {out}")
got = [None]
dist.scatter_object_list(got, [f"shard-{i}" for i in range(size)] if rank == 0 else None, src=0)
print(f"rank {rank}: scatter_object_list {got}")
if rank == 0:
    dist.send_object_list([collections.Counter(a=3), b"raw"], dst=1)
else:
    box = [None, None]
    sender = dist.recv_object_list(box, src=0)
    print(f"rank {rank}: recv_object_list from {sender}: {box}")
print(f"rank {rank}: launched {dist.is_torchelastic_launched()} node_local_rank {dist.get_node_local_rank()} "
      f"gloo {dist.is_gloo_available()} backend for cpu {dist.get_default_backend_for_device('cpu')}")
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False)
store.set(f"port-test/{rank}", f"hello from {rank}")
store.add("port-test/count", 10 + rank)
store.wait([f"port-test/{r}" for r in range(size)])
dist.barrier()
print(f"rank {rank}: store {store.get(f'port-test/{(rank + 1) % size}')} count {int(store.get('port-test/count'))}")
mine, groups = dist.new_subgroups(group_size=1)
t = torch.tensor([rank + 7])
dist.all_reduce(t, group=mine)
print(f"rank {rank}: {len(groups)} subgroups, my subgroup sums to {t.tolist()}")
a, b = torch.tensor([1.5 * rank]), torch.tensor([2.0**40, rank])
dist.all_reduce_coalesced([a, b])
print(f"rank {rank}: all_reduce_coalesced {a.tolist()} {b.tolist()}")
dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
print(f"rank {rank}: passed monitored_barrier; reduce_op.SUM is ReduceOp.SUM: {dist.reduce_op.SUM == dist.ReduceOp.SUM}")
dist.destroy_process_group()
