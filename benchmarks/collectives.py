"""Collectives: the spmd API against hand-written ``jax.shard_map`` + ``jax.lax``.

For all_reduce, all_gather, reduce_scatter, all_to_all and broadcast on 8 CPU
devices, message sizes 4 KiB .. 64 MiB: algbw and busbw (nccl-tests formulas),
the time ratio spmd / hand-written, and the collectives in each compiled
program (they must be the same). Both systems run interleaved in one process.

    python benchmarks/collectives.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import spmd  # noqa: E402
from spmd import Shard  # noqa: E402

N = 8
AX = "x"
GOAL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _programs(mesh):
    """name -> (spmd fn, hand-written fn, local elements for size S bytes, busbw factor)."""
    jm = mesh.jax_mesh

    def hand(body):
        return jax.jit(jax.shard_map(body, mesh=jm, in_specs=P(AX), out_specs=P(AX)))

    def mine(body):
        return spmd.spmd(body, mesh, in_placements=Shard(0), out_placements=Shard(0))

    def hand_bcast(x):  # bit-exact, as spmd's: sum the bits, the other ranks give zeros
        bits = lax.bitcast_convert_type(x, jnp.uint32)
        bits = lax.psum(jnp.where(lax.axis_index(AX) == 0, bits, jnp.zeros_like(bits)), AX)
        return lax.bitcast_convert_type(bits, jnp.float32)

    def hand_bcast_float(x):  # the common idiom: not bit-exact on XLA:CPU (-0.0, denormals)
        return lax.psum(jnp.where(lax.axis_index(AX) == 0, x, jnp.zeros_like(x)), AX)

    f = 4  # float32 bytes
    return {
        # nccl-tests: size is the per-rank buffer (all_reduce, all_to_all, broadcast),
        # the gathered output (all_gather), the per-rank input (reduce_scatter).
        "all_reduce": (mine(lambda x: spmd.all_reduce(x, group=AX)), hand(lambda x: lax.psum(x, AX)),
                       lambda s: s // f, 2 * (N - 1) / N),
        "all_gather": (mine(lambda x: spmd.all_gather(x, tiled=True, group=AX)),
                       hand(lambda x: lax.all_gather(x, AX, tiled=True)), lambda s: s // f // N, (N - 1) / N),
        "reduce_scatter": (mine(lambda x: spmd.reduce_scatter(x, group=AX)),
                           hand(lambda x: lax.psum_scatter(x, AX, tiled=True)), lambda s: s // f, (N - 1) / N),
        "all_to_all": (mine(lambda x: spmd.all_to_all(x, 0, 0, group=AX)),
                       hand(lambda x: lax.all_to_all(x, AX, 0, 0, tiled=True)), lambda s: s // f, (N - 1) / N),
        "broadcast": (mine(lambda x: spmd.broadcast(x, 0, group=AX)), hand(hand_bcast), lambda s: s // f, 1.0),
        # What bit-exactness costs against the float idiom (information, not the goal's baseline).
        "broadcast_vs_float_idiom": (mine(lambda x: spmd.broadcast(x, 0, group=AX)), hand(hand_bcast_float),
                                     lambda s: s // f, 1.0),
    }


def _time(fn, x, reps: int) -> float:
    # Block on every call: XLA:CPU runs each device of a collective on a shared
    # thread pool, and many programs in flight on 2 cores can starve a rendezvous.
    fn(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        fn(x).block_until_ready()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few sizes and repeats (smoke run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    mesh = spmd.init_device_mesh("cpu", (N,), mesh_dim_names=(AX,))
    sizes = [4 << 10, 64 << 10, 1 << 20] if args.quick else [4 << 10 << (2 * i) for i in range(8)]  # 4K..64M
    rounds = 3 if args.quick else 7
    rows = []
    for name, (mine, hand, elems, bus) in _programs(mesh).items():
        for size in sizes:
            m = elems(size)
            x = jax.device_put(jnp.arange(N * m, dtype=jnp.float32) % 97, NamedSharding(mesh.jax_mesh, P(AX)))
            ref = np.asarray(hand(x))
            np.testing.assert_array_equal(np.asarray(mine(x)), ref)
            c_mine, c_hand = spmd.collectives(mine, x), spmd.collectives(hand, x)
            c_mine = {k: v for k, v in c_mine.items() if v["count"]}
            c_hand = {k: v for k, v in c_hand.items() if v["count"]}
            # repeats so that one measurement takes ~50 ms
            t0 = _time(hand, x, 3)
            reps = max(3, min(2000, int(0.05 / max(t0, 1e-6))))
            tm, th = [], []
            for _ in range(rounds):  # interleave A/B so drift hits both
                tm.append(_time(mine, x, reps))
                th.append(_time(hand, x, reps))
            t_mine, t_hand = statistics.median(tm), statistics.median(th)
            row = {
                "collective": name, "size_bytes": size,
                "time_s": {"spmd": t_mine, "hand": t_hand},
                "algbw_GBps": {"spmd": size / t_mine / 1e9, "hand": size / t_hand / 1e9},
                "busbw_GBps": {"spmd": size / t_mine / 1e9 * bus, "hand": size / t_hand / 1e9 * bus},
                "time_ratio": t_mine / t_hand,
                "hlo": {"spmd": c_mine, "hand": c_hand},
                "same_collectives": {k: v["count"] for k, v in c_mine.items()} == {k: v["count"] for k, v in c_hand.items()},
            }
            rows.append(row)
            print(f"{name:15s} {size:>10d} B  spmd {t_mine * 1e6:9.1f} us  hand {t_hand * 1e6:9.1f} us  "
                  f"ratio {row['time_ratio']:.3f}  busbw {row['busbw_GBps']['spmd']:.2f} GB/s  "
                  f"hlo {dict((k, v['count']) for k, v in c_mine.items())} same={row['same_collectives']}", flush=True)
    result = {
        "benchmark": "collectives", "devices": N, "platform": jax.devices()[0].platform,
        "jax": jax.__version__, "machine": platform.machine(), "cpus": os.cpu_count(), "quick": args.quick,
        "rows": rows,
        "summary": {
            "max_time_ratio": max(r["time_ratio"] for r in rows if r["collective"] in GOAL),
            "median_time_ratio": statistics.median(r["time_ratio"] for r in rows if r["collective"] in GOAL),
            "within_3pct": sum(abs(r["time_ratio"] - 1) <= 0.03 for r in rows if r["collective"] in GOAL),
            "cases": sum(r["collective"] in GOAL for r in rows),
            "all_same_collectives": all(r["same_collectives"] for r in rows),
        },
    }
    os.makedirs(args.out, exist_ok=True)
    stem = "collectives_quick" if args.quick else "collectives"
    with open(os.path.join(args.out, stem + ".json"), "w") as fh:
        json.dump(result, fh, indent=1)
    _plot(rows, os.path.join(args.out, stem + ".png"))
    print(json.dumps(result["summary"]))
    return result


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["collective"] for r in rows))
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6.5), squeeze=False)
    for j, name in enumerate(names):
        rs = [r for r in rows if r["collective"] == name]
        s = [r["size_bytes"] for r in rs]
        ax = axes[0][j]
        ax.plot(s, [r["busbw_GBps"]["spmd"] for r in rs], "o-", label="spmd")
        ax.plot(s, [r["busbw_GBps"]["hand"] for r in rs], "s--", label="shard_map + lax")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        ax.plot(s, [r["time_ratio"] for r in rs], "o-")
        ax.axhspan(0.97, 1.03, color="green", alpha=0.15, label="±3%")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time spmd / hand")
        ax.legend(fontsize=8)
    fig.suptitle(f"spmd vs hand-written shard_map, {N} CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
