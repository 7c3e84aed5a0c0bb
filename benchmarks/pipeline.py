"""Benchmark: pipeline schedules side by side (spmd.parallel.pipeline: gpipe, 1f1b, interleaved).

The project's Transformer (8 blocks, d_model 64, 4 heads, vocabulary 64, sequences of 16) on ``pp=4,dp=2``
(8 CPU fake devices), a global batch of 64 sequences (32 per pipeline), AdamW + clipping, for each
schedule at ``M = pp, 2pp, 4pp`` micro-batches (interleaved: ``v = 2`` chunks of one block per rank).
Every layout is compiled first (the tick loop form, ``unroll=False``: one tick's program, so long schedules
compile in seconds; the sends per tick are the schedule's), then timed in interleaved rounds (median round).

Reported per layout:

- the bubble three ways: the **formula**; the **table's** (idle rank-ticks / all rank-ticks of the tick
  table the compiled program runs); and **timed**: the schedule replayed with the measured durations of one
  chunk's forward and backward (the backward recomputes the forward, so it is ~3x a forward, not the
  formula's 1x) -- ``lockstep`` (each tick lasts its slowest action, as the SPMD program runs) and
  ``async`` (each rank starts an action as soon as its inputs exist, as an MPMD runtime would);
- step time and samples/s (on a CPU host the 8 devices share the cores, so a rank's bubble is another
  rank's compute: the wall clock cannot show the bubble here; it shows each schedule's cost);
- the compiled step's temp memory (``memory_analysis()``) and the schedule's activation bound (activation
  + gradient slots x one micro-batch's activation), and the collective-permutes the HLO holds.

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
VOCAB, SEQ, D, LAYERS, HEADS, BATCH, PP, DP = 64, 16, 64, 8, 4, 64, 4, 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def _timed(fn, *args, reps=5):
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def replay(schedule, t_f: float, t_b: float) -> dict:
    """The tick table replayed with action durations: lockstep (SPMD) and async (MPMD) bubbles."""
    pp, stages = schedule.pp, schedule.num_stages
    dur = {"F": t_f, "B": t_b}
    busy = sum(dur[a.kind] for row in schedule.ticks for a in row if a is not None)
    lock = sum(max((dur[a.kind] for a in row if a is not None), default=0.0) for row in schedule.ticks)
    free, fin = [0.0] * pp, {}
    for row in schedule.ticks:
        for r, a in enumerate(row):
            if a is None:
                continue
            deps = [("F", a.chunk - 1, a.mb)] if a.kind == "F" and a.chunk > 0 else []
            if a.kind == "B":
                deps += [("F", a.chunk, a.mb)] + ([("B", a.chunk + 1, a.mb)] if a.chunk < stages - 1 else [])
            start = max([free[r]] + [fin[d] for d in deps])
            fin[(a.kind, a.chunk, a.mb)] = free[r] = start + dur[a.kind]
    return {"lockstep": 1 - busy / (pp * lock), "async": 1 - busy / (pp * max(free)),
            "lockstep_s": lock, "async_s": max(free)}


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
    quick = "--quick" in argv
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import spmd
    from models import Transformer
    from spmd.parallel import hlo_executed_collectives, init_train_state, make_train_step, pipeline

    model = Transformer(vocab_size=VOCAB, max_len=SEQ, num_layers=LAYERS, d_model=D, num_heads=HEADS, mlp_ratio=2)
    params = model.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    tok = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1))
    batch = {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}
    mesh = spmd.init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    ms = (PP,) if quick else (PP, 2 * PP, 4 * PP)
    runs = []
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
            hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
            runs.append(dict(schedule=name, v=v, M=m, pp=PP, dp=DP, step=step, state=state, compile_s=compile_s,
                             table=table, memory=compiled.memory_analysis().temp_size_in_bytes,
                             hlo_permutes=hlo["collective-permute"]["count"],
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
        rep = replay(s, t_f, t_b)
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
            "transfers_per_pipeline": tb["collective-permute"]["pairs"],
            "permute_ops_table": tb["collective-permute"]["count"], "hlo_permute_instructions": r["hlo_permutes"],
            "all_reduce_bytes_table": tb["all-reduce"]["bytes"], "all_reduce_bytes_hlo": r["hlo_all_reduce_bytes"],
        })
        o = out[-1]
        print(f"{o['schedule']:>11} M={o['M']:>2}: bubble formula {o['bubble_formula']:.3f} table "
              f"{o['bubble_table']:.3f} timed lockstep {o['bubble_timed_lockstep']:.3f} async "
              f"{o['bubble_timed_async']:.3f}; step {o['step_ms']:.1f} ms ({o['samples_per_s']:.0f} samples/s); "
              f"temp {o['temp_bytes']} B, activation bound {o['activation_bound_bytes']} B "
              f"({o['activation_slots']}+{o['gradient_slots']} slots)", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    name = "pipeline_quick" if quick else "pipeline"
    meta = {"model": f"Transformer(vocab={VOCAB}, seq={SEQ}, d_model={D}, layers={LAYERS}, heads={HEADS})",
            "global_batch": BATCH, "mesh": f"pp={PP},dp={DP}", "devices": "8 CPU fake devices",
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
        ax[1].plot(ms, [o["step_ms"] for o in rs], "o-", color=c, label=name)
        ax[2].plot(ms, [o["temp_bytes"] / 1024 for o in rs], "o-", color=c, label=f"{name} temp")
        ax[2].plot(ms, [o["activation_bound_bytes"] / 1024 for o in rs], "x--", color=c, label=f"{name} bound")
    ax[0].set(title=f"bubble, pp={PP}", xlabel="micro-batches M", ylabel="fraction of the step")
    ax[1].set(title="step time (8 CPU fake devices on shared cores)", xlabel="micro-batches M", ylabel="ms")
    ax[2].set(title="compiled temp memory vs activation bound", xlabel="micro-batches M", ylabel="KiB per device")
    for a in ax:
        a.legend(fontsize=7)
        a.set_xscale("log", base=2)
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])
