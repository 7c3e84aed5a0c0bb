"""A torch.distributed program as the tutorials write them: PyTorch's "Writing Distributed
Applications" (point to point, groups, collectives) with the int64 / float64 / bfloat16 tensors
torch programs make, then what programs use besides tensor collectives: object collectives (a word
count as a Counter, configs as dicts), launch queries, a TCPStore, subgroups, coalesced all-reduce,
the monitored barrier."""
import collections
import datetime
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()

# Blocking point to point
tensor = torch.zeros(1)
if rank == 0:
    tensor += 1
    dist.send(tensor=tensor, dst=1)
else:
    dist.recv(tensor=tensor, src=0)
print(f"rank {rank}: has data {tensor[0].item()}")

# Non-blocking point to point
tensor = torch.zeros(1)
if rank == 0:
    tensor += 2
    req = dist.isend(tensor=tensor, dst=1)
else:
    req = dist.irecv(tensor=tensor, src=0)
req.wait()
print(f"rank {rank}: isend/irecv {tensor[0].item()}")

# All-reduce in a group
group = dist.new_group([0, 1])
tensor = torch.ones(1)
dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
print(f"rank {rank}: group all_reduce {tensor.tolist()}")

# torch's default integer is int64: 2**40 + rank must survive
t = torch.tensor([2**40 + rank, -(2**62)])
dist.all_reduce(t)
print(f"rank {rank}: int64 all_reduce {t.tolist()} {t.dtype}")
t = torch.tensor([2**40 + 1]) if rank == 0 else torch.zeros(1, dtype=torch.int64)
dist.broadcast(t, src=0)
print(f"rank {rank}: int64 broadcast {t.tolist()}")
stats = torch.tensor([1 + 1e-12], dtype=torch.float64) * (4 / size)
dist.all_reduce(stats)
print(f"rank {rank}: float64 all_reduce - 4 = {(stats - 4).item():.3e} {stats.dtype}")
t = torch.tensor([1.5 + rank, 2.0**-10], dtype=torch.bfloat16)
dist.all_reduce(t)
print(f"rank {rank}: bfloat16 all_reduce {t.tolist()} {t.dtype}")
t = torch.tensor([rank + 1, 10 * (rank + 1)])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
print(f"rank {rank}: max {t.tolist()}")
t = torch.tensor([rank + 2])
dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
print(f"rank {rank}: product {t.tolist()}")

# all_gather, gather, scatter, reduce
out = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
dist.all_gather(out, torch.tensor([rank, 2**35 * rank]))
print(f"rank {rank}: all_gather {[o.tolist() for o in out]}")
out = torch.zeros(2 * size, dtype=torch.float64)
dist.all_gather_into_tensor(out, torch.tensor([rank + 0.5, rank + 0.25], dtype=torch.float64))
print(f"rank {rank}: all_gather_into_tensor {out.tolist()}")
t = torch.tensor([rank * 1.5])
dist.reduce(t, dst=1)
if rank == 1:  # torch leaves the other ranks' tensors unspecified (gloo uses them as scratch)
    print(f"rank {rank}: reduce {t.tolist()}")
recv = torch.zeros(2, dtype=torch.int64)
dist.scatter(recv, [torch.tensor([i, 2**33 + i]) for i in range(size)] if rank == 0 else None, src=0)
print(f"rank {rank}: scatter {recv.tolist()}")
gl = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
dist.gather(torch.tensor([float(rank)]), gl, dst=0)
print(f"rank {rank}: gather {[g.tolist() for g in gl] if gl is not None else None}")
out = torch.zeros(1, dtype=torch.int64)
dist.reduce_scatter(out, [torch.tensor([10 * rank + j]) for j in range(size)])
print(f"rank {rank}: reduce_scatter {out.tolist()}")
out = torch.zeros(size, dtype=torch.int64)
dist.all_to_all_single(out, torch.tensor([100 * rank + j for j in range(size)]))
print(f"rank {rank}: all_to_all_single {out.tolist()}")
work = dist.all_reduce(torch.tensor([rank + 1]), async_op=True)
print(f"rank {rank}: get_future {[v.tolist() for v in work.get_future().wait()]}")

# --- beyond tensor collectives

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
