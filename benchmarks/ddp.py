"""Benchmark: the data-parallel train step (spmd.parallel.make_train_step on a plain model, through the job's programs) against torch DDP.

Side by side in one run, for the MLP and the transformer of the training job
(same sizes, global batch, AdamW + gradient clipping):

- samples/s of the JAX step on 1 device and on 8 CPU fake devices (dp=8);
- samples/s of torch DistributedDataParallel (gloo) with 1 and 8 processes,
  when torch is installed;
- what the JAX step communicates, read from its compiled HLO (count and bytes
  of each collective), next to the parameter bytes it must all-reduce.

On a CPU host the 8 "devices" (and the 8 torch processes) share the same
cores, so dp=8 cannot be faster than 1 device: the ratio measures the cost of
data parallelism (the split, the all-reduce, the per-device dispatch), not a
speed-up.

    python benchmarks/ddp.py            # ~2-3 minutes on 2 cores
    python benchmarks/ddp.py --quick    # smoke run

Writes benchmarks/results/ddp.json and benchmarks/results/ddp.png.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _common import benchmark_args, free_port, run_torch_worker, save_figure, torch_gpt, torch_timed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# The training job's default sizes (models/train.py), on the sort-8-digits task.
LENGTH = 8
VOCAB = 11
BATCH = 128
MLP_HIDDEN = 256
TF = dict(layers=2, d_model=64, heads=4)
LR = 3e-3


# --- torch DDP (runs in its own process tree) --------------------------------------------------
def _torch_models():
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.h0 = nn.Linear(LENGTH * VOCAB, MLP_HIDDEN)
            self.h1 = nn.Linear(MLP_HIDDEN, MLP_HIDDEN)
            self.out = nn.Linear(MLP_HIDDEN, LENGTH * VOCAB)

        def forward(self, tokens):
            x = F.one_hot(tokens, VOCAB).float().flatten(1)
            x = F.relu(self.h1(F.relu(self.h0(x))))
            return self.out(x).view(tokens.shape[0], LENGTH, VOCAB)

    def gpt():
        return torch_gpt(VOCAB, 2 * LENGTH, TF["d_model"], TF["layers"], TF["heads"])

    return {"mlp": MLP, "transformer": gpt}


def _torch_worker(rank, world, model_name, steps, warmup, port, out_path):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    # One intra-op thread per process: on a shared 2-core host, torch's OpenMP threads spin-wait and a
    # 1-process run with 2 threads measured ~5x slower than with 1 (210 vs 39 ms per transformer step).
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=120))
    torch.manual_seed(0)
    model = DDP(_torch_models()[model_name]())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    rng = np.random.default_rng(rank)
    local = BATCH // world
    batches = []
    for _ in range(4):
        d = rng.integers(0, 10, size=(local, LENGTH))
        s = np.sort(d, axis=1)
        if model_name == "mlp":
            batches.append((torch.tensor(d), torch.tensor(s), None))
        else:
            seq = torch.tensor(np.concatenate([d, np.full((local, 1), 10), s], axis=1))
            mask = torch.zeros(local, 2 * LENGTH)
            mask[:, LENGTH:] = 1
            batches.append((seq[:, :-1], seq[:, 1:], mask))

    def step(i):
        x, y, m = batches[i % len(batches)]
        logits = model(x)
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        loss = nll.mean() if m is None else (nll * m.reshape(-1)).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    dt, _ = torch_timed(step, warmup, steps)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        with open(out_path, "w") as f:
            json.dump({"samples_per_s": steps * BATCH / dt, "step_ms": 1000 * dt / steps, "parameters": n_params}, f)
    dist.destroy_process_group()


def _torch_main(model_name: str, world: int, steps: int, warmup: int, out_path: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_torch_worker, args=(world, model_name, steps, warmup, free_port(), out_path), nprocs=world, join=True)


def run_torch(model_name: str, world: int, steps: int, warmup: int, timeout: float = 150.0) -> dict | None:
    out_path = os.path.join(RESULTS, f".torch_{model_name}_{world}.json")
    return run_torch_worker(__file__, [model_name, world, steps, warmup], out_path, timeout)


# --- JAX ---------------------------------------------------------------------------------------
def run_jax(model_name: str, n_devices: int, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    import spmd
    from models.train import Config
    from models.train._programs import layout, make_task, place_batch
    from models.train._programs import programs as make_programs

    cfg = Config(model=model_name, batch_size=BATCH, length=LENGTH, hidden=MLP_HIDDEN, lr=LR, steps=1000, **TF)
    mesh = spmd.init_device_mesh("cpu", (n_devices,), mesh_dim_names=("dp",))
    programs = make_programs(cfg, mesh)
    task = make_task(cfg)
    batches = [place_batch(task.batch(0, i, BATCH, layout(cfg)), mesh, programs.batch_placements) for i in range(4)]
    state = programs.init(jax.random.key(0), np.asarray(task.batch(0, 0, 2, layout(cfg))["inputs"]))
    t0 = time.perf_counter()
    state, m = programs.train_step(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        state, m = programs.train_step(state, batches[i % 4])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = programs.train_step(state, batches[i % 4])
    jax.block_until_ready((state, m))
    dt = time.perf_counter() - t0
    comm = spmd.collectives(programs.train_step, state, batches[0])
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    return {
        "samples_per_s": steps * BATCH / dt,
        "step_ms": 1000 * dt / steps,
        "first_step_s": compile_s,
        "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
        "param_bytes": param_bytes,
        "collectives": {k: v for k, v in comm.items() if v["count"]},
    }


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    labels = ["jax 1 device", "jax dp=8", "torch DDP 1 proc", "torch DDP 8 procs"]
    keys = [("jax", "1"), ("jax", "8"), ("torch", "1"), ("torch", "8")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.2
    for j, (label, (fw, n)) in enumerate(zip(labels, keys)):
        vals = [(results["models"][m].get(fw, {}).get(n) or {}).get("samples_per_s") or 0 for m in models]
        bars = ax.bar([i + (j - 1.5) * width for i in range(len(models))], vals, width, label=label)
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([f"{m} ({results['models'][m]['jax']['1']['parameters']:,} params)" for m in models])
    ax.set_yscale("log")
    ax.set_ylabel("samples / s, log scale (higher is better)")
    ax.set_title(f"Data-parallel train step, global batch {BATCH}, AdamW ({results['cpu_count']} CPU cores)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv=None) -> int:
    a = benchmark_args(argv, __doc__, "few steps, a smoke run", "torch DDP", _torch_main, ROOT)
    if a is None:
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    steps, warmup = (10, 2) if a.quick else (40, 3)
    try:
        import torch  # noqa: F401

        have_torch = not a.no_torch
        torch_version = torch.__version__
    except ImportError:
        have_torch, torch_version = False, None
    os.makedirs(RESULTS, exist_ok=True)
    results = {"batch": BATCH, "steps_timed": steps, "cpu_count": os.cpu_count(), "jax": jax.__version__,
               "torch": torch_version, "models": {}}
    t_all = time.perf_counter()
    for name in ("mlp", "transformer"):
        entry = {"jax": {}, "torch": {}}
        for n in (1, 8):
            entry["jax"][str(n)] = r = run_jax(name, n, steps, warmup)
            print(f"{name:12s} jax   {n} device(s): {r['samples_per_s']:9,.0f} samples/s  ({r['step_ms']:.2f} ms/step; "
                  f"collectives {r['collectives']})", flush=True)
        if have_torch:
            for n in (1, 8):
                entry["torch"][str(n)] = r = run_torch(name, n, steps, warmup)
                if "error" in r:
                    print(f"{name:12s} torch {n} proc(s): failed: {r['error'][-200:]}", flush=True)
                else:
                    print(f"{name:12s} torch {n} proc(s): {r['samples_per_s']:9,.0f} samples/s  ({r['step_ms']:.2f} ms/step)",
                          flush=True)
        j1, j8 = entry["jax"]["1"]["samples_per_s"], entry["jax"]["8"]["samples_per_s"]
        ratios = {"jax_dp8_over_jax_1": j8 / j1}
        for n in ("1", "8"):
            t = (entry["torch"].get(n) or {}).get("samples_per_s")
            if t:
                ratios[f"jax_{n}_over_torch_{n}"] = entry["jax"][n]["samples_per_s"] / t
        entry["ratios"] = ratios
        ar = entry["jax"]["8"]["collectives"].get("all-reduce", {"count": 0, "bytes": 0})
        entry["all_reduce_bytes_over_param_bytes"] = ar["bytes"] / entry["jax"]["8"]["param_bytes"]
        results["models"][name] = entry
        print(f"{name:12s} ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in ratios.items())
              + f"; all-reduce bytes / param bytes = {entry['all_reduce_bytes_over_param_bytes']:.4f}", flush=True)
    results["wall_s"] = time.perf_counter() - t_all
    with open(os.path.join(RESULTS, "ddp.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, "ddp.png"))
    print(f"wrote {os.path.join(RESULTS, 'ddp.json')} and ddp.png in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
