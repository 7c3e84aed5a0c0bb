"""Benchmark: ``spmd.parallel.auto_layout``'s predicted step time and memory against the measured ones, and its
pick against GSPMD's.

For the project's Transformer (d256x4, d384x6 of benchmarks/fsdp.py and the 4x larger d768x6) at global batches
of 32 and 128 on 8 CPU fake devices, with memory unlimited and under a tight budget (3/4 of the unlimited
pick's predicted peak): ``auto_layout`` ranks every candidate (dp x fsdp x tp, reshard_after_forward, sequence
parallelism, the weight-stationary layout ``ws``, the pipelines over pp; ``calibrate()`` on this machine);
the top predicted candidates, a few lower-ranked ones, the best-ranked weight-stationary one and the
best-ranked pipeline are each built with ``apply_layout`` + ``init_train_state`` + ``make_train_step``,
compiled, and timed side by side in interleaved rounds (benchmarks/fsdp.py's timer) together with GSPMD's
pick of the same model (a global-view ``jax.jit`` step, each parameter and its AdamW moments cut on its
largest dim over all 8 devices, the batch over all 8).

``auto_layout`` picks with ``measure=4`` (its top 4 predicted compiled and timed before it picks;
``AUTO_LAYOUT_AUTOTUNE=0``: the cost model's pick alone); the cost model's own pick (the fastest predicted)
is measured beside it.

Reported per config: predicted vs measured step time and peak memory per device (XLA's ``memory_analysis``:
arguments + outputs + temp) for each measured candidate, the Spearman rank correlation of predicted and
measured time, the pick's measured samples/s over the best measured candidate's (and the cost model's own
pick's), and over GSPMD's. How much of pick/best is noise (``pick_over_best_noise``): its bootstrap 90%
interval over the rounds, and an oracle's split-half score (picked on the odd rounds, judged on the even):
on this 2-core host one round of a step varies by 9-18%, and the best of 8 noisy medians is biased low.

On a CPU host the 8 devices share the cores (and other processes share the host): the times are noisy;
compare within one run.

    python benchmarks/auto_layout.py           # the grid: 3 sizes x batches 32, 128 x unlimited, tight
    python benchmarks/auto_layout.py --quick   # d256x4 at batch 32, 6 candidates, 4 rounds
    AUTO_LAYOUT_RUNS=d256x4:32,d768x6:32:tight python benchmarks/auto_layout.py   # a part of the grid
    AUTO_LAYOUT_MEASURED=4 ...                 # fewer candidates held at once (d768x6 in 24 GiB)
    AUTO_LAYOUT_AUTOTUNE=0 ...                 # the cost model's pick, nothing timed before picking
    AUTO_LAYOUT_OUT=part ...                   # write results/part.json (a part of the grid) instead
    AUTO_LAYOUT_MERGE=auto_layout,part python benchmarks/auto_layout.py   # merge parts, the later's configs
                                               # over the earlier's, into auto_layout.json and .png; nothing runs

Writes benchmarks/results/auto_layout.json and .png (auto_layout_quick.* with --quick).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

from _common import benchmark_args, save_figure  # noqa: E402

RUNS = [(size, batch, budget) for size in ("d256x4", "d384x6", "d768x6") for batch in (32, 128)
        for budget in ("unlimited", "tight")]
TIGHT = 0.75  # the tight budget: this share of the unlimited pick's predicted peak


def _ranks(x):
    import numpy as np

    order = np.argsort(x)
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    return r


def spearman(a, b) -> float:
    import numpy as np

    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(_ranks(np.asarray(a)), _ranks(np.asarray(b)))[0, 1])


def pick_over_best_spread(rounds: dict, pick: str, n: int = 2000, seed: int = 0) -> dict:
    """How far the measured pick/best is noise: ``rounds``: each measured candidate's round times.

    ``ci90``: the 5th and 95th percentiles of best/pick over ``n`` bootstrap resamples of every candidate's
    rounds (its median each time); ``p_within_5pct``: the share of resamples where the pick is within 5% of
    the best; ``oracle_split_half``: the noise floor of the metric itself, the best/pick of an oracle that
    picks on the odd rounds judged on the even ones, and the reverse (the lower of the two): a perfect
    picker scores this against one more measurement on this host."""
    import numpy as np

    rng = np.random.default_rng(seed)
    names = list(rounds)
    meds = np.stack([np.median(rng.choice(np.asarray(w), size=(n, len(w))), axis=1) for w in rounds.values()])
    ratio = meds.min(0) / meds[names.index(pick)]
    halves = []
    for a, b in ((0, 1), (1, 0)):
        first = [np.median(w[a::2]) for w in rounds.values()]
        second = [np.median(w[b::2]) for w in rounds.values()]
        halves.append(min(second) / second[int(np.argmin(first))])
    return {"ci90": [float(np.quantile(ratio, 0.05)), float(np.quantile(ratio, 0.95))],
            "p_within_5pct": float((ratio >= 0.95).mean()), "oracle_split_half": float(min(halves))}


def prepare_layout(size: str, batch: int, layout):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fsdp import SEQ, SIZES, VOCAB, _batches, _ce, _optimizer, _Prepared
    from models import Transformer
    from spmd.parallel import apply_layout, init_train_state, make_train_step

    model = Transformer(VOCAB, SEQ, SIZES[size]["layers"], SIZES[size]["d_model"], SIZES[size]["heads"])
    batches = _batches(0, 1, batch)
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    laid, mesh = apply_layout(model, 8, layout)
    opt = _optimizer()

    def loss_fn(p, b):
        return _ce(model.apply({"params": p}, b["inputs"]), b)

    state = init_train_state(laid, opt, params=params, mesh=mesh)
    step = make_train_step(laid, loss_fn, opt, accum_steps=layout.accum_steps, mesh=mesh)
    data = tuple(n for n in mesh.mesh_dim_names if n not in ("tp", "pp"))
    batches = [jax.device_put(b, NamedSharding(mesh.jax_mesh, P(data))) for b in batches]
    return _Prepared(step, state, batches, batch)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, r) for name, r in results["runs"].items() if "no_fit" not in r]
    fig, axes = plt.subplots(2, len(runs), figsize=(4.5 * len(runs), 8), squeeze=False)
    for j, (name, r) in enumerate(runs):
        rows = r["candidates"]
        for ax, key, unit in ((axes[0][j], "ms", "step ms"), (axes[1][j], "peak_mib", "peak MiB/device")):
            pred = [c["predicted_" + key] for c in rows]
            meas = [c["measured_" + key] for c in rows]
            ax.scatter(pred, meas)
            for c, x, y in zip(rows, pred, meas):
                ax.annotate(c["layout"], (x, y), fontsize=6)
            lo, hi = min(pred + meas), max(pred + meas)
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xlabel("predicted " + unit)
            ax.set_ylabel("measured " + unit)
            ax.grid(alpha=0.3)
        noise = r.get("pick_over_best_noise")  # absent in runs of 5 rounds, before the rounds were kept
        ci = f" (90% CI {noise['ci90'][0]:.2f}-{noise['ci90'][1]:.2f})" if noise else ""
        axes[0][j].set_title(f"{name}: spearman {r['spearman']:.2f}, pick/best {r['pick_over_best']:.2f}x{ci},\n"
                             f"pick/GSPMD {r['pick_over_gspmd']:.2f}x", fontsize=8)
    fig.suptitle("auto_layout on 8 CPU devices: predicted vs measured")
    save_figure(fig, path)


def main(argv=None) -> int:
    a = benchmark_args(argv, __doc__, "smoke run: d256x4 at batch 32, 6 candidates, 4 rounds", "torch",
                       lambda *x: None, ROOT)
    if a is None:
        return 0
    import statistics

    import jax

    from fsdp import SEQ, SIZES, VOCAB, _batches, _ce, _optimizer, prepare_gspmd
    from models import Transformer
    from models._plans import transformer_tp_plan
    from spmd.parallel import auto_layout, calibrate
    from spmd.parallel.auto._measure import peak_bytes
    from spmd.parallel.cost._memory import Profile

    if os.environ.get("AUTO_LAYOUT_MERGE"):
        _plot(merged := merge(os.environ["AUTO_LAYOUT_MERGE"].split(",")), _save(merged, False) + ".png")
        return 0
    cal = calibrate(refresh=True)  # the host as loaded now (other processes share it)
    rounds = 4 if a.quick else int(os.environ.get("AUTO_LAYOUT_ROUNDS", 12))  # a round varies by 9-18% here
    runs = RUNS[:1] if a.quick else RUNS
    if os.environ.get("AUTO_LAYOUT_RUNS"):  # e.g. "d256x4:32,d768x6:32:tight": a part of the grid
        runs = [(r.split(":") + ["unlimited"])[:3] for r in os.environ["AUTO_LAYOUT_RUNS"].split(",")]
        runs = [(s_, int(b), g) for s_, b, g in runs]
    # the candidates compiled and held at once (each holds its state on 8 devices: d768x6 fits 24 GiB with 4)
    n_measured = int(os.environ.get("AUTO_LAYOUT_MEASURED", 6 if a.quick else 7))
    # auto_layout(measure=): its top candidates compiled and timed before it picks (0: the cost model's pick)
    autotune = int(os.environ.get("AUTO_LAYOUT_AUTOTUNE", 2 if a.quick else 4))
    # the host's load (1-minute average) as the run goes: other processes share these cores
    results = {"jax": jax.__version__, "calibration": cal.to_json(), "rounds": rounds, "runs": {},
               "cores": os.cpu_count(), "load_at_start": os.getloadavg()[0], "commit": _commit()}
    unlimited_peak: dict = {}
    profiles: dict = {}
    for size, batch, budget in runs:
        name = f"{size}, batch {batch}" + ("" if budget == "unlimited" else ", tight budget")
        model = Transformer(VOCAB, SEQ, SIZES[size]["layers"], SIZES[size]["d_model"], SIZES[size]["heads"])
        b0 = _batches(0, 1, batch)[0]

        def loss_fn(p, b, model=model):
            return _ce(model.apply({"params": p}, b["inputs"]), b)

        def rank(limit, measure=0, model=model, b0=b0, loss_fn=loss_fn, key=(size, batch)):
            if key not in profiles:
                params = jax.eval_shape(lambda: model.init(jax.random.key(0), b0["inputs"])["params"])
                profiles[key] = Profile(loss_fn, params, _optimizer())
            return auto_layout(model, _optimizer(), b0, 8, loss_fn=loss_fn, calibration=cal, memory_budget_bytes=limit,
                               profile=profiles[key], measure=measure, plan=lambda sequence_parallel, tp_size:
                               transformer_tp_plan(sequence_parallel, vocab_size=VOCAB, tp_size=tp_size))

        limit = None
        if budget == "tight":
            if (size, batch) not in unlimited_peak:
                unlimited_peak[size, batch] = rank(None).best.memory["peak"]
            limit = int(TIGHT * unlimited_peak[size, batch])
        try:
            ranked = rank(limit, autotune)
        except ValueError as e:  # the budget fits no layout once compiled: said, and the grid goes on
            if "no layout fits" not in str(e):
                raise
            results["runs"][name] = {"size": size, "batch": batch, "budget_bytes": limit, "no_fit": str(e)}
            print(name, "\n ", e, flush=True)
            _save(results, a.quick)
            continue
        if limit is None:
            unlimited_peak[size, batch] = min((c for c in ranked.candidates if c.fits),
                                              key=lambda c: c.predicted_s).memory["peak"]
        print(name, "\n" + ranked.table(top=8), flush=True)
        cands = [c for c in ranked.candidates if c.fits]
        model_pick = min(cands, key=lambda c: c.predicted_s)  # the cost model's own pick, before measuring
        # the top predicted, then evenly spread over the rest of the ranking
        rest = cands[n_measured // 2:]
        step = max(len(rest) // (n_measured - n_measured // 2), 1)
        chosen = cands[: n_measured // 2] + rest[::step][: n_measured - n_measured // 2]
        for pick in (lambda c: c is model_pick, lambda c: c.layout.weight_stationary, lambda c: c.layout.pp > 1):
            extra = next((c for c in cands if pick(c)), None)  # GSPMD's own layout at small batch, the best pipeline
            if extra is not None and extra not in chosen:
                chosen.append(extra)
        preps = {c.name: prepare_layout(size, batch, c.layout) for c in chosen}
        print(f"  {len(preps)} candidates compiled", flush=True)
        preps["gspmd fsdp=8"] = prepare_gspmd(size, batch, (8,), ("fsdp",))
        steps = 2 if batch > 32 or a.quick else 4
        load = []
        for _ in range(rounds):
            for p in preps.values():
                p.round(steps)
            load.append(os.getloadavg()[0])
        rows = []
        for c in chosen:
            p = preps[c.name]
            ms = 1e3 * statistics.median(p.wall)
            rows.append({"layout": c.name, "rank": cands.index(c) + 1, "predicted_ms": 1e3 * c.predicted_s,
                         "autotuned_ms": None if c.measured_s is None else 1e3 * c.measured_s,
                         "measured_ms": ms, "measured_best_ms": 1e3 * min(p.wall),
                         "rounds_ms": [1e3 * w for w in p.wall],
                         "predicted_compute_ms": 1e3 * c.compute_s,
                         "predicted_comm_ms": {k: 1e3 * v for k, v in c.comm_s.items()},
                         "bytes": c.communication["total"], "predicted_peak_mib": c.memory["peak"] / 2**20,
                         "measured_peak_mib": peak_bytes(p.compiled) / 2**20, "memory": c.memory})
        g = preps["gspmd fsdp=8"]
        entry = results["runs"][name] = summarize({
            "size": size, "batch": batch, "budget_bytes": limit, "pick": ranked.best.name, "autotune": autotune,
            "model_pick": model_pick.name, "why": ranked.why(), "candidates": rows,
            "n_candidates": len(cands), "rejected": ranked.rejected,
            "gspmd_ms": 1e3 * statistics.median(g.wall), "gspmd_rounds_ms": [1e3 * w for w in g.wall],
            "gspmd_peak_mib": peak_bytes(g.compiled) / 2**20, "load_per_round": load})
        for r in rows:
            print(f"  #{r['rank']:2d} {r['layout']:28s} predicted {r['predicted_ms']:7.2f} ms measured "
                  f"{r['measured_ms']:7.2f} ms   peak predicted {r['predicted_peak_mib']:6.2f} measured "
                  f"{r['measured_peak_mib']:6.2f} MiB", flush=True)
        noise = entry["pick_over_best_noise"]
        print(f"  gspmd fsdp=8 measured {entry['gspmd_ms']:7.2f} ms; spearman {entry['spearman']:.2f}, pick/best "
              f"{entry['pick_over_best']:.2f}x (90% CI {noise['ci90'][0]:.2f}-{noise['ci90'][1]:.2f}, an oracle's "
              f"split-half {noise['oracle_split_half']:.2f}x; best {entry['best']}) (the model's own pick "
              f"{model_pick.name}: {entry['model_pick_over_best']:.2f}x), pick/GSPMD {entry['pick_over_gspmd']:.2f}x"
              f"{'' if entry['gspmd_fits'] else ' (GSPMD over the budget)'}", flush=True)
        del preps
        _save(results, a.quick)  # after each config: a part of the grid survives an interrupted run
    _plot(results, _save(results, a.quick) + ".png")
    return 0


def summarize(run: dict) -> dict:
    """``run`` with its measured summary: the pick's samples/s over the best measured candidate's that fits the
    budget once compiled (``best``; a compiled peak over the budget does not fit, as in ``auto_layout``), over
    the cost model's own pick's, and over GSPMD's (``gspmd_fits``: its compiled peak within the budget); how
    much of pick/best is noise (where the rounds were kept); the rank correlation and the errors."""
    import statistics

    if "no_fit" in run:  # auto_layout's error: nothing measured
        return run
    rows, budget = run["candidates"], run["budget_bytes"]
    fitting = [r for r in rows if budget is None or r["measured_peak_mib"] * 2**20 <= budget]
    fits = fitting or rows  # none fitting once compiled (auto_layout picks one that does): said by best_fits
    best = min(fits, key=lambda r: r["measured_ms"])
    pick = next(r for r in rows if r["layout"] == run["pick"])
    model = next(r for r in rows if r["layout"] == run["model_pick"])
    out = {**run, "best": best["layout"], "best_fits": bool(fitting),
           "pick_over_best": best["measured_ms"] / pick["measured_ms"],
           "model_pick_over_best": best["measured_ms"] / model["measured_ms"],
           "pick_over_gspmd": run["gspmd_ms"] / pick["measured_ms"],
           "gspmd_fits": budget is None or run["gspmd_peak_mib"] * 2**20 <= budget,
           "spearman": spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows]),
           "spearman_best_rounds": spearman([r["predicted_ms"] for r in rows],
                                            [r["measured_best_ms"] for r in rows]),
           "time_error": statistics.median(abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in rows),
           "memory_error_max": max(abs(r["predicted_peak_mib"] / r["measured_peak_mib"] - 1) for r in rows)}
    judged = {r["layout"]: r for r in [*fits, pick]}
    if all("rounds_ms" in r for r in judged.values()):
        out["pick_over_best_noise"] = pick_over_best_spread({k: r["rounds_ms"] for k, r in judged.items()}, run["pick"])
    return out


def merge(parts: list) -> dict:
    """The runs of ``results/PART.json`` for each of ``parts``, a later part's config over an earlier's; each
    run keeps what it was measured with (its part, calibration, rounds, jax, commit) as ``"measured_with"``."""
    runs: dict = {}
    for part in parts:
        with open(os.path.join(RESULTS, part + ".json")) as f:
            res = json.load(f)
        for name, run in res["runs"].items():
            meta = {k: v for k, v in res.items() if k != "runs"}
            runs[name] = summarize({**run, "measured_with": run.get("measured_with", {"part": part, **meta})})
    order = [f"{s}, batch {b}" + ("" if g == "unlimited" else ", tight budget") for s, b, g in RUNS]
    return {"runs": dict(sorted(runs.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))}


def _commit() -> str:
    """The checkout's commit (the code a part of the grid was measured with), or "unknown"."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _save(results: dict, quick: bool) -> str:
    """Write the results' JSON; returns its path less the extension."""
    os.makedirs(RESULTS, exist_ok=True)
    out = "auto_layout_quick" if quick else "auto_layout"
    if os.environ.get("AUTO_LAYOUT_OUT"):  # another name for a part of the grid
        out = os.environ["AUTO_LAYOUT_OUT"]
    path = os.path.join(RESULTS, out)
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    return path


if __name__ == "__main__":
    sys.exit(main())
