"""DTensor ops under jax.jit against the hand-written @spmd version and global-view jax.jit.

On a (2, 4) mesh of 8 CPU devices ("dp", "tp"): a 2-layer MLP, forward + backward
(column- then row-parallel weights, batch over dp), and one transformer block forward
(Megatron attention + MLP, layer norms). Three versions of each, in one process,
interleaved: DTensor ops (global view, torch's placements) under jax.jit; the same
computation written by hand on each device's blocks with @spmd (local view); and
plain jax.jit over NamedSharding arrays (GSPMD picks the layout). For each: median
time per call and the collectives in the compiled HLO. Optionally (--torch) the MLP
step in torch DTensor on 4 gloo processes as a reference point (a (2, 2) mesh).

    python benchmarks/dtensor_ops.py [--quick] [--torch] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as PS  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import spmd  # noqa: E402
import spmd.ops as ops  # noqa: E402
from spmd import Replicate, Shard, distribute_tensor  # noqa: E402

R, S = Replicate(), Shard


def _timeit(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _brief(c: dict) -> dict:
    return {k: v for k, v in c.items() if v["count"]}


# --- the MLP: loss and gradients of both weights ---------------------------------------------------
def mlp_programs(mesh, B, D, H, O):
    rng = np.random.default_rng(0)
    x, w1, w2, t = (rng.standard_normal(s).astype(np.float32) for s in [(B, D), (D, H), (H, O), (B, O)])
    n = B * O

    def loss_dt(w1, w2, x, t):  # the row-parallel output laid out Replicate, as torch's RowwiseParallel
        d = (ops.relu(x @ w1) @ w2).redistribute(placements=[S(0), R]) - t
        return ((d * d).sum() / n).full_tensor()

    def local(w1, w2, x, t):
        d = jax.lax.psum(jax.nn.relu(x @ w1) @ w2, "tp") - t
        return jax.lax.psum(jnp.sum(d * d), "dp") / n

    hand = spmd.spmd(local, mesh, in_placements=([R, S(1)], [R, S(0)], [S(0), R], [S(0), R]), out_placements=[R, R])

    def loss_global(w1, w2, x, t):
        d = jax.nn.relu(x @ w1) @ w2 - t
        return jnp.sum(d * d) / n

    jm = mesh.jax_mesh
    put = lambda a, *spec: jax.device_put(a, NamedSharding(jm, PS(*spec)))
    dargs = (distribute_tensor(w1, mesh, [R, S(1)]), distribute_tensor(w2, mesh, [R, S(0)]),
             distribute_tensor(x, mesh, [S(0), R]), distribute_tensor(t, mesh, [S(0), R]))
    gargs = (put(w1, None, "tp"), put(w2, "tp", None), put(x, "dp", None), put(t, "dp", None))
    return {
        "dtensor_ops": (jax.jit(jax.value_and_grad(loss_dt, argnums=(0, 1))), dargs),  # torch's gradient placements
        "spmd_local": (jax.jit(jax.value_and_grad(hand, argnums=(0, 1))), (w1, w2, x, t)),
        "jit_named_sharding": (jax.jit(jax.value_and_grad(loss_global, argnums=(0, 1))), gargs),
    }


# --- one transformer block, forward ----------------------------------------------------------------
def block_programs(mesh, B, T, D, NH, F):
    rng = np.random.default_rng(1)
    hd = D // NH
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    # float32 after scaling: a NumPy float64 scalar would promote (NEP 50) and the DTensor would be float64
    wq, wk, wv, wo = ((rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32) for _ in range(4))
    w1 = (rng.standard_normal((D, F)) / np.sqrt(D)).astype(np.float32)
    w2 = (rng.standard_normal((F, D)) / np.sqrt(F)).astype(np.float32)

    def ln(a):
        mu = a.mean(-1, keepdims=True)
        return (a - mu) * jax.lax.rsqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    def attn_core(q, k, v, einsum, softmax):
        s = einsum("bqhd,bkhd->bhqk", q, k) * float(1.0 / np.sqrt(hd))  # a Python float: stays f32
        return einsum("bhqk,bkhd->bqhd", softmax(s), v)

    rep = [S(0), R]  # batch over dp, replicated over tp

    def block_dt(x, wq, wk, wv, wo, w1, w2):  # torch TP style: row-parallel outputs laid out Replicate
        h = ops.layer_norm(x, -1)
        q, k, v = ((h @ w).reshape(B, T, NH, hd) for w in (wq, wk, wv))  # heads sharded over tp
        a = attn_core(q, k, v, ops.einsum, lambda s: ops.softmax(s, -1)).reshape(B, T, D)
        x = x + (a @ wo).redistribute(placements=rep)
        h = ops.layer_norm(x, -1)
        return x + (ops.gelu(h @ w1) @ w2).redistribute(placements=rep)

    def local(x, wq, wk, wv, wo, w1, w2):  # Megatron: heads and F split over tp
        nh = wq.shape[1] // hd
        h = ln(x)
        b, t = x.shape[:2]
        q, k, v = ((h @ w).reshape(b, t, nh, hd) for w in (wq, wk, wv))
        a = attn_core(q, k, v, jnp.einsum, lambda s: jax.nn.softmax(s, -1)).reshape(b, t, nh * hd)
        x = x + jax.lax.psum(a @ wo, "tp")
        h = ln(x)
        return x + jax.lax.psum(jax.nn.gelu(h @ w1) @ w2, "tp")

    col, row = [R, S(1)], [R, S(0)]
    hand = spmd.spmd(local, mesh, in_placements=([S(0), R], col, col, col, row, col, row), out_placements=[S(0), R])

    def block_global(x, wq, wk, wv, wo, w1, w2):
        h = ln(x)
        q, k, v = ((h @ w).reshape(B, T, NH, hd) for w in (wq, wk, wv))
        a = attn_core(q, k, v, jnp.einsum, lambda s: jax.nn.softmax(s, -1)).reshape(B, T, D)
        x = x + a @ wo
        return x + jax.nn.gelu(ln(x) @ w1) @ w2

    jm = mesh.jax_mesh
    put = lambda a, *spec: jax.device_put(a, NamedSharding(jm, PS(*spec)))
    plain = (x, wq, wk, wv, wo, w1, w2)
    pls = ([S(0), R], col, col, col, row, col, row)
    specs = (("dp",), (None, "tp"), (None, "tp"), (None, "tp"), ("tp", None), (None, "tp"), ("tp", None))
    return {
        "dtensor_ops": (jax.jit(block_dt), tuple(distribute_tensor(a, mesh, p) for a, p in zip(plain, pls))),
        "spmd_local": (hand, plain),
        "jit_named_sharding": (jax.jit(block_global), tuple(put(a, *s) for a, s in zip(plain, specs))),
    }


TORCH_WORKER = textwrap.dedent(
    """
    import os, sys, time, json, statistics
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate

    def main(rank, port, out, B, D, H, O, reps):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4)
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 2))
        R, S = Replicate(), Shard
        x, t = torch.randn(B, D), torch.randn(B, O)
        w1, w2 = torch.randn(D, H), torch.randn(H, O)
        dx, dt = distribute_tensor(x, mesh, [S(0), R]), distribute_tensor(t, mesh, [S(0), R])
        d1 = distribute_tensor(w1, mesh, [R, S(1)]).requires_grad_()
        d2 = distribute_tensor(w2, mesh, [R, S(0)]).requires_grad_()
        def step():
            d = (torch.relu(dx @ d1) @ d2).redistribute(mesh, [S(0), R]) - dt
            loss = (d * d).sum() / (B * O)
            loss.full_tensor().backward()
            g = (d1.grad.full_tensor(), d2.grad.full_tensor())
            d1.grad = d2.grad = None
            return g
        step()
        ts = []
        for _ in range(reps):
            dist.barrier(); t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"seconds": statistics.median(ts)}, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        a = sys.argv
        mp.spawn(main, args=(int(a[1]), a[2], *map(int, a[3:8])), nprocs=4, join=True)
    """
)


def torch_mlp(B, D, H, O, reps):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _torch_mlp(B, D, H, O, reps, tmp)


def _torch_mlp(B, D, H, O, reps, tmp):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, out = os.path.join(tmp, "torch_mlp.py"), os.path.join(tmp, "torch_mlp.json")
    with open(script, "w") as f:
        f.write(TORCH_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    try:
        subprocess.run([sys.executable, script, str(port), out, *map(str, (B, D, H, O, reps))], env=env,
                       check=True, capture_output=True, timeout=600)
        with open(out) as f:
            return json.load(f)["seconds"]
    except (subprocess.SubprocessError, OSError) as e:
        return f"failed: {type(e).__name__}"


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["dtensor_ops", "spmd_local", "jit_named_sharding"]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6))
    for ax, (bench, rows) in zip(np.atleast_1d(axes), results.items()):
        ms = [rows[n]["seconds"] * 1e3 for n in names]
        ax.bar(names, ms, color=["tab:blue", "tab:orange", "tab:green"])
        for i, n in enumerate(names):
            c = rows[n]["collectives"]
            label = "\n".join(f"{k} x{v['count']}" for k, v in c.items()) or "no collective"
            ax.text(i, ms[i], label, ha="center", va="bottom", fontsize=7)
        ax.set_title(bench, fontsize=8)
        ax.set_ylabel("ms per call (best of 3 medians)")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("DTensor ops vs @spmd vs jit(NamedSharding), (2, 4) mesh of 8 CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--torch", action="store_true", help="also time the MLP in torch DTensor (4 gloo processes)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    reps = 5 if a.quick else 30
    mlp_dims = (64, 256, 1024, 256) if a.quick else (256, 1024, 4096, 1024)
    blk_dims = (4, 64, 256, 8, 1024) if a.quick else (8, 128, 512, 8, 2048)
    benches = {
        f"mlp fwd+bwd B,D,H,O={mlp_dims}": mlp_programs(mesh, *mlp_dims),
        f"transformer block fwd B,T,D,heads,F={blk_dims}": block_programs(mesh, *blk_dims),
    }
    results: dict = {}
    for bench, progs in benches.items():
        rows = {n: {"collectives": _brief(spmd.collectives(fn, *args)), "times": []} for n, (fn, args) in progs.items()}
        ref = None
        for n, (fn, args) in progs.items():  # the three agree
            v = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
                lambda t: np.asarray(t.full_tensor()) if hasattr(t, "full_tensor") else np.asarray(t), fn(*args),
                is_leaf=lambda t: hasattr(t, "full_tensor")))
            ref = v if ref is None else ref
            rows[n]["max_rel_diff_vs_dtensor_ops"] = float(
                max(np.abs(p - q).max() / max(np.abs(q).max(), 1e-30) for p, q in zip(v, ref)))
        for _ in range(3):  # interleaved rounds against drift from other load
            for n, (fn, args) in progs.items():
                rows[n]["times"].append(_timeit(fn, args, reps))
        for r in rows.values():
            r["seconds"] = min(r.pop("times"))
        rows["ratio_dtensor_ops_over_spmd"] = rows["dtensor_ops"]["seconds"] / rows["spmd_local"]["seconds"]
        results[bench] = rows
        print(bench)
        for n in ("dtensor_ops", "spmd_local", "jit_named_sharding"):
            r = rows[n]
            print(f"  {n:20s} {r['seconds'] * 1e3:9.3f} ms  {r['collectives']}  rel diff {r['max_rel_diff_vs_dtensor_ops']:.1e}")
        print(f"  ratio dtensor_ops / spmd_local: {rows['ratio_dtensor_ops_over_spmd']:.3f}")
    if a.torch:
        t = torch_mlp(*mlp_dims, reps)
        results["torch_dtensor_mlp_fwd_bwd_2x2_gloo_seconds"] = t
        print("torch DTensor MLP fwd+bwd on 4 gloo processes, (2, 2) mesh:", t)
    meta = {"jax": jax.__version__, "devices": len(jax.devices()), "machine": platform.machine(),
            "note": "shared 2-core machine with other jobs running: timings are noisy"}
    with open(os.path.join(a.out, "dtensor_ops.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    _plot({k: v for k, v in results.items() if isinstance(v, dict)}, os.path.join(a.out, "dtensor_ops.png"))
    print("wrote", os.path.join(a.out, "dtensor_ops.json"), "and .png")


if __name__ == "__main__":
    main()
