"""A DTensor tour on 8 CPU devices: lay a tensor out, look at its blocks, plan and run a redistribute,
Partial values, ops in global view, gradients and the way back to plain JAX.

    python examples/dtensor_tour.py   (8 CPU fake devices are set below, before JAX starts)
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

import spmd  # noqa: E402
import spmd.ops as ops  # noqa: E402
from spmd import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402


def main() -> None:
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = np.arange(70, dtype=np.float32).reshape(10, 7)

    # 1. Layout: rows over dp, columns over tp; 7 columns over 4 ranks are cut 2, 2, 2, 1 (torch.chunk).
    dt = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    print("placements:", dt.placements)
    print("local shapes:", [t.shape for t in dt.local_tensors()])
    dt.visualize()

    # 2. A redistribute is planned (and costed) before it runs, then runs as one jitted program.
    print(spmd.plan_redistribute(dt, [Shard(1), Shard(0)]))
    moved = dt.redistribute(placements=[Shard(1), Shard(0)])
    print("redistribute keeps the value:", bool(np.array_equal(moved.full_tensor(), x)))

    # 3. Partial: every rank holds a full-shape part; the value is their reduction.
    p = DTensor.from_local([np.full((3,), r, np.float32) for r in range(8)], mesh, [Partial("sum"), Partial("sum")])
    print("P(sum) of ranks 0..7:", np.asarray(p.full_tensor()).tolist())  # 0 + 1 + ... + 7 = 28

    # 4. Ops in global view, with torch's output placements.
    w = distribute_tensor(np.ones((7, 3), np.float32), mesh, [Replicate(), Shard(0)])
    y = dt @ w                                    # contracted dim sharded on both sides over tp
    print("x @ w placements:", y.placements)      # (Shard(dim=0), Partial(reduce_op='sum'))
    total = y.sum()
    print("sum of x @ w:", float(total.full_tensor()))  # 3 * 2415 = 7245
    ops.explain(lambda a: ops.relu(a).sum(), y)

    # 5. Gradients: jax.grad through DTensor ops; the gradient of w keeps w's placements.
    def loss(w):
        return ((dt @ w) ** 2).sum().full_tensor()

    g = jax.grad(loss)(w)
    print("grad placements:", g.placements)
    ref = 2 * x.T @ (x @ np.ones((7, 3), np.float32))
    print("grad matches NumPy:", bool(np.allclose(g.full_tensor(), ref)))

    # 6. Back to plain JAX: an evenly laid-out DTensor is a jax.Array with a NamedSharding.
    even = distribute_tensor(np.arange(64, dtype=np.float32).reshape(8, 8), mesh, [Shard(0), Replicate()])
    arr = even.to_jax()
    print("to_jax:", arr.shape, arr.sharding.spec)


if __name__ == "__main__":
    main()
