"""Plan Llama-3-shaped models at scale from a CPU: 8B on 64 H100s and 70B on 256, beside torchtitan's layouts.

The models are ``models.Llama`` written as a user writes them (no sharding code), at Llama 3's sizes; their
parameters are ``jax.ShapeDtypeStruct`` (never allocated) and the devices CPU fake devices
(``--xla_force_host_platform_device_count``, set below before JAX starts). ``auto_layout(hardware="h100")``
ranks every layout (FSDP / DP / TP up to a node, re-gathering or keeping, float32 or bfloat16 compute,
checkpointing where the 80 GB need it) on the H100's published figures: each candidate's communication is its
step's own table priced on the links its mesh dim crosses, and each one that survives the bound from shapes
is compiled (not run) for its ``memory_analysis()`` peak and ``cost_analysis()`` flops and bytes
(``depth=``: compiled at 3 and 4 blocks, carried to the model's depth; the peak is steady once the block added is a
middle one, ``spmd.parallel.auto._compiled``). Then the pick is compiled at 3, 4 and ``VALIDATE`` layers (8 for 8B,
6 for 70B) and its 3- and 4-layer figures carried to that depth are set beside that compile's
(``--full-compile``: also at its full depth).

torchtitan's published H100 numbers (docs/performance.md of pytorch/torchtitan, commit eaea6f6; H100 SXM
96 GB HBM2e at 500 W, 8 a host on NVLink, 400 Gb/s RDMA per GPU):

- Llama 3.1 8B, 128 GPUs, FSDP, local batch 2 (seq 8192), selective activation checkpointing, bf16:
  5,605 tokens/s/GPU at 67.0 GiB (Table 3; 6,514 with torch.compile);
- Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full activation checkpointing, torch.compile and
  Float8: 829 tokens/s/GPU at 71.9 GiB (Table 4).

and at the device counts planned here, in bfloat16 (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md of
pytorch/torchtitan, commit c720cb8, same hosts; torch.compile, vanilla TP / async TP):

- Llama 3.1 8B, 64 GPUs, FSDP 8 x TP 8, per-op selective AC, local batch 12: 4,378 / 4,809 tokens/s/GPU;
- Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, full AC, local batch 16: 597.3 / 652.4 tokens/s/GPU.

Run: ``python benchmarks/plan_at_scale.py [8b|70b ...] [--validate=LAYERS] [--full-compile]``; writes
``benchmarks/results/plan_at_scale.json`` and ``.png``. The predicted tokens/s/GPU counts no overlap of
communication with compute (torchtitan overlaps FSDP's gathers with the previous layer's compute). The
model's attention is ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash attention
on an H100, traced as that kernel's algorithm (``spmd.parallel.auto._fused``; ``--attn=sdpa``: XLA's
attention, the scores materialized).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=256").strip()

import json  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models._llama import Llama, LlamaConfig  # noqa: E402
from spmd import Replicate, Shard  # noqa: E402
from spmd.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel,  # noqa: E402
                           auto_layout)
from spmd.parallel.auto._auto import default_loss  # noqa: E402
from spmd.parallel.auto._compiled import carried as carry  # noqa: E402
from spmd.parallel.auto._compiled import compile_figures, slice_depths  # noqa: E402
from spmd.parallel.auto._fused import fused_attention  # noqa: E402
from spmd.parallel.cost._hardware import Hardware  # noqa: E402

GiB = 2**30
SEQ = 8192 if "--tiny" not in sys.argv else 64
AT_SCALE = {  # bfloat16 at the device counts planned here: asyncTP_llama3_h100_2025-06_torchtitan.md @ c720cb8
    "8b": {"layout": "FSDP 8 x TP 8, per-op selective AC, bf16, torch.compile, local batch 12", "gpus": 64,
           "tps_per_gpu": 4378, "async_tp_tps_per_gpu": 4809.4,
           "source": "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ c720cb8 (vanilla TP)"},
    "70b": {"layout": "FSDP 32 x TP 8, full AC, bf16, torch.compile, local batch 16", "gpus": 256,
            "tps_per_gpu": 597.3, "async_tp_tps_per_gpu": 652.4,
            "source": "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ c720cb8 (vanilla TP)"},
}
TORCHTITAN = {  # docs/performance.md, pytorch/torchtitan @ eaea6f6 (see the module doc)
    "8b": {"layout": "FSDP 128 (1D), selective op AC, bf16, local batch 2", "gpus": 128, "tps_per_gpu": 5605,
           "memory_gib": 67.0, "source": "torchtitan docs/performance.md Table 3 (H100, FSDP, no compile)"},
    "70b": {"layout": "FSDP 32 x TP 8, full AC, bf16 + Float8, torch.compile, local batch 16", "gpus": 256,
            "tps_per_gpu": 829, "memory_gib": 71.9,
            "source": "torchtitan docs/performance.md Table 4 (H100, 2D, torch.compile + Float8)"},
}
# the attention as a user writes it for an H100: jax.nn.dot_product_attention(implementation="cudnn"), cuDNN's
# fused flash attention (torchtitan runs torch's sdpa, flash attention, likewise); --attn=sdpa: XLA's attention,
# the T x T scores materialized
ATTN = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--attn=")), "flash_attention_2")
MODELS = {  # Llama 3 8B and 70B (Meta's model cards: vocabulary 128,256, GQA with 8 key/value heads)
    "8b": (LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, rope_theta=500000.0, attn_implementation=ATTN), 64),
    "70b": (LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, rope_theta=500000.0, attn_implementation=ATTN), 256),
}

# the depth the pick is also compiled at, to check the carrying of its 3- and 4-layer figures (0: none); the
# full depth is compiled with --full-compile
VALIDATE = {"8b": 8, "70b": 6}
for a in sys.argv:
    if a.startswith("--validate="):
        VALIDATE = {k: int(a.split("=", 1)[1]) for k in VALIDATE}

# --tolerance=F: the search leaves out the layouts and candidates whose bound or estimate is within F of the
# fastest compiled one (spmd.parallel.auto._budget.TOLERANCE; default 0)
TOLERANCE = float(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tolerance=")), 0.0))

# --search-s=S: the search's wall-clock budget (spmd.parallel.auto._budget.SEARCH_SECONDS): once spent and a compiled
# candidate fits, nothing more is traced or compiled, and what was left says so (default: none)
SEARCH_S = next((float(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--search-s=")), None)

if "--tiny" in sys.argv:  # the script's own smoke run: the same path on a small Llama and 8 devices
    MODELS = {k: (LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                              num_kv_heads=2, attn_implementation=ATTN), 8) for k in MODELS}


def _progress_bar(total, desc, under=None):  # auto_layout's bar (_progress._bar), shown in a log too
    from tqdm.auto import tqdm

    from spmd.parallel.auto._progress import now

    bar = tqdm(total=total, desc=desc, unit="layout", leave=True, disable=False, file=sys.stdout, mininterval=20,
               ascii=True)
    if under is not None:  # the profile's compiles and timings named under the layout traced, as _bar does
        under.progress = lambda text: now(bar, f"{getattr(bar, 'doing', '')}: {text}", 0)
    return bar


if "--quiet" not in sys.argv:
    import spmd.parallel.auto._auto as _auto_mod  # noqa: E402

    _auto_mod._bar = _progress_bar
    _compile_figures = _auto_mod.compile_figures

    def _logged_compile(model, *a, **k):  # each slice compile's layout, depth, seconds and peak, as it ends
        t = time.perf_counter()
        got = _compile_figures(model, *a, **k)
        layout = a[5] if len(a) > 5 else k.get("layout")
        print(f"  compiled {layout.name} at {getattr(getattr(model, 'cfg', None), 'num_layers', '?')} layer(s): "
              f"{time.perf_counter() - t:.1f} s, peak {got['memory'].peak / GiB:.2f} GiB (load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        return got

    _auto_mod.compile_figures = _logged_compile


def tp_plan(sequence_parallel: bool, tp_size: int) -> dict | None:
    """Megatron's plan of a Llama block (heads and MLP features cut), tensor parallelism inside a node (<= 8), and
    with ``sequence_parallel`` torchtitan's: the norms ``SequenceParallel``, the activations between blocks cut on
    the sequence (the embedding's output cut, the projections taking ``Shard(1)``, the row-parallel ones handing it
    on), so a block's saved input is ``1 / tp`` of it."""
    if tp_size > 8:
        return None
    if not sequence_parallel:
        col, row = ColwiseParallel(), RowwiseParallel()
        return {**{f"layers_*.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")},
                "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
                "layers_*.mlp.down_proj": row, "lm_head": ColwiseParallel()}
    col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))
    return {"embed_tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            **{f"layers_*.{n}": SequenceParallel() for n in ("input_layernorm", "post_attention_layernorm")},
            "norm": SequenceParallel(),
            **{f"layers_*.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")},
            "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
            "layers_*.mlp.down_proj": row, "lm_head": col}


def _why(c) -> str:
    """Where a row's peak and time come from."""
    if c.memory.get("estimated"):
        return "over: its bound plus its compiled kin's excess (not compiled)"
    if c.memory.get("compiled"):
        return "compiled at 3 and 4 layers, carried" + ("" if c.fits else "; over 80 GB")
    return ("not compiled: its bound (matmuls' flops and bytes at the peak rates, its own collectives), "
            "kin-scaled; peak its lower bound")


def plan_one(name: str, full_compile: bool) -> dict:
    cfg, n = MODELS[name]
    model = Llama(cfg)
    batch = {k: jax.ShapeDtypeStruct((n, SEQ), np.int32) for k in ("inputs", "targets")}  # a sequence a device
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jax.ShapeDtypeStruct((1, SEQ), np.int32))["params"])
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    opt = optax.adamw(3e-4)
    devices = jax.devices()[:n]
    t0, c0 = time.perf_counter(), time.process_time()
    import spmd.parallel.auto._budget as budget_mod

    budget_mod.TOLERANCE = TOLERANCE
    budget_mod.SEARCH_SECONDS = SEARCH_S
    got = auto_layout(model, opt, batch, devices, hardware="h100", plan=tp_plan, units=("layers_*",), params=params,
                      mixed_precision="bfloat16", depth=lambda k: Llama(replace(cfg, num_layers=k)), top=10)
    ranked_s, ranked_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    load = os.getloadavg()[0]
    tokens = n * SEQ / n  # per device and step
    print(f"\n== Llama 3 {name.upper()} ({count / 1e9:.2f} B parameters) on {n} fake devices, priced as H100s, "
          f"80 GB each; ranked in {ranked_s:.0f} s ({ranked_cpu_s:.0f} s of CPU, load {load:.1f}); search: "
          f"{ {k: v for k, v in (got.search or {}).items() if k != 'log'} } ==")
    print(got.table(top=10), flush=True)
    log = (got.search or {}).get("log", [])
    secs = {a: sum(s for b, _, s, _ in log if b == a) for a in ("compile", "trace")}
    print(f"search: {sum(a == 'compile' for a, *_ in log)} compiles ({secs['compile']:.0f} s), "
          f"{sum(a == 'trace' for a, *_ in log)} layouts traced ({secs['trace']:.0f} s), stopped by "
          f"{(got.search or {}).get('stopped')}")
    for a, lay, s, what in log:
        print(f"  {a:<11} {lay:<44} {s:6.1f} s  {what}")
    for lay in (got.search or {}).get("uncompiled_faster", []):
        print(f"  not compiled (time budget spent), estimated faster than the pick: {lay}")
    rows = []
    for c in got.candidates[:10]:
        rows.append({"layout": c.name, "predicted_s": c.predicted_s, "tokens_per_s_per_gpu": tokens / c.predicted_s,
                     "compute_s": c.compute_s, "comm_s": sum(c.comm_s.values()), "peak_gib": c.memory["peak"] / GiB,
                     "peak_compiled": bool(c.memory.get("compiled")), "fits": c.fits, "why": _why(c)})
    for r in rows:
        print(f"  {r['layout']:<40} {r['tokens_per_s_per_gpu']:>8.0f} tok/s/GPU  peak "
              f"{'' if r['peak_compiled'] else '~' if 'over' in r['why'] else '>='}{r['peak_gib']:.1f} GiB  {r['why']}")
    best = got.best
    out = {"model": f"llama3-{name}", "parameters": count, "devices": n, "seq": SEQ, "global_batch": n,
           "hardware": "h100", "budget_bytes": got.budget, "ranked_s": ranked_s, "ranked_cpu_s": ranked_cpu_s,
           "load_1min": load, "candidates": len(got.candidates), "search": got.search, "tolerance": TOLERANCE,
           "compiled": sum(c.measured_peak is not None for c in got.candidates),
           "untraced_by_bound": sum(r.startswith("not traced: bound ") for _, r in got.rejected),
           "rejected": len(got.rejected), "search_s": SEARCH_S, "pick": best.name, "why": got.why(), "top": rows,
           "torchtitan": TORCHTITAN[name], "torchtitan_at_scale": AT_SCALE[name], "predicted_peak_bytes": best.measured_peak}
    k = VALIDATE[name]
    if k:  # the pick's slices' figures (3 and 4 layers) carried to k layers, against the k-layer model compiled
        t0 = time.perf_counter()
        figs, at = [], slice_depths(cfg.num_layers)
        for d in (*at, k):
            m = Llama(replace(cfg, num_layers=d))
            p = jax.eval_shape(lambda: m.init(jax.random.key(0), jax.ShapeDtypeStruct((1, SEQ), np.int32))["params"])
            figs.append(compile_figures(m, opt, default_loss, p, batch, devices, best.layout))
        carried = {"peak": carry(figs[0]["memory"].peak, figs[1]["memory"].peak, k, at[0]),
                   "flops": carry(figs[0]["flops"], figs[1]["flops"], k, at[0])}
        out["validation"] = {"layers": k, "carried_peak_bytes": carried["peak"], "compiled_peak_bytes":
                             figs[2]["memory"].peak, "carried_flops": carried["flops"], "compiled_flops":
                             figs[2]["flops"], "seconds": time.perf_counter() - t0}
        print(f"pick {best.name} at {k} layers: peak carried from {at[0]} and {at[1]} layers "
              f"{carried['peak'] / GiB:.2f} GiB, "
              f"compiled {figs[2]['memory'].peak / GiB:.2f} GiB ({carried['peak'] / figs[2]['memory'].peak - 1:+.1%}); "
              f"flops {carried['flops']:.3e} vs {figs[2]['flops']:.3e} ({out['validation']['seconds']:.0f} s)",
              flush=True)
    if full_compile:  # the pick compiled whole at its full depth, on the fake devices
        t0 = time.perf_counter()
        figs = compile_figures(model, opt, default_loss, params, batch, devices, best.layout)
        out["compiled_peak_bytes"] = figs["memory"].peak
        out["compiled_flops"] = figs["flops"]
        out["predicted_flops"] = best.flops
        out["full_compile_s"] = time.perf_counter() - t0
        lo, hi = slice_depths(cfg.num_layers)
        print(f"pick {best.name}: predicted peak {best.measured_peak / GiB:.2f} GiB (layers {lo} and {hi} compiled, "
              "carried "
              f"to {cfg.num_layers}), compiled whole {figs['memory'].peak / GiB:.2f} GiB "
              f"({best.measured_peak / figs['memory'].peak - 1:+.1%}); flops {best.flops:.3e} vs {figs['flops']:.3e} "
              f"({out['full_compile_s']:.0f} s)")
    tt = TORCHTITAN[name]
    print(f"torchtitan ({tt['source']}): {tt['layout']} on {tt['gpus']} GPUs: {tt['tps_per_gpu']:,} tok/s/GPU, "
          f"{tt['memory_gib']} GiB; the pick: {best.name} at {tokens / best.predicted_s:,.0f} tok/s/GPU predicted "
          f"({tokens / best.predicted_s / tt['tps_per_gpu']:.2f}x)")
    tt = AT_SCALE[name]
    print(f"torchtitan ({tt['source']}): {tt['layout']} on {tt['gpus']} GPUs: {tt['tps_per_gpu']:,} tok/s/GPU; the "
          f"pick's prediction is {tokens / best.predicted_s / tt['tps_per_gpu']:.2f}x that", flush=True)
    return out


def _plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(8 * len(results), 4.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        top = r["top"][:8]
        names = [t["layout"] for t in top]
        ax.barh(names[::-1], [t["tokens_per_s_per_gpu"] for t in top][::-1], color=[
            ("tab:blue" if t["fits"] else "tab:orange") if t["peak_compiled"] else "tab:gray" for t in top][::-1])
        ax.axvline(r["torchtitan"]["tps_per_gpu"], color="tab:red", ls="--", label="torchtitan (published)")
        ax.axvline(r["torchtitan_at_scale"]["tps_per_gpu"], color="tab:purple", ls=":",
                   label=f"torchtitan at {r['torchtitan_at_scale']['gpus']} GPUs")
        ax.set_title(f"{r['model']} on {r['devices']} H100s (predicted)")
        ax.set_xlabel("tok/s/GPU (blue: compiled, fits; orange: over 80 GB; gray: not compiled)")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    names = [a for a in argv if not a.startswith("--")] or ["8b", "70b"]
    full = "--full-compile" in argv
    out = Path(__file__).resolve().parent / "results"
    results = []
    for n in names:  # written after each model: the 70B plan takes longer
        with fused_attention(Hardware.named("h100")):  # the cudnn call traced as the H100's kernel throughout
            results.append(plan_one(n, full))
        if "--tiny" in argv:
            continue
        out.mkdir(exist_ok=True)
        path = out / "plan_at_scale.json"  # the other models' entries of an earlier run kept (runs one model each)
        mine = {r["model"] for r in results}
        kept = [r for r in json.loads(path.read_text()) if r["model"] not in mine] if path.exists() else []
        both = sorted(kept + results, key=lambda r: r["devices"])
        path.write_text(json.dumps(both, indent=1, default=str))
        _plot(both, out / "plan_at_scale.png")
        print(f"wrote {out / 'plan_at_scale.json'} and .png", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
