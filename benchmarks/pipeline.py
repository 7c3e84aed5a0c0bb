"""Benchmark: pipeline schedules side by side (spmd.parallel.pipeline: gpipe, 1f1b, interleaved, looped_bfs).

The project's Transformer (8 blocks, d_model 64, 4 heads, vocabulary 64, sequences of 16) on ``pp=4``
(4 CPU fake devices), a batch of 32 sequences, AdamW, for each schedule at ``M = pp, 2pp, 4pp``
micro-batches (interleaved and looped_bfs: ``v = 2`` chunks of one block per rank).
Every layout is compiled first (the tick loop form, ``unroll=False``: one tick's program, so long schedules
compile in seconds; the sends per tick are the schedule's), then timed in interleaved rounds (median round).

Reported per layout:

- the bubble three ways: the **formula**; the **table's** (the tick table the compiled program runs: a
  tick holds at most one forward and one backward per rank, every action one unit, idle rank-units over
  all); and **timed** (``Schedule.timed``): the schedule replayed with the measured durations of one
  chunk's forward and backward (the backward recomputes the forward, so it is ~2-3x a forward, not the
  formula's 1x) -- ``lockstep`` (each tick lasts its slowest rank, as the SPMD program runs) and
  ``async`` (each rank starts an action as soon as its inputs exist, as an MPMD runtime would);
- step time and samples/s (on a CPU host the 8 devices share the cores, so a rank's bubble is another
  rank's compute: the wall clock cannot show the bubble here; it shows each schedule's cost);
- the compiled step's temp memory (``memory_analysis()``), the activation stash measured from
  ``memory_analysis()`` (``spmd.parallel.pipelining._memory.measure_activation_stash``: extra loop-form
  compiles, state donated) beside the schedule's bound (activation + gradient slots x one micro-batch's
  activation), and the collective-permutes the HLO holds.

torch (when installed): ``torch.distributed.pipelining`` with the same schedule (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``) and M, the same model split by hand
into ``PipelineStage``s (the head untied: torch cannot tie weights across stages), 4 gloo CPU processes of
one thread each.

    python benchmarks/pipeline.py           # a few minutes on 2 idle cores
    python benchmarks/pipeline.py --quick   # smoke run (M = pp only)

Writes benchmarks/results/pipeline.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VOCAB, SEQ, D, LAYERS, HEADS, BATCH, PP, DP = 64, 16, 64, 8, 4, 32, 4, 1
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped_bfs", 2))


def _timed(fn, *args, reps=5):
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def action_times(model, params, rows: int, layers: int) -> tuple[float, float]:
    """Seconds of one chunk's forward and of its backward (forward recomputed + vjp) on one device."""
    import jax
    import jax.numpy as jnp

    from models._transformer import _Block

    blk = _Block(HEADS, 2, jnp.float32)
    p = params["block_0"]
    x = jax.random.normal(jax.random.key(0), (rows, SEQ, D))

    def fwd(p, x):
        for _ in range(layers):
            x = blk.apply({"params": p}, x)
        return x

    def bwd(p, x, ct):
        _, pull = jax.vjp(fwd, p, x)
        return pull(ct)

    return _timed(jax.jit(fwd), p, x), _timed(jax.jit(bwd), p, x, x)


def main(argv):
    sys.path.insert(0, HERE)
    from _common import benchmark_args

    a = benchmark_args(argv, __doc__, "M = pp only", "torch.distributed.pipelining", _torch_main, ROOT)
    if a is None:
        return
    quick = a.quick
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import spmd
    from models import Transformer
    from spmd._inspect import hlo_collectives
    from spmd.parallel import hlo_executed_collectives, init_train_state, make_train_step, pipeline
    from spmd.parallel.pipelining._memory import measure_activation_stash

    model = Transformer(vocab_size=VOCAB, max_len=SEQ, num_layers=LAYERS, d_model=D, num_heads=HEADS, mlp_ratio=2)
    params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
    opt = optax.adamw(1e-3, weight_decay=0.01)
    tok = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1))
    batch = {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}
    mesh = spmd.init_device_mesh("cpu", (PP,), mesh_dim_names=("pp",))
    ms = (PP,) if quick else (PP, 2 * PP, 4 * PP)
    runs, stash_cache = [], {}  # the stash measurements' reference compiles, shared by the schedules
    for m in ms:
        for name, v in SCHEDULES:
            pm = pipeline(model, mesh["pp"], units="block_*", num_microbatches=m, schedule=name, stages_per_rank=v,
                          unroll=False)

            def loss_fn(p, b, pm=pm):
                logits = pm.apply({"params": p}, b["inputs"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

            state = init_train_state(pm, opt, params=params)
            step = make_train_step(pm, loss_fn, opt)
            t = time.perf_counter()
            compiled = step.compiled(state, batch)
            compile_s = time.perf_counter() - t
            table = step.communication(state, batch)
            stash = measure_activation_stash(pm, loss_fn, opt, state, batch, cache=stash_cache)["measured"][0]
            hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
            static = hlo_collectives(compiled.as_text())["collective-permute"]["count"]
            runs.append(dict(schedule=name, v=v, M=m, pp=PP, dp=DP, step=step, state=state, compile_s=compile_s,
                             table=table, memory=compiled.memory_analysis().temp_size_in_bytes,
                             hlo_permutes=static, stash=stash,
                             hlo_all_reduce_bytes=hlo["all-reduce"]["bytes"]))
            print(f"compiled {name} M={m} in {compile_s:.1f} s", flush=True)
    # timed rounds, interleaved over the layouts
    times = {i: [] for i in range(len(runs))}
    cpu = {i: [] for i in range(len(runs))}
    for i, r in enumerate(runs):
        r["state"], _ = r["step"](r["state"], batch)
        jax.block_until_ready(r["state"].params)
    for _ in range(2 if quick else 5):
        for i, r in enumerate(runs):
            t, c = time.perf_counter(), time.process_time()
            for _ in range(3):
                r["state"], met = r["step"](r["state"], batch)
            jax.block_until_ready(met["loss"])
            times[i].append((time.perf_counter() - t) / 3)
            cpu[i].append((time.process_time() - c) / 3)
    durations = {}
    out = []
    for i, r in enumerate(runs):
        s = r["step"].schedule
        rows = BATCH // DP // r["M"]
        layers = LAYERS // s.num_stages
        if (rows, layers) not in durations:
            durations[(rows, layers)] = action_times(model, params, rows, layers)
        t_f, t_b = durations[(rows, layers)]
        rep = s.timed(t_f, t_b)
        tb = r["table"]
        out.append({
            "schedule": r["schedule"], "M": r["M"], "pp": PP, "dp": DP, "v": r["v"], "ticks": len(s.ticks),
            "bubble_formula": s.formula, "bubble_table": s.bubble, "bubble_timed_lockstep": rep["lockstep"],
            "bubble_timed_async": rep["async"], "chunk_forward_ms": 1e3 * t_f, "chunk_backward_ms": 1e3 * t_b,
            "step_ms": 1e3 * statistics.median(times[i]), "step_ms_best": 1e3 * min(times[i]),
            "cpu_ms": 1e3 * statistics.median(cpu[i]), "samples_per_s": BATCH / statistics.median(times[i]),
            "compile_s": r["compile_s"], "temp_bytes": r["memory"], "activation_slots": tb["activation_slots"],
            "gradient_slots": tb["gradient_slots"], "activation_bytes": tb["activation_bytes"],
            "activation_bound_bytes": tb["activation_bound_bytes"],
            "activation_measured_bytes": r["stash"]["measured_bytes"],
            "transfers_per_pipeline": tb["collective-permute"]["pairs"],
            "permute_ops_table": tb["collective-permute"]["count"],
            # the loop form holds one collective-permute per distinct pair set (run at the ticks that send)
            "hlo_permute_instructions": r["hlo_permutes"], "distinct_pair_sets": len(
                {tuple(p) for d in "FB" for p in s.sends(d) if p}),
            "all_reduce_bytes_table": tb["all-reduce"]["bytes"], "all_reduce_bytes_hlo": r["hlo_all_reduce_bytes"],
        })
        if not a.no_torch:
            out[-1]["torch"] = run_torch(r["schedule"], r["M"], steps=3 if quick else 10, warmup=2)
        o = out[-1]
        print(f"{o['schedule']:>11} M={o['M']:>2}: bubble formula {o['bubble_formula']:.3f} table "
              f"{o['bubble_table']:.3f} timed lockstep {o['bubble_timed_lockstep']:.3f} async "
              f"{o['bubble_timed_async']:.3f}; step {o['step_ms']:.1f} ms ({o['samples_per_s']:.0f} samples/s); "
              f"temp {o['temp_bytes']} B, activation measured {o['activation_measured_bytes']} B, bound "
              f"{o['activation_bound_bytes']} B "
              f"({o['activation_slots']}+{o['gradient_slots']} slots); torch {o.get('torch')}", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = "pipeline_quick" if quick else "pipeline"
    meta = {"model": f"Transformer(vocab={VOCAB}, seq={SEQ}, d_model={D}, layers={LAYERS}, heads={HEADS})",
            "global_batch": BATCH, "mesh": f"pp={PP}", "devices": f"{PP} CPU fake devices (torch: {PP} gloo processes)",
            "jax": jax.__version__, "unroll": False}
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump({"meta": meta, "runs": out}, f, indent=1)
    plot(out, os.path.join(RESULTS, name + ".png"))


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, HERE)
    from _common import save_figure

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for k, (name, _) in enumerate(SCHEDULES):
        rs = [o for o in out if o["schedule"] == name]
        ms = [o["M"] for o in rs]
        c = f"C{k}"
        ax[0].plot(ms, [o["bubble_formula"] for o in rs], "-", color=c, label=f"{name} formula")
        ax[0].plot(ms, [o["bubble_table"] for o in rs], "o", color=c, label=f"{name} table")
        ax[0].plot(ms, [o["bubble_timed_lockstep"] for o in rs], "x--", color=c, label=f"{name} timed (lockstep)")
        ax[1].plot(ms, [o["step_ms"] for o in rs], "o-", color=c, label=f"ours {name}")
        if all("samples_per_s" in o.get("torch", {}) for o in rs):
            ax[1].plot(ms, [o["torch"]["step_ms"] for o in rs], "s:", color=c, label=f"torch {name}")
        ax[2].plot(ms, [o["temp_bytes"] / 1024 for o in rs], "o-", color=c, label=f"{name} temp")
        ax[2].plot(ms, [o["activation_bound_bytes"] / 1024 for o in rs], "x--", color=c, label=f"{name} stash bound")
        ax[2].plot(ms, [o["activation_measured_bytes"] / 1024 for o in rs], "+", ms=12, color=c,
                   label=f"{name} stash measured")
    ax[0].set(title=f"bubble, pp={PP}", xlabel="micro-batches M", ylabel="fraction of the step")
    ax[1].set(title=f"step time ({PP} CPU fake devices / torch: {PP} gloo processes)", xlabel="micro-batches M", ylabel="ms")
    ax[2].set(title="compiled temp memory; activation stash measured vs bound", xlabel="micro-batches M",
              ylabel="KiB per device")
    for a in ax:
        a.legend(fontsize=7)
        a.set_xscale("log", base=2)
    save_figure(fig, path)


# --- torch.distributed.pipelining on gloo CPU processes -------------------------------------------------
def _torch_worker(rank, world, name, m, steps, warmup, port, out_path):
    import datetime

    from _common import torch_timed  # benchmarks/ is on the path: this script's folder

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    v = 2 if name in ("interleaved", "looped_bfs") else 1
    n_st = world * v

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.fc_out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, w = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), w.transpose(1, 2), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class Stage(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.first, self.last = c == 0, c == n_st - 1
            if self.first:
                self.embed = nn.Embedding(VOCAB, D)
                self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS // n_st))
            if self.last:
                self.ln_f, self.out = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

        def forward(self, x):
            if self.first:
                x = self.embed(x) + self.pos[: x.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.out(self.ln_f(x)) if self.last else x

    torch.manual_seed(0)
    stages = [PipelineStage(Stage(c), c, n_st, torch.device("cpu")) for c in range(rank, n_st, world)]

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    if v == 1:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], m, loss_fn=loss_fn)
    else:
        chunked = {"interleaved": ScheduleInterleaved1F1B, "looped_bfs": ScheduleLoopedBFS}[name]
        sched = chunked(stages, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for st in stages for p in st.submod.parameters()], lr=1e-3, weight_decay=0.01)
    seq = torch.tensor(np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ + 1))).long()
    x, y = seq[:, :-1], seq[:, 1:]

    def step(i):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    dt, cpu = torch_timed(step, warmup, steps)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"samples_per_s": steps * BATCH / dt, "step_ms": 1000 * dt / steps,
                       "cpu_ms_per_step": 1000 * cpu * world / steps}, f)
    dist.destroy_process_group()


def _torch_main(what, world, steps, warmup, out_path):
    import torch.multiprocessing as mp
    from _common import free_port

    name, m = what.split(":")
    mp.spawn(_torch_worker, args=(world, name, int(m), steps, warmup, free_port(), out_path), nprocs=world, join=True)


def run_torch(name: str, m: int, steps: int, warmup: int) -> dict:
    from _common import run_torch_worker

    return run_torch_worker(__file__, [f"{name}:{m}", PP, steps, warmup], os.path.join(RESULTS, ".torch_pp.json"), 600,
                            tail=800)


if __name__ == "__main__":
    main(sys.argv[1:])
