"""Benchmark: the tensor / sequence-parallel train step (models._tp_step) on n-D meshes against GSPMD.

For a GPT (the project's Transformer, d_model 256 x 4 layers, 8 heads, vocabulary 32, sequences of 16)
with AdamW + gradient clipping, side by side in one run on 8 CPU fake devices:

- ours: ``dp=8`` (DDP, the baseline), ``tp=8``, ``dp=2,tp=4`` (with and without sequence parallelism),
  ``fsdp=2,tp=4`` with sequence parallelism and ``dp=2,fsdp=2,tp=2``: the Megatron plan
  (``models._tp.transformer_tp_rules``) composed with fsdp's default in one ``ParamPlan``;
- GSPMD: the same layouts as a JAX user writes them today, a global-view ``jax.jit`` step with every
  parameter and its AdamW moments placed by ``NamedSharding`` as the plan places it (heads / MLP width /
  vocabulary on ``tp``, the other dim on ``fsdp``), the batch over the data dims, XLA's partitioner
  choosing the communication.

Every JAX layout is compiled first, then all are timed in interleaved rounds (the median round is
reported, the best too), so load from other processes falls on all layouts alike; every step's batch is
on the devices already, laid out over the data dims, for ours as for GSPMD.

Reported per layout: samples/s, CPU ms per step (less sensitive than wall time to other load on the host),
parameter + optimizer bytes per device (live arrays), the collectives the compiled step executes (loop
bodies times their trips) and, for ours, the analytic Megatron / ZeRO bound (``models._tp_comm``).

On a CPU host the 8 devices share the cores: throughput measures the cost of a layout, not a speed-up,
and other processes on the host make it noisy.

- torch (when installed): ``parallelize_module`` with the Megatron plan (q/k/v/fc ``ColwiseParallel``,
  proj/fc_out ``RowwiseParallel``, vocab-parallel embedding and an untied ``ColwiseParallel`` output
  with ``loss_parallel``) on ``tp`` and ``fully_shard`` per block over the other dims (HSDP on
  ``dp x fsdp``), 8 gloo CPU processes of one thread each; AdamW without gradient clipping (torch's
  ``clip_grad_norm_`` fails on parameters of a 1-D and a 2-D mesh together).

    python benchmarks/tensor_parallel.py           # a few minutes on 2 cores
    python benchmarks/tensor_parallel.py --quick   # smoke run

Writes benchmarks/results/tensor_parallel.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VOCAB, SEQ, D, LAYERS, HEADS, BATCH = 32, 16, 256, 4, 8, 32  # BATCH: benchmarks/fsdp.py's (fb.BATCH)
# (label, kind, mesh shape, dim names, sequence parallel)
LAYOUTS = [
    ("ours dp=8", "ours", (8,), ("dp",), False),
    ("ours tp=8", "ours", (8,), ("tp",), False),
    ("ours dp=2,tp=4", "ours", (2, 4), ("dp", "tp"), False),
    ("ours dp=2,tp=4 sp", "ours", (2, 4), ("dp", "tp"), True),
    ("ours fsdp=2,tp=4 sp", "ours", (2, 4), ("fsdp", "tp"), True),
    ("ours dp=2,fsdp=2,tp=2", "ours", (2, 2, 2), ("dp", "fsdp", "tp"), False),
    ("gspmd tp=8", "gspmd", (8,), ("tp",), False),
    ("gspmd dp=2,tp=4", "gspmd", (2, 4), ("dp", "tp"), False),
    ("gspmd fsdp=2,tp=4", "gspmd", (2, 4), ("fsdp", "tp"), False),
    ("gspmd dp=2,fsdp=2,tp=2", "gspmd", (2, 2, 2), ("dp", "fsdp", "tp"), False),
]

# torch: parallelize_module on tp, fully_shard over the other dims (HSDP on dp x fsdp), gloo, 8 processes
TORCH_LAYOUTS = [
    ("torch tp=8", {"tp": 8}),
    ("torch fsdp=2,tp=4", {"fsdp": 2, "tp": 4}),
    ("torch dp=2,fsdp=2,tp=2", {"dp": 2, "fsdp": 2, "tp": 2}),
]


def _setup(shape, names, sp):
    import jax
    import numpy as np

    import fsdp as fb  # benchmarks/fsdp.py: the timing, state bytes and optimizer of the FSDP benchmark
    import spmd
    from models import Transformer
    from models._tp import transformer_tp_rules
    from spmd.parallel import plan_params

    model = Transformer(VOCAB, SEQ, LAYERS, D, HEADS)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        seq = rng.integers(0, VOCAB, size=(fb.BATCH, SEQ + 1)).astype(np.int32)
        batches.append({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    rules = transformer_tp_rules(sp) if "tp" in names else ()
    plan = plan_params(params, mesh, rules, units=model.fsdp_units(), keep=model.fsdp_keep())
    return fb, model, mesh, batches, params, plan


def _on_devices(batches, mesh, names):
    """The batches on the devices, split over the data dims (dp, fsdp) and replicated over tp."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data = NamedSharding(mesh.jax_mesh, P(tuple(n for n in names if n in ("dp", "fsdp")) or None))
    return [jax.device_put(b, data) for b in batches]


def prepare_ours(shape, names, sp):
    import jax

    from models._ddp import init_train_state, make_train_step
    from models._fsdp import shard_train_state
    from models._tp_comm import tp_communication
    from models._tp_step import make_tp_train_step
    from spmd.parallel import hlo_executed_collectives

    fb, model, mesh, batches, params, plan = _setup(shape, names, sp)
    opt = fb._optimizer()
    if "tp" in names:
        step = make_tp_train_step(model, opt, mesh, plan, sequence_parallel=sp)
        state = shard_train_state(init_train_state(params, opt), plan, mesh, opt)
        bound = tp_communication(plan, batch=fb.BATCH, seq_len=SEQ, d_model=D, num_layers=LAYERS,
                                 sequence_parallel=sp)
    else:
        step = make_train_step(lambda p, b: fb._ce(model.apply({"params": p}, b["inputs"]), b), opt, mesh)
        state = init_train_state(params, opt)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        bound = {"total": {"all-reduce": {"count": 1, "bytes": nbytes}}, "activations": {}}
    prep = fb._Prepared(step, state, _on_devices(batches, mesh, names), fb.BATCH)
    got = hlo_executed_collectives(prep.compiled.as_text())
    prep.extra = dict(state_bytes_per_device=fb._state_bytes(prep.state), bound=bound,
                      collectives={k: v for k, v in got.items() if v["count"]})
    return prep


def _prod(sizes: dict, axes) -> int:
    out = 1
    for a in (axes,) if isinstance(axes, str) else axes:
        out *= sizes[a]
    return out


def prepare_gspmd(shape, names):
    """Global view: the plan's placements as NamedShardings, GSPMD partitions the step."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models._ddp import TrainState, init_train_state
    from spmd.parallel import entry_sharding, hlo_executed_collectives, map_like_params

    fb, model, mesh, batches, params, plan = _setup(shape, names, False)
    opt = fb._optimizer()
    rep = NamedSharding(mesh.jax_mesh, P())
    state = init_train_state(params, opt)
    sizes = dict(zip(names, shape))

    def sharding(x, e):  # the plan's spec, less the mesh axes a dim does not divide by (NamedSharding is even)
        spec = [a if a is None or x.shape[d] % _prod(sizes, a) == 0 else None
                for d, a in enumerate(tuple(entry_sharding(e, mesh).spec) + (None,) * (x.ndim - len(e.shape)))]
        return NamedSharding(mesh.jax_mesh, P(*spec[:x.ndim]))

    shardings = TrainState(step=rep, params=map_like_params(plan, state.params, sharding),
                           opt_state=map_like_params(plan, state.opt_state, sharding, optimizer=opt, other=lambda x: rep))
    state = jax.device_put(state, shardings)
    batches = _on_devices(batches, mesh, names)
    data = batches[0]["inputs"].sharding

    def step(state, batch):
        (loss, _), g = jax.value_and_grad(lambda p: fb._ce(model.apply({"params": p}, batch["inputs"]), batch),
                                          has_aux=True)(state.params)
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), {"loss": loss}

    jitted = jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, rep))
    prep = fb._Prepared(jitted, state, batches, fb.BATCH)
    got = hlo_executed_collectives(prep.compiled.as_text())
    prep.extra = dict(state_bytes_per_device=fb._state_bytes(prep.state),
                      collectives={k: v for k, v in got.items() if v["count"]})
    return prep


# --- torch: parallelize_module (Megatron plan) + fully_shard on gloo CPU processes ------------------
def _torch_worker(rank, world, dims, steps, warmup, port, out_path):
    import datetime

    from _common import torch_timed  # benchmarks/ is on the path: this script's folder

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    names, shape = tuple(dims), tuple(dims.values())
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tp = dims["tp"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.wq, self.wk, self.wv, self.proj = (nn.Linear(D, D) for _ in range(4))
            self.fc, self.fc_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = (w(h).view(b, t, -1, D // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + self.proj(y)
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D)
            self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(D)
            self.out = nn.Linear(D, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.out(self.ln_f(x))

    torch.manual_seed(0)
    model = GPT()
    tp_mesh = mesh["tp"]
    parallelize_module(model, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                        "out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    for blk in model.blocks:
        parallelize_module(blk, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                          "proj": RowwiseParallel(), "fc": ColwiseParallel(),
                                          "fc_out": RowwiseParallel()})
    shard = [n for n in names if n != "tp"]
    if shard:  # fully_shard over the data dims (HSDP on dp x fsdp)
        sub = mesh[tuple(shard)] if len(shard) > 1 else mesh[shard[0]]
        for blk in model.blocks:
            fully_shard(blk, mesh=sub)
        fully_shard(model, mesh=sub)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    n_data = world // tp
    data_rank = mesh.get_local_rank(shard[0]) if len(shard) == 1 else (
        mesh.get_local_rank(shard[0]) * dims[shard[1]] + mesh.get_local_rank(shard[1]) if shard else 0)
    rng = np.random.default_rng(data_rank)
    batches = []
    for _ in range(4):
        seq = torch.tensor(rng.integers(0, VOCAB, size=(BATCH // n_data, SEQ + 1))).long()
        batches.append((seq[:, :-1], seq[:, 1:]))

    def step(i):
        x, y = batches[i % len(batches)]
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()  # no clip_grad_norm_: torch cannot stack the norms of the fsdp-only and fsdp x tp parameters

    dt, cpu = torch_timed(step, warmup, steps)
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t)  # noqa: E731
    nbytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
    nbytes += sum(local(v).numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"samples_per_s": steps * BATCH / dt, "step_ms": 1000 * dt / steps,
                       "cpu_ms_per_step": 1000 * cpu * world / steps, "state_bytes_per_device": nbytes,
                       "collectives": {}}, f)
    dist.destroy_process_group()


def run_torch(dims: dict, steps: int, warmup: int, timeout: float = 600.0) -> dict:
    import socket
    import subprocess

    out_path = os.path.join(RESULTS, ".torch_tp.json")
    if os.path.exists(out_path):
        os.remove(out_path)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = ",".join(f"{k}={v}" for k, v in dims.items())
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", spec, str(steps), str(warmup), str(port),
           out_path]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out_path):
        return {"error": (proc.stderr or proc.stdout)[-800:]}
    with open(out_path) as f:
        res = json.load(f)
    os.remove(out_path)
    return res


def _torch_main(spec, steps, warmup, port, out_path):
    import torch.multiprocessing as mp

    dims = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    world = 1
    for v in dims.values():
        world *= v
    mp.spawn(_torch_worker, args=(world, dims, int(steps), int(warmup), int(port), out_path), nprocs=world, join=True)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["layouts"])
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    comm = lambda r: sum(v["bytes"] for v in r["collectives"].values()) / 2**20  # noqa: E731
    color = {"ours": "C0", "gspmd": "C1", "torch": "C2"}
    for ax, fn, title in ((axes[0], lambda r: r["samples_per_s"], "samples/s (higher is better)"),
                          (axes[1], lambda r: r["cpu_ms_per_step"], "CPU ms per step, all threads (lower is better)"),
                          (axes[2], lambda r: r["state_bytes_per_device"] / 2**20, "params + AdamW MiB per device"),
                          (axes[3], comm, "MiB communicated per device per step (XLA HLO)")):
        ax.bar(range(len(labels)), [fn(results["layouts"][k]) for k in labels],
               color=[color[k.split()[0]] for k in labels])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Tensor parallel GPT d{D}x{LAYERS} on 8 CPU devices: ours (blue), GSPMD NamedSharding (orange), "
                 "torch parallelize_module + fully_shard (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps")
    p.add_argument("--no-torch", action="store_true", help="skip torch parallelize_module + fully_shard")
    p.add_argument("--only-torch", action="store_true", help="run only the torch layouts (add them to the JSON)")
    p.add_argument("--torch-worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torch_worker:
        _torch_main(*a.torch_worker)
        return 0
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import jax

    steps, warmup = (2, 1) if a.quick else (6, 2)
    rounds, per_round = (2, 1) if a.quick else (7, 3)
    name = "tensor_parallel_quick" if a.quick else "tensor_parallel"
    path = os.path.join(RESULTS, f"{name}.json")
    results = {"jax": jax.__version__, "model": dict(d_model=D, layers=LAYERS, heads=HEADS, vocab=VOCAB, seq=SEQ),
               "steps": steps, "layouts": {}}
    if a.only_torch and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    try:
        import torch

        results["torch"] = None if a.no_torch else torch.__version__
    except ImportError:
        results["torch"] = None
    preps = {label: prepare_ours(shape, names, sp) if kind == "ours" else prepare_gspmd(shape, names)
             for label, kind, shape, names, sp in ([] if a.only_torch else LAYOUTS)}  # all compiled first
    for prep in preps.values():  # warm-up round, not counted
        prep.round(per_round)
        prep.wall.clear()
        prep.cpu.clear()
    for _ in range(rounds):  # interleaved: load from other processes falls on every layout alike
        for prep in preps.values():
            prep.round(per_round)
    for label, prep in preps.items():
        r = {**prep.report(), **prep.extra}
        results["layouts"][label] = r
        comm = ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB" for k, v in r["collectives"].items())
        bound = ""
        if "bound" in r:
            bound = "  bound: " + ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB"
                                            for k, v in r["bound"]["total"].items() if v["count"])
        print(f"{label:24s} {r['samples_per_s']:8.1f} samples/s  cpu {r['cpu_ms_per_step']:7.0f} ms/step  state "
              f"{r['state_bytes_per_device'] / 2**20:6.2f} MiB/device  {comm}{bound}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    for label, dims in (TORCH_LAYOUTS if results["torch"] else []):
        r = run_torch(dims, steps, warmup)
        if "error" in r:
            print(f"{label}: {r['error'][-400:]}", flush=True)
            continue
        results["layouts"][label] = r
        print(f"{label:24s} {r['samples_per_s']:8.1f} samples/s  cpu {r['cpu_ms_per_step']:7.0f} ms/step  state "
              f"{r['state_bytes_per_device'] / 2**20:6.2f} MiB/device", flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
