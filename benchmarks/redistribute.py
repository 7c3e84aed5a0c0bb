"""DTensor redistribute: plan bytes vs HLO bytes vs lower bound, time vs hand-written, torch.

For a catalogue of transitions on 8 CPU devices (mesh (8,) and (2, 4), even and
uneven shapes) this measures, side by side in one run:

* ``plan_bytes``: the plan's bytes per device (nccl-tests convention, padded
  blocks) and ``hlo_bytes``: what the compiled HLO's collectives move (the
  same convention, read by ``spmd.collectives``); they must be equal.
* ``plan_traffic`` and ``lower_bound``: bytes a device must *receive*, the unit
  in which a lower bound is meaningful (see ``lower_bound`` below for the
  derivation); ``plan_traffic`` is the plan's bus bytes (``bytes * (K-1)/K``,
  twice that for all_reduce, nccl-tests' busbw factors).
* ``torch_plan_traffic``: the same for torch's plan (torch's greedy
  ``generate_greedy_transform_infos``, re-implemented step for step, costed
  with our model; torch 2.13's default).
* ``t_spmd / t_hand``: time of a cached ``dt.redistribute`` against a
  hand-written jitted ``shard_map`` doing the same collectives on the same
  blocks (even shapes: the bare ``lax`` collectives, no index tables).
* ``torch_ms``: torch DTensor's redistribute on the same global shapes in 4
  gloo processes (mesh (4,) and (2, 2)), when torch is installed; bounded by
  a timeout.

    python benchmarks/redistribute.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import spmd  # noqa: E402
from placements import Partial, Replicate, Shard, format_placements, local_shape_and_offset  # noqa: E402
from placements._plan import make_step, torch_greedy_steps  # noqa: E402
from spmd._inspect import hlo_collectives  # noqa: E402
from spmd.tensor._dispatch import program  # noqa: E402
from spmd.tensor._dtensor import physical  # noqa: E402
from spmd.tensor._storage import spec as storage_spec  # noqa: E402

R = Replicate()
S0, S1 = Shard(0), Shard(1)
PS = Partial("sum")


def cases(quick: bool):
    n = 512 if quick else 1024
    u = n - 3  # uneven over 8, 4 and 2
    one = [(S0,), (R,)], [(S0,), (S1,)], [(PS,), (R,)], [(PS,), (S0,)], [(R,), (S0,)], [(S1,), (S0,)]
    two = (
        [(S0, S1), (R, R)], [(S0, S1), (S0, S0)], [(S0, S1), (S1, S0)], [(S0, S0), (S1, S1)],
        [(PS, PS), (R, R)], [(PS, S1), (S0, S1)], [(R, S0), (S0, R)],
    )
    out = []
    for shape in ((n, n), (u, u)):
        out += [((8,), shape, a, b) for a, b in one]
        out += [((2, 4), shape, a, b) for a, b in two]
    return out


# --- lower bound ----------------------------------------------------------------------------------
def _coords(ms):
    return list(np.ndindex(*ms))


def lower_bound(mesh_shape, shape, itemsize, src, dst):
    """Fewest bytes some device must receive, for any algorithm (unpadded sizes).

    * No Partial in src: every device must receive each element of its destination
      block that its source block lacks: ``max_dev |dst(dev) - src(dev)|``.
    * Partial(sum) over a group of K devices (the src's Partial mesh dims), reduced
      into blocks that are replicated over that group: each device ends with the
      reduction of K inputs of B bytes; an all-reduce must receive at least
      ``2 B (K-1)/K`` (Patarasuk & Yuan's bandwidth bound; ring reduce-scatter +
      all-gather attains it). Reduced into blocks sharded over the group (sizes
      B_dev): each output element needs the K-1 other contributions:
      ``max_dev B_dev (K-1)``. Any other Shard change rides along: its bound is added.
    """
    n = math.prod(shape)
    if n == 0:
        return 0
    pdims = [i for i, p in enumerate(src) if isinstance(p, Partial)]

    def box(pl, c):
        s, o = local_shape_and_offset(shape, mesh_shape, pl, c)
        return s, o

    def missing(a_pl, b_pl):
        worst = 0
        for c in _coords(mesh_shape):
            sb, ob = box(b_pl, c)
            sa, oa = box(a_pl, c)
            inter = 1
            for d in range(len(shape)):
                lo, hi = max(ob[d], oa[d]), min(ob[d] + sb[d], oa[d] + sa[d])
                inter *= max(0, hi - lo)
            worst = max(worst, math.prod(sb) - inter)
        return worst * itemsize

    if not pdims:
        return missing(src, dst)
    if any(isinstance(p, Partial) for p in dst):
        return None
    k = math.prod(mesh_shape[i] for i in pdims)
    # The reduction lands in ``mid``: dst's placements on the Partial mesh dims, src's elsewhere.
    mid = tuple(dst[i] if i in pdims else src[i] for i in range(len(src)))
    b = max(math.prod(box(mid, c)[0]) for c in _coords(mesh_shape)) * itemsize
    if all(isinstance(dst[i], Replicate) for i in pdims):
        red = 2 * b * (k - 1) / k
    elif all(isinstance(dst[i], Shard) for i in pdims):
        red = b * (k - 1)
    else:
        return None
    return red + missing(mid, dst)


# --- torch's plan, costed with our model --------------------------------------------------------------
def torch_plan_cost(mesh_shape, shape, itemsize, src, dst):
    traffic, nbytes, coll = 0.0, 0, 0
    for m, c, t, before in torch_greedy_steps(src, dst):
        s = make_step(mesh_shape, shape, itemsize, before, (m,), t)
        traffic += s.traffic
        nbytes += s.bytes
        coll += s.collective is not None
    return traffic, nbytes, coll


# --- hand-written programs (even shapes) ---------------------------------------------------------------
def handwritten(mesh, plan):
    """The plan's collectives as bare lax calls on the same per-device blocks (even shapes only)."""
    names = mesh.mesh_dim_names
    nd = mesh.ndim

    def body(block):
        x = block.reshape(block.shape[nd:])
        for s in plan.steps:
            axes = tuple(names[d] for d in s.mesh_dims)
            k = math.prod(mesh.shape[d] for d in s.mesh_dims)
            c, t = s.src, s.dst
            if isinstance(c, Shard) and isinstance(t, Replicate):
                x = lax.all_gather(x, axes, axis=c.dim, tiled=True)
            elif isinstance(c, Shard) and isinstance(t, Shard):
                x = lax.all_to_all(x, axes, t.dim, c.dim, tiled=True)
            elif isinstance(c, Partial) and isinstance(t, Replicate):
                x = lax.psum(x, axes)
            elif isinstance(c, Partial) and isinstance(t, Shard):
                x = lax.psum_scatter(x, axes, scatter_dimension=t.dim, tiled=True)
            elif isinstance(c, Replicate) and isinstance(t, Shard):
                n = x.shape[t.dim] // k
                x = lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * n, n, axis=t.dim)
            elif isinstance(c, Replicate) and isinstance(t, Partial):
                x = jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x))
            else:
                raise NotImplementedError(str(s))
        return x.reshape((1,) * nd + x.shape)

    # the DTensor storage's specs (a Replicate mesh dim stored once: spmd/tensor/_storage.py)
    return jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=storage_spec(mesh, plan.src),
                                 out_specs=storage_spec(mesh, plan.dst), check_vma=False))


def timeit(fns, reps):
    """Median seconds of each zero-argument fn, interleaved so both see the same machine load.
    Every call is waited for (many queued CPU collectives can starve XLA's rendezvous)."""
    for f in fns:
        jax.block_until_ready(f())
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            jax.block_until_ready(f())
            ts[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in ts]


# --- torch DTensor in 4 gloo processes --------------------------------------------------------------
TORCH_WORKER = textwrap.dedent(
    """
    import os, sys, json, time, statistics
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, DTensor, Shard, Replicate, Partial

    def main(rank, port, out, cases, reps):
        torch.set_num_threads(1)
        S, R, P = Shard, Replicate, Partial
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4)
        res = []
        for mshape, shape, src, dst in eval(cases):
            mesh = init_device_mesh("cpu", mshape)
            x = torch.ones(shape)
            if any(isinstance(p, Partial) for p in src):
                dt = DTensor.from_local(distribute_tensor(x, mesh, [R()] * len(mshape)).to_local(), mesh, src)
            else:
                dt = distribute_tensor(x, mesh, src)
            dt.redistribute(mesh, dst).to_local()
            ts = []
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                dt.redistribute(mesh, dst).to_local()
                ts.append(time.perf_counter() - t)
            res.append(statistics.median(ts))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])), nprocs=4, join=True)
    """
)


def _pl_src(pl):
    return "[" + ", ".join("R()" if isinstance(p, Replicate) else f"S({p.dim})" if isinstance(p, Shard) else f"P({p.reduce_op!r})" for p in pl) + "]"


def run_torch(catalogue, reps, timeout):
    try:
        import torch  # noqa: F401
    except ImportError:
        return None, "torch is not installed"
    tcases = []
    for ms, shape, src, dst in catalogue:
        tms = (4,) if len(ms) == 1 else (2, 2)
        tcases.append(f"({tms!r}, {shape!r}, {_pl_src(src)}, {_pl_src(dst)})")
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "w.py")
        out = os.path.join(d, "out.json")
        open(script, "w").write(TORCH_WORKER)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        try:
            p = subprocess.run([sys.executable, script, str(port), out, "[" + ", ".join(tcases) + "]", str(reps)],
                               env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"torch run exceeded {timeout} s"
        if p.returncode != 0:
            return None, "torch run failed: " + p.stderr[-500:]
        return json.load(open(out)), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    reps = 5 if args.quick else 25
    meshes = {(8,): spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("x",)),
              (2, 4): spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))}
    catalogue = cases(args.quick)
    rows = []
    for ms, shape, src, dst in catalogue:
        mesh = meshes[ms]
        x = np.ones(shape, np.float32)
        dt = spmd.distribute_tensor(x, mesh, src)
        plan = spmd.plan_redistribute(dt, dst)
        hlo = hlo_collectives(program(mesh, plan).lower(physical(dt)).compile().as_text())
        hlo_bytes = sum(v["bytes"] for v in hlo.values())
        f_spmd = lambda dt=dt, dst=dst: physical(dt.redistribute(placements=dst))  # noqa: E731
        even = all(s % 8 == 0 for s in shape)
        t_hand = None
        if even:
            hand = handwritten(mesh, plan)
            np.testing.assert_array_equal(np.asarray(hand(physical(dt))), np.asarray(f_spmd()))
            t_spmd, t_hand = timeit([f_spmd, lambda: hand(physical(dt))], reps)
        else:
            (t_spmd,) = timeit([f_spmd], reps)
        lb = lower_bound(ms, shape, 4, src, dst)
        tt, tb, tc = torch_plan_cost(ms, shape, 4, src, dst)
        c = plan.cost()
        rows.append(dict(
            mesh=list(ms), shape=list(shape), src=format_placements(src), dst=format_placements(dst),
            even=even, plan=str(plan).splitlines()[0], steps=len(plan.steps), collectives=c.collectives,
            plan_bytes=c.bytes, hlo_bytes=hlo_bytes, plan_traffic=c.traffic, lower_bound=lb,
            torch_plan_traffic=tt, torch_plan_bytes=tb, torch_collectives=tc,
            t_spmd_ms=t_spmd * 1e3, t_hand_ms=None if t_hand is None else t_hand * 1e3,
            ratio=None if t_hand is None else t_spmd / t_hand,
        ))
        r = rows[-1]
        print(f"{str(ms):7} {str(shape):12} {r['src']:>12} -> {r['dst']:<10} plan {c.bytes:>9} hlo {hlo_bytes:>9} "
              f"traffic {c.traffic:>11.0f} lb {lb if lb is None else round(lb):>9} torch {tt:>11.0f} "
              f"t {t_spmd*1e3:7.2f} ms" + ("" if t_hand is None else f" hand {t_hand*1e3:7.2f} ms ratio {t_spmd/t_hand:4.2f}"),
              flush=True)
    torch_times, note = (None, "skipped (--no-torch)") if args.no_torch else run_torch(catalogue, reps, 150)
    if torch_times:
        for r, t in zip(rows, torch_times):
            r["torch_ms_4proc"] = t * 1e3
    result = dict(
        benchmark="redistribute", quick=args.quick, jax=jax.__version__, devices=len(jax.devices()),
        platform=platform.platform(), torch_note=note, rows=rows,
        notes=("bytes per device; plan/hlo in nccl-tests convention on padded blocks; traffic and lower bound in "
               "received bytes; torch times from 4 gloo processes on meshes (4,) / (2, 2), the spmd times on 8 "
               "fake CPU devices in one process"),
    )
    os.makedirs(args.out, exist_ok=True)
    name = "redistribute_quick" if args.quick else "redistribute"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, os.path.join(args.out, name + ".png"))
    print("torch:", note or "ok")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{'x'.join(map(str, r['mesh']))} {'E' if r['even'] else 'U'} {r['src']}->{r['dst']}" for r in rows]
    ix = np.arange(len(rows))
    fig, (a, b) = plt.subplots(2, 1, figsize=(14, 9))
    w = 0.27
    a.bar(ix - w, [r["plan_traffic"] / 1024 for r in rows], w, label="spmd plan (received KiB)")
    a.bar(ix, [(r["lower_bound"] or 0) / 1024 for r in rows], w, label="lower bound")
    a.bar(ix + w, [r["torch_plan_traffic"] / 1024 for r in rows], w, label="torch greedy plan")
    a.set_ylabel("KiB received per device")
    a.set_xticks(ix, labels, rotation=70, fontsize=7)
    a.legend()
    a.set_title("redistribute: bytes per device (E even, U uneven)")
    rr = [r["ratio"] or 0 for r in rows]
    b.bar(ix, rr, color=["tab:green" if x <= 1.2 else "tab:red" for x in rr])
    b.axhline(1.2, color="k", ls="--", lw=0.8)
    b.set_ylabel("t(dt.redistribute) / t(hand-written)")
    b.set_xticks(ix, labels, rotation=70, fontsize=7)
    b.set_title("time ratio, cached redistribute vs hand-written shard_map (even shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
