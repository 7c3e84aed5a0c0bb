#!/usr/bin/env bash
# Predicted against measured on a GPU: the 1-device candidates of a 1B Llama (float32 state, AdamW; no
# checkpointing, "dots", "full"; accumulation 1 and 2), each priced by auto_layout(hardware=<this GPU's
# built-in>) from its compiled step (cost_analysis flops and bytes over the datasheet rates, memory_analysis
# peak), then run and timed here (the median of timed rounds) with the device's own peak_bytes_in_use.
# Where two or more GPUs are visible it also calibrates "measured" (calibrate(): the collectives and the
# compute rates of these devices) and records it. Writes benchmarks/results/gpu_check.json.
#
# Prepared, not yet run: no GPU was lent when it was written; the numbers in the docs are from CPU fake devices
# unless that file says otherwise (its "device" field names the GPU it ran on).
set -euo pipefail
cd "$(dirname "$0")/.."
unset XLA_FLAGS
python - "$@" <<'PY'
import json, statistics, sys, time
from dataclasses import replace
from pathlib import Path

import jax, numpy as np, optax

from models._llama import Llama, LlamaConfig
from spmd.parallel import Layout, auto_layout, calibrate
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._measure import measure_layouts

dev = jax.devices()[0]
kind = dev.device_kind.lower()
hw = "h200" if "h200" in kind else "h100" if "h100" in kind else "a100-80g" if "a100" in kind else None
if dev.platform != "gpu" or hw is None:
    sys.exit(f"gpu.sh: needs an H100, H200 or A100 (found {dev.platform} {dev.device_kind!r})")
cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                  num_kv_heads=8, rope_theta=500000.0)  # Llama 3.2 1B's sizes
model, seq, rows = Llama(cfg), 2048, 4
batch = {k: jax.ShapeDtypeStruct((rows, seq), np.int32) for k in ("inputs", "targets")}
params = jax.eval_shape(lambda: model.init(jax.random.key(0), jax.ShapeDtypeStruct((1, seq), np.int32))["params"])
opt = optax.adamw(3e-4)
U = ("layers_*",)
lays = [Layout(dp=1, units=U if ac else (), activation_checkpointing=ac, accum_steps=a)
        for ac in (None, "dots", "full") for a in (1, 2)]
out = {"device": f"{dev.platform} {dev.device_kind}", "hardware": hw, "model": "llama 1B (Llama 3.2 sizes)",
       "seq": seq, "rows": rows, "candidates": []}
if len(jax.devices()) >= 2:
    t0 = time.perf_counter()
    cal = calibrate(jax.devices()[:2], refresh=True)
    out["calibration_s"], out["calibration"] = time.perf_counter() - t0, cal.to_json()
for lay in lays:
    row = {"layout": lay.name}
    try:
        pred = auto_layout(model, opt, batch, [dev], layouts=[lay], hardware=hw, params=params).best
        row.update(predicted_ms=1e3 * pred.predicted_s, predicted_peak=pred.measured_peak, flops=pred.flops)
        (t, peak), = measure_layouts(model, opt, default_loss, params, batch, [dev], [lay], rounds=5, steps=3)
        stats = dev.memory_stats() or {}
        row.update(measured_ms=1e3 * t, compiled_peak=peak, device_peak=stats.get("peak_bytes_in_use"))
        row["time_ratio"] = row["predicted_ms"] / row["measured_ms"]
    except Exception as e:  # noqa: BLE001 - an out-of-memory candidate is a result too
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(row, flush=True)
    out["candidates"].append(row)
path = Path("benchmarks/results/gpu_check.json")
path.parent.mkdir(exist_ok=True)
path.write_text(json.dumps(out, indent=1))
print("wrote", path)
PY
