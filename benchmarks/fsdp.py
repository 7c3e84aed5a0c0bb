"""Benchmark: the fully sharded train step (spmd.parallel: fully_shard + make_train_step) against GSPMD and torch FSDP2.

For a GPT (the project's Transformer; d_model 256 x 4 layers, and a larger
one) with AdamW + gradient clipping, at a global batch of 32 sequences (4 per
device) and of 128 (16 per device), side by side in one run on 8 CPU fake
devices:

- ours: ``dp=8`` (DDP), ``fsdp=8`` re-gathering each block for the backward
  pass (``regather``) and keeping the forward gathers (``keep``), and
  ``dp=2,fsdp=4`` (HSDP);
- GSPMD: the same model as a JAX user writes it today, a global-view
  ``jax.jit`` step with every parameter (and its AdamW moments) placed by
  ``NamedSharding`` on its largest dim over the sharded mesh axis, for
  ``fsdp=8`` and ``dp=2,fsdp=4``;
- torch FSDP2 (``fully_shard`` per block, then the root; gloo, 8 CPU
  processes, one thread each) when torch is installed.

Reported per layout: samples/s (the median of interleaved rounds: every JAX
layout of a run is compiled first, then timed in 7 rounds of 4 steps, 2 at
the larger batch, the layouts taking turns, so load from other processes on
the host falls on all of them alike; the best round too; the batches are on
the devices already, for ours as for GSPMD), CPU time per step (all threads of the process,
or of the 8 torch processes: less sensitive to other load on the host than
wall time), parameter + optimizer bytes per device (from
the live arrays), the analytic peak of gathered parameter bytes and XLA's
temp buffer bytes (``memory_analysis``), and the collectives the compiled step
executes (loop bodies times their trips) next to the plan's analytic bound. Each of our layouts is
also compared with GSPMD's on the same mesh round by round (``vs_gspmd``: the median and the range of the
per-round ratios of samples/s), which shows what of a difference is the host's noise. Both steps return
the same metrics (the loss and the gradient norm).

On a CPU host the 8 devices share the cores: throughput measures the cost of
the layout, not a speed-up; other processes on the host make it noisy.

    python benchmarks/fsdp.py            # about 8 minutes on 2 idle cores (torch included)
    python benchmarks/fsdp.py --quick    # smoke run

Writes benchmarks/results/fsdp.json and benchmarks/results/fsdp.png.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _common import benchmark_args, free_port, run_torch_worker, save_figure, torch_gpt, torch_timed, versus_gspmd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VOCAB, SEQ, BATCH, LR = 11, 17, 32, 3e-3  # BATCH: also benchmarks/tensor_parallel.py's
SIZES = {"d256x4": dict(d_model=256, layers=4, heads=4), "d384x6": dict(d_model=384, layers=6, heads=6),
         "d768x6": dict(d_model=768, layers=6, heads=12)}  # d768x6: benchmarks/auto_layout.py's 4x larger model
# (size, global batch): 4 sequences of 17 tokens per device, then 16.
RUNS = [("d256x4", BATCH), ("d384x6", BATCH), ("d256x4", 4 * BATCH), ("d384x6", 4 * BATCH)]


def _batches(rank: int, world: int, batch: int, n: int = 4):
    import numpy as np

    rng = np.random.default_rng(rank)
    out = []
    for _ in range(n):
        seq = rng.integers(0, VOCAB, size=(batch // world, SEQ + 1)).astype(np.int32)
        out.append({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    return out


# --- torch FSDP2 (its own process tree) -----------------------------------------------------------
def _torch_worker(rank, world, run, steps, warmup, port, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # one thread per process on a shared host (see benchmarks/ddp.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=300))
    size, batch = run.split(":")
    batch = int(batch)
    d, layers, h = SIZES[size]["d_model"], SIZES[size]["layers"], SIZES[size]["heads"]

    torch.manual_seed(0)
    model = torch_gpt(VOCAB, SEQ, d, layers, h)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batches = [(torch.tensor(b["inputs"]).long(), torch.tensor(b["targets"]).long()) for b in _batches(rank, world, batch)]

    def step(i):
        x, y = batches[i % len(batches)]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    dt, cpu = torch_timed(step, warmup, steps)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    moments = sum(v.to_local().numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if hasattr(v, "to_local") and v.dim() > 0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"samples_per_s": steps * batch / dt, "step_ms": 1000 * dt / steps,
                   "cpu_ms_per_step": 1000 * cpu * world / steps,  # rank 0's CPU time times the ranks
                       "state_bytes_per_device": local + moments}, f)
    dist.destroy_process_group()


def run_torch(size: str, batch: int, world: int, steps: int, warmup: int, timeout: float = 400.0) -> dict:
    out_path = os.path.join(RESULTS, f".torch_fsdp_{size}_{batch}_{world}.json")
    return run_torch_worker(__file__, [f"{size}:{batch}", world, steps, warmup], out_path, timeout, tail=800)


def _torch_main(size, world, steps, warmup, out_path):
    import torch.multiprocessing as mp

    mp.spawn(_torch_worker, args=(world, size, steps, warmup, free_port(), out_path), nprocs=world, join=True)


# --- JAX ------------------------------------------------------------------------------------------
def _ce(logits, batch, accuracy: bool = False):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits)
    aux = {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == batch["targets"])} if accuracy else {}
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)), aux


def gspmd_step(model, opt, accuracy: bool = False):
    """The global-view train step a JAX user writes, returning the metrics ours returns (the loss, the
    accuracy where ours computes it, the gradient norm), so both do the same work."""
    import jax
    import optax

    from spmd.parallel import TrainState

    def step(state, batch):
        (loss, aux), g = jax.value_and_grad(
            lambda p: _ce(model.apply({"params": p}, batch["inputs"]), batch, accuracy), has_aux=True)(state.params)
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
        return new, {"loss": loss, **aux, "grad_norm": optax.tree.norm(g)}

    return step


class _Prepared:
    """A compiled step with its state and batches, timed in rounds interleaved with the other layouts."""

    def __init__(self, step, state, batches, batch: int):
        from spmd.parallel.auto._measure import compiled_warm

        self.batch = batch
        t0 = time.perf_counter()
        compiled = step.lower(state, batches[0]).compile()
        self.compile_s = time.perf_counter() - t0
        self.batches, self.wall, self.cpu = batches, [], []
        # warmed up; compiled again for the state a step returns where that is laid out otherwise
        self.compiled, self.state, self.state_layout_changed = compiled_warm(step, state, batches[0], compiled)

    def round(self, steps: int) -> None:
        import jax

        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(steps):
            self.state, m = self.compiled(self.state, self.batches[i % len(self.batches)])
        jax.block_until_ready((self.state, m))
        self.wall.append((time.perf_counter() - t0) / steps)
        self.cpu.append((time.process_time() - c0) / steps)

    def report(self) -> dict:
        import statistics

        mem = self.compiled.memory_analysis()
        wall, cpu = statistics.median(self.wall), statistics.median(self.cpu)
        return {"samples_per_s": self.batch / wall, "samples_per_s_best": self.batch / min(self.wall),
                "step_ms": 1000 * wall, "cpu_ms_per_step": 1000 * cpu, "rounds": len(self.wall),
                "compile_s": self.compile_s, "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None)}


def _state_bytes(state) -> int:
    import jax

    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves((state.params, state.opt_state))
               for s in x.addressable_shards if s.device == dev)


def _optimizer():
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.01))


def prepare_ours(size: str, batch: int, shape: tuple, names: tuple, regather: bool = True):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import spmd
    from models import Transformer
    from models._plans import shard_units
    from spmd.parallel import fully_shard, hlo_executed_collectives, init_train_state, make_train_step

    model = Transformer(VOCAB, SEQ, SIZES[size]["layers"], SIZES[size]["d_model"], SIZES[size]["heads"])
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    batches = _batches(0, 1, batch)
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    opt = _optimizer()
    def loss_fn(p, b):
        return _ce(model.apply({"params": p}, b["inputs"]), b)

    if "fsdp" in names:
        laid = fully_shard(model, mesh=mesh, units=shard_units(model), reshard_after_forward=regather)
        step = make_train_step(laid, loss_fn, opt)
        state = init_train_state(laid, opt, params=params)
        bound = state.plan.communication(dp="dp")["total"]
        peak = state.plan.peak_gathered_bytes()
    else:
        step = make_train_step(model, loss_fn, opt, mesh=mesh)
        state = init_train_state(model, opt, params=params, mesh=mesh)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        bound, peak = {"all-reduce": {"count": 1, "bytes": nbytes}}, 0
    # On the devices already, split over every mesh dim as the step reads them (as the GSPMD step's batches).
    batches = [jax.device_put(b, NamedSharding(mesh.jax_mesh, P(names))) for b in batches]
    prep = _Prepared(step, state, batches, batch)
    got = hlo_executed_collectives(prep.compiled.as_text())
    prep.extra = dict(state_bytes_per_device=_state_bytes(prep.state), peak_gathered_bytes=peak,
                      collectives={k: v for k, v in got.items() if v["count"]}, bound=bound,
                      parameters=sum(x.size for x in jax.tree.leaves(params)))
    return prep


def prepare_gspmd(size: str, batch: int, shape: tuple, names: tuple):
    """Global view: NamedSharding on each parameter's largest dim over ``fsdp``, the batch over every dim."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import spmd
    import jax.numpy as jnp

    from models import Transformer
    from spmd.parallel import TrainState, hlo_executed_collectives

    model = Transformer(VOCAB, SEQ, SIZES[size]["layers"], SIZES[size]["d_model"], SIZES[size]["heads"])
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names).jax_mesh
    batches = _batches(0, 1, batch)
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    opt = _optimizer()

    def spec(x):
        if x.ndim == 0:
            return NamedSharding(mesh, P())
        d = max(range(x.ndim), key=lambda i: x.shape[i])
        axes = [None] * x.ndim
        axes[d] = "fsdp"
        return NamedSharding(mesh, P(*axes))

    state = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))
    shardings = TrainState(step=NamedSharding(mesh, P()), params=jax.tree.map(spec, state.params),
                           opt_state=jax.tree.map(spec, state.opt_state))
    state = jax.device_put(state, shardings)
    data = NamedSharding(mesh, P(names))
    batches = [jax.device_put(b, data) for b in batches]

    jitted = jax.jit(gspmd_step(model, opt), in_shardings=(shardings, data),
                     out_shardings=(shardings, NamedSharding(mesh, P())))
    prep = _Prepared(jitted, state, batches, batch)
    got = hlo_executed_collectives(prep.compiled.as_text())
    prep.extra = dict(state_bytes_per_device=_state_bytes(prep.state),
                      collectives={k: v for k, v in got.items() if v["count"]})
    return prep


LAYOUTS = [
    ("ours dp=8", "ours", (8,), ("dp",), True),
    ("ours fsdp=8 regather", "ours", (8,), ("fsdp",), True),
    ("ours fsdp=8 keep", "ours", (8,), ("fsdp",), False),
    ("ours dp=2,fsdp=4", "ours", (2, 4), ("dp", "fsdp"), True),
    ("gspmd fsdp=8", "gspmd", (8,), ("fsdp",), None),
    ("gspmd dp=2,fsdp=4", "gspmd", (2, 4), ("dp", "fsdp"), None),
]


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "samples_per_s", "samples/s (higher is better)"),
                           (axes[1], "state_bytes_per_device", "params + AdamW bytes per device")):
        labels = [label for label, *_ in LAYOUTS] + ["torch FSDP2 8 procs"]
        width = 0.8 / len(sizes)
        for j, size in enumerate(sizes):
            vals = [(results["runs"][size].get(label) or {}).get(key) or 0 for label in labels]
            ax.bar([i + j * width for i in range(len(labels))], vals, width, label=size)
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle("FSDP on 8 CPU devices: ours vs GSPMD (NamedSharding) vs torch FSDP2")
    save_figure(fig, path)


def main(argv=None) -> int:
    a = benchmark_args(argv, __doc__, "smoke run: the small size, 2 steps", "torch FSDP2", _torch_main, ROOT)
    if a is None:
        return 0
    import jax

    try:
        import torch

        torch_version = None if a.no_torch else torch.__version__
    except ImportError:
        torch_version = None
    rounds = 2 if a.quick else 7
    torch_steps, torch_warmup = (2, 1) if a.quick else (6, 2)
    runs = [("d256x4", 32)] if a.quick else RUNS
    results = {"jax": jax.__version__, "torch": torch_version, "seq": SEQ, "rounds": rounds, "runs": {}}
    for size, batch in runs:
        name = f"{size}, batch {batch}"
        steps = 2 if a.quick or batch > BATCH else 4  # per round
        entry = results["runs"][name] = {"size": size, "batch": batch, "steps_per_round": steps}
        preps = {label: prepare_ours(size, batch, shape, names, regather) if kind == "ours"
                 else prepare_gspmd(size, batch, shape, names) for label, kind, shape, names, regather in LAYOUTS}
        for _ in range(rounds):  # interleaved: load from other processes on the host hits every layout alike
            for prep in preps.values():
                prep.round(steps)
        for label, prep in preps.items():
            r = entry[label] = {**prep.report(), **prep.extra}
            comm = ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB" for k, v in r["collectives"].items())
            ratio, vs = versus_gspmd(label, preps)
            if ratio is not None:
                r["vs_gspmd"] = ratio
            print(f"{name} {label:22s} {r['samples_per_s']:8.1f} samples/s (best {r['samples_per_s_best']:6.1f}){vs}  "
                  f"cpu {r['cpu_ms_per_step']:5.0f} ms/step  state {r['state_bytes_per_device'] / 2**20:6.2f} "
                  f"MiB/device  temp {(r['xla_temp_bytes'] or 0) / 2**20:6.1f} MiB  {comm}", flush=True)
        del preps
        if torch_version:
            r = entry["torch FSDP2 8 procs"] = run_torch(size, batch, 8, torch_steps, torch_warmup)
            print(f"{name} torch FSDP2 8 procs: " + (f"{r['samples_per_s']:8.1f} samples/s  state "
                  f"{r['state_bytes_per_device'] / 2**20:6.2f} MiB/device" if "error" not in r else r["error"][-300:]),
                  flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = "fsdp_quick" if a.quick else "fsdp"
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
