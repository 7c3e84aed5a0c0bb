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

Reported per layout: samples/s, CPU ms per step (less sensitive than wall time to other load on the host),
parameter + optimizer bytes per device (live arrays), the collectives the compiled step executes (loop
bodies times their trips) and, for ours, the analytic Megatron / ZeRO bound (``models._tp_comm``).

On a CPU host the 8 devices share the cores: throughput measures the cost of a layout, not a speed-up,
and other processes on the host make it noisy. torch ``parallelize_module`` + ``fully_shard`` is not run.

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
VOCAB, SEQ, D, LAYERS, HEADS = 32, 16, 256, 4, 8
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


def run_ours(shape, names, sp, steps, warmup) -> dict:
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
    state, compiled, res = fb._timed(step, state, batches, steps, warmup)
    got = hlo_executed_collectives(compiled.as_text())
    res.update(state_bytes_per_device=fb._state_bytes(state), bound=bound,
               collectives={k: v for k, v in got.items() if v["count"]})
    return res


def _prod(sizes: dict, axes) -> int:
    out = 1
    for a in (axes,) if isinstance(axes, str) else axes:
        out *= sizes[a]
    return out


def run_gspmd(shape, names, steps, warmup) -> dict:
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
    data = NamedSharding(mesh.jax_mesh, P(tuple(n for n in names if n in ("dp", "fsdp")) or None))
    batches = [jax.device_put(b, data) for b in batches]

    def step(state, batch):
        (loss, _), g = jax.value_and_grad(lambda p: fb._ce(model.apply({"params": p}, batch["inputs"]), batch),
                                          has_aux=True)(state.params)
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), {"loss": loss}

    jitted = jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, rep))
    state, compiled, res = fb._timed(jitted, state, batches, steps, warmup)
    got = hlo_executed_collectives(compiled.as_text())
    res.update(state_bytes_per_device=fb._state_bytes(state), collectives={k: v for k, v in got.items() if v["count"]})
    return res


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["layouts"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    comm = lambda r: sum(v["bytes"] for v in r["collectives"].values()) / 2**20  # noqa: E731
    for ax, fn, title in ((axes[0], lambda r: r["samples_per_s"], "samples/s (higher is better)"),
                          (axes[1], lambda r: r["state_bytes_per_device"] / 2**20, "params + AdamW MiB per device"),
                          (axes[2], comm, "MiB communicated per device per step")):
        ax.bar(range(len(labels)), [fn(results["layouts"][k]) for k in labels],
               color=["C0" if k.startswith("ours") else "C1" for k in labels])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Tensor parallel GPT d{D}x{LAYERS} on 8 CPU devices: ours (blue) vs GSPMD NamedSharding (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import jax

    steps, warmup = (2, 1) if a.quick else (6, 2)
    results = {"jax": jax.__version__, "model": dict(d_model=D, layers=LAYERS, heads=HEADS, vocab=VOCAB, seq=SEQ),
               "steps": steps, "layouts": {}}
    for label, kind, shape, names, sp in LAYOUTS:
        r = run_ours(shape, names, sp, steps, warmup) if kind == "ours" else run_gspmd(shape, names, steps, warmup)
        results["layouts"][label] = r
        comm = ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB" for k, v in r["collectives"].items())
        bound = ""
        if "bound" in r:
            bound = "  bound: " + ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB"
                                            for k, v in r["bound"]["total"].items() if v["count"])
        print(f"{label:24s} {r['samples_per_s']:8.1f} samples/s  cpu {r['cpu_ms_per_step']:7.0f} ms/step  state "
              f"{r['state_bytes_per_device'] / 2**20:6.2f} MiB/device  {comm}{bound}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = "tensor_parallel_quick" if a.quick else "tensor_parallel"
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
