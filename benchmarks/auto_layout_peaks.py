"""Benchmark: ``auto_layout``'s analytic lower bound of the peak memory per device against XLA's compiled
peak, for the candidates of benchmarks/auto_layout.py's grid, with this checkout's code; nothing is timed.

``cand.memory["peak"]`` before compiling is the bound ``auto_layout`` prunes with (the candidates that
survive it are ranked by their compiled peak), so here ``error`` is negative by design: how much of XLA's
peak the bound sees. A positive error is a bug (the bound would prune a layout that fits).

A compiled step's peak (``memory_analysis()``: arguments + outputs + temp - alias) does not depend on the
host's load, so the memory columns of ``results/auto_layout.json`` can be checked again on any commit
without its hours of timed rounds: for each model and batch of that file, every layout it measured (its
accumulation variants too) is predicted by ``evaluate_layout`` (the same ``Profile`` and calibration for
all) and compiled on shape structs (``compiled_peak``: nothing allocated, nothing run). Reported: per
layout the predicted and compiled peak and their error; per config the largest error and the share within
10%; overall the share within 10% and the median error.

    python benchmarks/auto_layout_peaks.py                         # every config of results/auto_layout.json
    AUTO_LAYOUT_RUNS=d256x4:128 python benchmarks/auto_layout_peaks.py   # some models and batches

Writes benchmarks/results/auto_layout_peaks.json and .png.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

from _common import benchmark_args, save_figure  # noqa: E402

WITHIN = 0.10  # the goal: predicted peak within 10% of the compiled step's


def grid_layouts(path: str) -> dict:
    """``{(size, batch): [layout names]}``: each model and batch of ``path``'s runs, the names of the layouts
    any of its configs (unlimited or under a budget) measured, in first-seen order."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out: dict = {}
    for run in runs.values():
        names = out.setdefault((run["size"], run["batch"]), [])
        names += [c["layout"] for c in run.get("candidates", []) if c["layout"] not in names]
    return out


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = [r for run in results["configs"].values() for r in run["layouts"]]
    fig, ax = plt.subplots(figsize=(7, 6))
    for kind, mark in (("pipeline", "^"), ("fsdp", "o"), ("other", "s")):
        got = [r for r in rows if _kind(r["layout"]) == kind]
        ax.scatter([r["compiled_mib"] for r in got], [r["predicted_mib"] for r in got], marker=mark, label=kind)
    hi = max(max(r["compiled_mib"], r["predicted_mib"]) for r in rows)
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.fill_between([0, hi], [0, (1 - WITHIN) * hi], [0, (1 + WITHIN) * hi], color="k", alpha=0.08, label="+-10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())  # the decades alone: minor labels overlap
    ax.set_xlabel("compiled peak MiB/device (memory_analysis)")
    ax.set_ylabel("predicted peak MiB/device")
    ax.legend()
    s = results["summary"]
    ax.set_title(f"auto_layout's peak memory: {s['within']}/{s['layouts']} within 10%, median error "
                 f"{100 * s['median_error']:.0f}% ({results['commit']})", fontsize=9)
    save_figure(fig, path)


def _kind(name: str) -> str:
    return "pipeline" if name.startswith("pp=") else ("fsdp" if "fsdp=" in name else "other")


def main(argv=None) -> int:
    a = benchmark_args(argv, __doc__, "d256x4 at batch 32 only", "nothing", lambda *x: None, ROOT)
    if a is None:
        return 0
    import jax

    from auto_layout import _commit
    from fsdp import SEQ, SIZES, VOCAB, _batches, _ce, _optimizer
    from models import Transformer
    from models._plans import transformer_tp_plan
    from spmd.parallel import auto_layout, calibrate
    from spmd.parallel.auto._auto import evaluate_layout
    from spmd.parallel.auto._measure import compiled_peak
    from spmd.parallel.cost._memory import Profile

    grid = grid_layouts(os.path.join(RESULTS, "auto_layout.json"))
    if a.quick:
        grid = {k: v for k, v in grid.items() if k == ("d256x4", 32)}
    if os.environ.get("AUTO_LAYOUT_RUNS"):
        want = {(s, int(b)) for s, b in (r.split(":")[:2] for r in os.environ["AUTO_LAYOUT_RUNS"].split(","))}
        grid = {k: v for k, v in grid.items() if k in want}
    cal = calibrate()
    results = {"jax": jax.__version__, "commit": _commit(), "configs": {}}
    for (size, batch), names in grid.items():
        model = Transformer(VOCAB, SEQ, SIZES[size]["layers"], SIZES[size]["d_model"], SIZES[size]["heads"])
        b0 = _batches(0, 1, batch)[0]

        def loss_fn(p, b, model=model):
            return _ce(model.apply({"params": p}, b["inputs"]), b)

        params = jax.eval_shape(lambda model=model, b0=b0: model.init(jax.random.key(0), b0["inputs"])["params"])
        profile = Profile(loss_fn, params, _optimizer())
        ranked = auto_layout(model, _optimizer(), b0, 8, loss_fn=loss_fn, calibration=cal, profile=profile,
                             plan=lambda sequence_parallel, tp_size: transformer_tp_plan(
                                 sequence_parallel, vocab_size=VOCAB, tp_size=tp_size))
        by_name = {c.name: c.layout for c in ranked.candidates}
        rows, missing = [], []
        for name in names:
            base, accum = re.fullmatch(r"(.*?)(?: accum=(\d+))?", name).groups()
            if base not in by_name:
                missing.append(name)
                continue
            lay = replace(by_name[base], accum_steps=int(accum or 1))
            t0 = time.perf_counter()
            cand = evaluate_layout(model, _optimizer(), b0, 8, lay, loss_fn=loss_fn, params=params, calibration=cal,
                                   profile=profile)
            peak = compiled_peak(model, _optimizer(), lambda laid: loss_fn, params, b0, jax.devices(), lay)
            rows.append({"layout": name, "predicted_mib": cand.memory["peak"] / 2**20, "compiled_mib": peak / 2**20,
                         "error": cand.memory["peak"] / peak - 1, "memory": cand.memory})
            print(f"  {size} b{batch} {name:42s} predicted {rows[-1]['predicted_mib']:7.1f} compiled "
                  f"{rows[-1]['compiled_mib']:7.1f} MiB {100 * rows[-1]['error']:+6.1f}% "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        errors = [abs(r["error"]) for r in rows]
        results["configs"][f"{size}, batch {batch}"] = {
            "layouts": rows, "missing": missing, "error_max": max(errors),
            "within": sum(e <= WITHIN for e in errors), "n": len(rows)}
        _save(results)
    every = [abs(r["error"]) for run in results["configs"].values() for r in run["layouts"]]
    results["summary"] = {"layouts": len(every), "within": sum(e <= WITHIN for e in every),
                          "median_error": statistics.median(every), "max_error": max(every)}
    print(results["summary"], flush=True)
    _plot(results, _save(results) + ".png")
    return 0


def _save(results: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "auto_layout_peaks")
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    return path


if __name__ == "__main__":
    sys.exit(main())
