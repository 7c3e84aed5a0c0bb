"""The seed's torch.distributed collectives, run with spmd on 8 CPU devices.

    python examples/seed_collectives.py

Part 1 runs the seed's six examples on a WORLD of 4 ranks with the eager
ProcessGroup API (each input holds one row per rank, the results come back the
same way) and prints every rank's result next to the value the seed promises.
Part 2 is the seed's DeviceMesh / Shard / Replicate example: a tensor sharded
over a mesh, redistributed to Replicate inside an ``@spmd`` function.
"""

import os
import sys
from pathlib import Path

# Fake devices must be asked for before JAX is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import spmd  # noqa: E402
from spmd import Partial, ReduceOp, Replicate, Shard, init_device_mesh  # noqa: E402


def show(title: str, per_rank) -> None:
    per_rank = np.asarray(per_rank)
    cells = "  ".join(f"rank {r}: {v.tolist()}" for r, v in enumerate(per_rank))
    print(f"{title:<48} {cells}")


def seed_examples() -> None:
    world_size = 4
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))  # 4 of the 8 devices
    pg = mesh.get_group("world")
    rank = np.arange(world_size)
    print(f"== the seed's six collectives: {pg.size} ranks on {mesh} ==")

    # 1. all_reduce: every rank gets 1+2+3+4 = 10.
    tensor = (rank + 1).reshape(world_size, 1)
    show("1. all_reduce(rank + 1, SUM) -> [10] everywhere", pg.allreduce(tensor, op=ReduceOp.SUM))

    # 2. broadcast from rank 0: every rank gets rank 0's [0].
    tensor = np.where(rank == 0, rank, 0).reshape(world_size, 1).astype(np.float32)
    show("2. broadcast(src=0) -> [0.] everywhere", pg.broadcast(tensor, src=0))

    # 3. all_gather: every rank gets [[0], [1], [2], [3]].
    gathered = pg.all_gather(rank.reshape(world_size, 1))
    show("3. all_gather(rank) -> [[0],[1],[2],[3]]", gathered)

    # 4. reduce to rank 0: rank 0 gets [10], the others keep their input.
    show("4. reduce(rank + 1, dst=0) -> 10, 2, 3, 4", pg.reduce((rank + 1).reshape(world_size, 1), dst=0))

    # 5. scatter from rank 0: rank i gets [i] from rank 0's list.
    scatter_list = np.zeros((world_size, world_size, 1), np.int32)
    scatter_list[0] = np.arange(world_size).reshape(world_size, 1)  # only rank 0's list counts
    show("5. scatter(src=0) -> rank i gets [i]", pg.scatter(scatter_list, src=0))

    # 6. gather to rank 0: rank 0 gets [[0], [1], [2], [3]] (the others get zeros).
    out = pg.gather(rank.reshape(world_size, 1), dst=0)
    show("6. gather(dst=0) -> rank 0: [[0],[1],[2],[3]]", out)

    # The same all_reduce as a functional collective inside an SPMD region.
    @spmd.spmd(mesh, in_placements=Shard(0), out_placements=Replicate())
    def total(x):
        return spmd.all_reduce(x, ReduceOp.SUM, group="world")

    print(f"{'7. all_reduce inside @spmd -> [10]':<48} {np.asarray(total(jnp.arange(1, 5))).tolist()}")


def redistribute_demo() -> None:
    print("== DeviceMesh / Shard / Replicate (the seed's DTensor example) ==")
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    tensor = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)

    # Shard(0): each of the 4 devices holds 2 rows; redistribute to Replicate is an all_gather.
    seen = {}

    @spmd.spmd(mesh, in_placements=[Shard(0)], out_placements=[Replicate()])
    def shard0_to_replicate(local):
        seen["S(0)"] = local.shape  # recorded while tracing: what each device sees
        return spmd.all_gather(local, axis=0, tiled=True, group="x")

    rep = shard0_to_replicate(tensor)
    print(f"S(0) on {mesh}: local block {seen['S(0)']} of {tensor.shape}")
    print(f"S(0) -> R: equal to the tensor: {bool(jnp.array_equal(rep, tensor))}")

    # Partial(sum): every device holds a part of a sum; the reduction happens when asked.
    @spmd.spmd(mesh, in_placements=[Shard(0)], out_placements=[Partial()])
    def column_sums(local):
        return local.sum(axis=0)

    partial = column_sums(tensor)
    print(f"P(sum) local values: {[np.asarray(t).tolist() for t in partial.local_tensors()]}")
    print(f"P(sum) -> R (full_tensor): {np.asarray(partial.full_tensor()).tolist()}")

    # A 2-D mesh: rows over dp, columns over tp; gather both back.
    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))

    @spmd.spmd(mesh2, in_placements=[Shard(0), Shard(1)], out_placements=[Replicate(), Replicate()])
    def gather_both(local):
        seen["S(0)S(1)"] = local.shape
        cols = spmd.all_gather(local, axis=1, tiled=True, group="tp")
        return spmd.all_gather(cols, axis=0, tiled=True, group="dp")

    full = gather_both(tensor)
    print(f"S(0)S(1) on {mesh2}: local block {seen['S(0)S(1)']} of {tensor.shape}")
    print(f"S(0)S(1) -> RR: equal to the tensor: {bool(jnp.array_equal(full, tensor))}")
    print(f"collectives of that program: "
          f"{ {k: v for k, v in spmd.collectives(gather_both, tensor).items() if v['count']} }")


def main() -> None:
    print(f"JAX {jax.__version__}: {len(jax.devices())} {jax.devices()[0].platform} devices")
    seed_examples()
    redistribute_demo()


if __name__ == "__main__":
    main()
