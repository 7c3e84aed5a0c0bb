"""Benchmark: the tensor / sequence-parallel train step (spmd.parallel: parallelize_module + fully_shard + make_train_step) on n-D meshes against GSPMD.

For a GPT (the project's Transformer, d_model 256 x 4 layers, 8 heads, vocabulary 32, sequences of 16)
with AdamW + gradient clipping, at a global batch of 32 sequences and of 128, side by side in one run on
8 CPU fake devices:

- ours: ``dp=8`` (DDP, the baseline), ``tp=8`` and ``dp=2,tp=4`` (each with and without sequence parallelism),
  ``fsdp=2,tp=4`` with sequence parallelism and ``dp=2,fsdp=2,tp=2`` (re-gathering each block for its
  backward pass, and keeping the forward's gathers as GSPMD does): the Megatron plan
  (``models._plans.transformer_tp_plan``) composed with fsdp's default in one ``ParamPlan``;
- GSPMD: the same layouts as a JAX user writes them today, a global-view ``jax.jit`` step with every
  parameter and its AdamW moments placed by ``NamedSharding`` as the plan places it (heads / MLP width /
  vocabulary on ``tp``, the other dim on ``fsdp``), the batch over the data dims, XLA's partitioner
  choosing the communication.

Every JAX layout of a batch size is compiled first, then all are timed in interleaved rounds (the median
round is reported, the best too), so load from other processes falls on all layouts alike; every step's
batch is on the devices already, laid out over the data dims, for ours as for GSPMD. Each of our layouts
is also compared with GSPMD's on the same mesh round by round (``vs_gspmd``: the median and the range of
the per-round ratios of samples/s), which shows what of a difference is the host's noise.

Reported per layout: samples/s, CPU ms per step (less sensitive than wall time to other load on the host),
parameter + optimizer bytes per device (live arrays), the collectives the compiled step executes (loop
bodies times their trips) and, for ours, the plan's analytic ZeRO bound for the parameters (``ParamPlan.communication``; the tp activations' table is spmd.parallel's to give).

On a CPU host the 8 devices share the cores: throughput measures the cost of a layout, not a speed-up,
and other processes on the host make it noisy.

- torch (when installed): ``parallelize_module`` with the Megatron plan (q/k/v/fc ``ColwiseParallel``,
  proj/fc_out ``RowwiseParallel``, vocab-parallel embedding and an untied ``ColwiseParallel`` output
  with ``loss_parallel``) on ``tp`` and ``fully_shard`` per block over the other dims (HSDP on
  ``dp x fsdp``), 8 gloo CPU processes of one thread each; AdamW without gradient clipping (torch's
  ``clip_grad_norm_`` fails on parameters of a 1-D and a 2-D mesh together); at the batch of 32 only.

    python benchmarks/tensor_parallel.py           # about 7 minutes on 2 idle cores (torch included)
    python benchmarks/tensor_parallel.py --quick   # smoke run

Writes benchmarks/results/tensor_parallel.json and .png.
"""

from __future__ import annotations

import json
import os
import sys

from _common import benchmark_args, free_port, run_torch_worker, save_figure, versus_gspmd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VOCAB, SEQ, D, LAYERS, HEADS, BATCH = 32, 16, 256, 4, 8, 32  # BATCH: benchmarks/fsdp.py's (fb.BATCH)
BATCHES = (BATCH, 4 * BATCH)  # global batches: 4 sequences per data-parallel rank of dp=8, then 16
# (label, kind, mesh shape, dim names, sequence parallel, regather): regather=False ("keep") holds the forward
# pass's fsdp gathers for the backward pass (GSPMD's memory trade); otherwise each block is gathered again
LAYOUTS = [
    ("ours dp=8", "ours", (8,), ("dp",), False, True),
    # tp=8 runs as dp=1 x tp=8: spmd.parallel's step fails to trace on a mesh with no data dim
    ("ours tp=8", "ours", (1, 8), ("dp", "tp"), False, True),
    ("ours tp=8 sp", "ours", (1, 8), ("dp", "tp"), True, True),
    ("ours dp=2,tp=4", "ours", (2, 4), ("dp", "tp"), False, True),
    ("ours dp=2,tp=4 sp", "ours", (2, 4), ("dp", "tp"), True, True),
    ("ours fsdp=2,tp=4 sp", "ours", (2, 4), ("fsdp", "tp"), True, True),
    ("ours dp=2,fsdp=2,tp=2", "ours", (2, 2, 2), ("dp", "fsdp", "tp"), False, True),
    ("ours dp=2,fsdp=2,tp=2 keep", "ours", (2, 2, 2), ("dp", "fsdp", "tp"), False, False),
    ("gspmd tp=8", "gspmd", (8,), ("tp",), False, None),
    ("gspmd dp=2,tp=4", "gspmd", (2, 4), ("dp", "tp"), False, None),
    ("gspmd fsdp=2,tp=4", "gspmd", (2, 4), ("fsdp", "tp"), False, None),
    ("gspmd dp=2,fsdp=2,tp=2", "gspmd", (2, 2, 2), ("dp", "fsdp", "tp"), False, None),
]

# torch: parallelize_module on tp, fully_shard over the other dims (HSDP on dp x fsdp), gloo, 8 processes
TORCH_LAYOUTS = [
    ("torch tp=8", {"tp": 8}),
    ("torch fsdp=2,tp=4", {"fsdp": 2, "tp": 4}),
    ("torch dp=2,fsdp=2,tp=2", {"dp": 2, "fsdp": 2, "tp": 2}),
]


def _setup(shape, names, sp, batch):
    import jax
    import numpy as np

    import fsdp as fb  # benchmarks/fsdp.py: the timing, state bytes and optimizer of the FSDP benchmark
    import spmd
    from models import Transformer

    model = Transformer(VOCAB, SEQ, LAYERS, D, HEADS)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        seq = rng.integers(0, VOCAB, size=(batch, SEQ + 1)).astype(np.int32)
        batches.append({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    laid = _layout(model, mesh, sp)
    plan = laid.plan(params) if hasattr(laid, "plan") else None
    return fb, model, mesh, batches, params, plan


def _layout(model, mesh, sp, regather=True):
    """The job's layout of ``model`` on ``mesh`` (models._plans), with ``reshard_after_forward=regather``."""
    from models._plans import shard_units, transformer_tp_plan
    from spmd.parallel import fully_shard, parallelize_module

    names = mesh.mesh_dim_names
    out = model
    if "tp" in names:
        out = parallelize_module(out, mesh["tp"], transformer_tp_plan(sp, vocab_size=model.vocab_size,
                                                                      tp_size=mesh.size("tp")))
    data = tuple(n for n in names if n in ("dp", "fsdp"))
    if "fsdp" in names:
        out = fully_shard(out, mesh=mesh[data], units=shard_units(model), reshard_after_forward=regather)
    return out


def _on_devices(batches, mesh, names):
    """The batches on the devices, split over the data dims (dp, fsdp) and replicated over tp."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data = NamedSharding(mesh.jax_mesh, P(tuple(n for n in names if n in ("dp", "fsdp")) or None))
    return [jax.device_put(b, data) for b in batches]


def prepare_ours(shape, names, sp, batch=BATCH, regather=True):
    import jax

    from spmd.parallel import ParallelModule, hlo_executed_collectives, init_train_state, make_train_step

    fb, model, mesh, batches, params, _ = _setup(shape, names, sp, batch)
    opt = fb._optimizer()

    def loss_fn(p, b):
        return fb._ce(model.apply({"params": p}, b["inputs"]), b, accuracy=True)

    laid = _layout(model, mesh, sp, regather)
    if isinstance(laid, ParallelModule):
        step = make_train_step(laid, loss_fn, opt)
        state = init_train_state(laid, opt, params=params)
        # the parameters' ZeRO bound; the tp activations' analytic table is spmd.parallel's (step.communication)
        bound = (step.communication(state, batches[0]) if hasattr(step, "communication")
                 else {"total": state.plan.communication(dp="dp")["total"], "activations": {}})
        bound = {k: v for k, v in bound.items() if k != "modules"}  # the per-call records: printed, not saved
    else:
        step = make_train_step(model, loss_fn, opt, mesh=mesh)
        state = init_train_state(model, opt, params=params, mesh=mesh)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        bound = {"total": {"all-reduce": {"count": 1, "bytes": nbytes}}, "activations": {}}
    prep = fb._Prepared(step, state, _on_devices(batches, mesh, names), batch)
    got = hlo_executed_collectives(prep.compiled.as_text())
    prep.extra = dict(state_bytes_per_device=fb._state_bytes(prep.state), bound=bound,
                      collectives={k: v for k, v in got.items() if v["count"]})
    return prep


def _prod(sizes: dict, axes) -> int:
    out = 1
    for a in (axes,) if isinstance(axes, str) else axes:
        out *= sizes[a]
    return out


def prepare_gspmd(shape, names, batch=BATCH):
    """Global view: the plan's placements as NamedShardings, GSPMD partitions the step."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax.numpy as jnp

    from spmd.parallel import TrainState, entry_sharding, hlo_executed_collectives, map_like_params, plan_params

    fb, model, mesh, batches, params, plan = _setup(shape, names, False, batch)
    if plan is None:  # dp only: every parameter replicated
        plan = plan_params(params, mesh, fsdp="")
    opt = fb._optimizer()
    rep = NamedSharding(mesh.jax_mesh, P())
    state = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))
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

    jitted = jax.jit(fb.gspmd_step(model, opt, accuracy=True), in_shardings=(shardings, data),
                     out_shardings=(shardings, rep))
    prep = fb._Prepared(jitted, state, batches, batch)
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
    world = 1
    for v in dims.values():
        world *= v
    spec = ",".join(f"{k}={v}" for k, v in dims.items())
    return run_torch_worker(__file__, [spec, world, steps, warmup], os.path.join(RESULTS, ".torch_tp.json"), timeout,
                            tail=800)


def _torch_main(spec, world, steps, warmup, out_path):
    import torch.multiprocessing as mp

    dims = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    mp.spawn(_torch_worker, args=(int(world), dims, int(steps), int(warmup), free_port(), out_path), nprocs=int(world),
             join=True)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(results["runs"].values())
    fig, axes = plt.subplots(len(runs), 4, figsize=(20, 4.8 * len(runs)), squeeze=False)
    comm = lambda r: sum(v["bytes"] for v in r["collectives"].values()) / 2**20  # noqa: E731
    color = {"ours": "C0", "gspmd": "C1", "torch": "C2"}
    for row, run in zip(axes, runs):
        labels = list(run["layouts"])
        for ax, fn, title in ((row[0], lambda r: r["samples_per_s"], "samples/s (higher is better)"),
                              (row[1], lambda r: r["cpu_ms_per_step"], "CPU ms/step, all threads (lower is better)"),
                              (row[2], lambda r: r["state_bytes_per_device"] / 2**20, "params + AdamW MiB per device"),
                              (row[3], comm, "MiB communicated per device per step (XLA HLO)")):
            ax.bar(range(len(labels)), [fn(run["layouts"][k]) for k in labels],
                   color=[color[k.split()[0]] for k in labels])
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
            ax.set_title(f"batch {run['batch']}: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Tensor parallel GPT d{D}x{LAYERS} on 8 CPU devices: ours (blue), GSPMD NamedSharding (orange), "
                 "torch parallelize_module + fully_shard (green)")
    save_figure(fig, path)


def _fmt(collectives: dict) -> str:
    return ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB" for k, v in collectives.items() if v["count"])


def main(argv=None) -> int:
    a = benchmark_args(argv, __doc__, "smoke run: the batch of 32, 2 rounds of 1 step",
                       "torch parallelize_module + fully_shard", _torch_main, ROOT)
    if a is None:
        return 0
    import jax

    steps, warmup = (2, 1) if a.quick else (6, 2)
    rounds = 2 if a.quick else 7
    name = "tensor_parallel_quick" if a.quick else "tensor_parallel"
    try:
        import torch

        torch_version = None if a.no_torch else torch.__version__
    except ImportError:
        torch_version = None
    results = {"jax": jax.__version__, "torch": torch_version, "rounds": rounds,
               "model": dict(d_model=D, layers=LAYERS, heads=HEADS, vocab=VOCAB, seq=SEQ), "runs": {}}
    for batch in BATCHES[:1] if a.quick else BATCHES:
        per_round = 1 if a.quick else max(1, 3 * BATCH // batch)
        run = results["runs"][f"batch {batch}"] = {"batch": batch, "steps_per_round": per_round, "layouts": {}}
        preps = {label: prepare_ours(shape, names, sp, batch, regather) if kind == "ours"
                 else prepare_gspmd(shape, names, batch)
                 for label, kind, shape, names, sp, regather in LAYOUTS}  # all compiled first
        for prep in preps.values():  # warm-up round, not counted
            prep.round(per_round)
            prep.wall.clear()
            prep.cpu.clear()
        for _ in range(rounds):  # interleaved: load from other processes falls on every layout alike
            for prep in preps.values():
                prep.round(per_round)
        for label, prep in preps.items():
            r = run["layouts"][label] = {**prep.report(), **prep.extra}
            ratio, vs = versus_gspmd(label, preps)
            if ratio is not None:
                r["vs_gspmd"] = ratio
            bound = "  bound: " + _fmt(r["bound"]["total"]) if "bound" in r else ""
            print(f"batch {batch} {label:24s} {r['samples_per_s']:8.1f} samples/s{vs}  cpu {r['cpu_ms_per_step']:5.0f} "
                  f"ms/step  state {r['state_bytes_per_device'] / 2**20:6.2f} MiB/device  {_fmt(r['collectives'])}"
                  f"{bound}", flush=True)
        del preps
        for label, dims in (TORCH_LAYOUTS if torch_version and batch == BATCH else []):
            r = run_torch(dims, steps, warmup)
            if "error" in r:
                print(f"{label}: {r['error'][-400:]}", flush=True)
                continue
            run["layouts"][label] = r
            print(f"batch {batch} {label:24s} {r['samples_per_s']:8.1f} samples/s  cpu {r['cpu_ms_per_step']:5.0f} "
                  f"ms/step  state {r['state_bytes_per_device'] / 2**20:6.2f} MiB/device", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
