"""DTensor and meshes across processes; writes OUT_DIR/rank{r}.json (run under spmdrun, 2 ranks).

With one device per process: from_local with this process's tensor, to_local,
redistribute, full_tensor (even and uneven shards, Partial). With two devices per
process: a 2-D mesh over all processes' devices, distribute_tensor, redistribute,
full_tensor.
"""

import sys

import jax
import numpy as np

import spmd
import spmd.distributed as dist
from spmd import Partial, Replicate, Shard
from _checks import Checks, raises

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()


def _same(got, want):
    return np.asarray(got).shape == np.asarray(want).shape and np.allclose(np.asarray(got), np.asarray(want))


check = Checks(_same, lambda x: np.asarray(x).tolist())


G = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
per_proc = len(jax.local_devices())
check("mesh spans all processes", lambda: ([len(jax.devices()), jax.process_count()], [world * per_proc, world]))

if per_proc == 1:
    mesh = spmd.init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    rows = 8 // world
    mine = G[rank * rows:(rank + 1) * rows]
    dt = spmd.DTensor.from_local(mine, mesh, [Shard(0)])
    check("from_local shape", lambda: (dt.shape, G.shape))
    check("to_local", lambda: (dt.to_local(), mine))
    check("full_tensor S(0)", lambda: (dt.full_tensor(), G))
    check("redistribute S(0)->R to_local", lambda: (dt.redistribute(mesh, [Replicate()]).to_local(), G))
    cols = 6 // world
    check("redistribute S(0)->S(1) to_local", lambda: (dt.redistribute(mesh, [Shard(1)]).to_local(), G[:, rank * cols:(rank + 1) * cols]))
    check("redistribute S(0)->S(1) full", lambda: (dt.redistribute(mesh, [Shard(1)]).full_tensor(), G))
    part = spmd.DTensor.from_local(G * (rank + 1), mesh, [Partial()])
    check("Partial(sum) full_tensor", lambda: (part.full_tensor(), G * sum(range(1, world + 1))))
    check("Partial(sum) -> S(0) to_local", lambda: (part.redistribute(mesh, [Shard(0)]).to_local(),
                                                   (G * sum(range(1, world + 1)))[rank * rows:(rank + 1) * rows]))
    pmax = spmd.DTensor.from_local(G + rank, mesh, [Partial("max")])
    check("Partial(max) full_tensor", lambda: (pmax.full_tensor(), G + world - 1))
    # uneven: 5 rows over the ranks, torch.chunk sizes
    U = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    c = -(-5 // world)
    lo, hi = min(rank * c, 5), min((rank + 1) * c, 5)
    ud = spmd.DTensor.from_local(U[lo:hi], mesh, [Shard(0)], shape=(5, 3))
    check("uneven to_local", lambda: (ud.to_local(), U[lo:hi]))
    check("uneven full_tensor", lambda: (ud.full_tensor(), U))
    check("uneven S(0)->S(1) full", lambda: (ud.redistribute(mesh, [Shard(1)]).full_tensor(), U))
else:
    mesh = spmd.init_device_mesh("cpu", (world, per_proc), mesh_dim_names=("dp", "tp"))
    check("2-D mesh over all processes", lambda: ([mesh.size(), len({d.process_index for d in mesh.devices.flat})], [world * per_proc, world]))
    dt = spmd.distribute_tensor(G, mesh, [Shard(0), Shard(1)])
    check("distribute_tensor full_tensor", lambda: (dt.full_tensor(), G))
    check("redistribute SS->RS full", lambda: (dt.redistribute(mesh, [Replicate(), Shard(0)]).full_tensor(), G))
    check("redistribute SS->RR full", lambda: (dt.redistribute(mesh, [Replicate(), Replicate()]).full_tensor(), G))
    U = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    ud = spmd.distribute_tensor(U, mesh, [Shard(0), Shard(0)])
    check("uneven SS full_tensor", lambda: (ud.full_tensor(), U))
    check("uneven SS->S(1)R full", lambda: (ud.redistribute(mesh, [Shard(1), Replicate()]).full_tensor(), U))
    rows = 8 // world
    rd = spmd.DTensor.from_local(G[rank * rows:(rank + 1) * rows], mesh, [Shard(0), Replicate()])
    check("from_local S(0)R, 2 devices per process", lambda: (rd.full_tensor(), G))
    check("from_local refuses a Shard inside a process", lambda: raises(
        lambda: spmd.DTensor.from_local(G, mesh, [Replicate(), Shard(0)]), ValueError, "one local tensor cannot fill them"))

dist.barrier()
check.write(sys.argv[1], rank)
