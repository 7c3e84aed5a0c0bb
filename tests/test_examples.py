"""examples/: each complete script runs as its docstring says, and prints the numbers it should.

Every script runs in its own process (the multi-process one under ``spmdrun``) with a bounded
timeout; the checks read the numbers it prints and compare them with values computed here
independently (NumPy, or the 1-device model), not only its exit code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240


def _run(args: list[str], timeout: float = TIMEOUT_S) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}  # the scripts set their own
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_example_is_tested():
    tested = {"seed_collectives.py", "dtensor_tour.py", "seed_ddp.py", "own_model_3d.py", "mp_collectives.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_seed_collectives():
    out = _run([sys.executable, "examples/seed_collectives.py"])
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^(\d)\. .*?  (rank 0: .*|\[.*\])$", out, re.M)}
    assert lines["1"] == "rank 0: [10]  rank 1: [10]  rank 2: [10]  rank 3: [10]"
    assert lines["2"] == "rank 0: [0.0]  rank 1: [0.0]  rank 2: [0.0]  rank 3: [0.0]"
    assert lines["3"] == "  ".join(f"rank {r}: [[0], [1], [2], [3]]" for r in range(4))
    assert lines["4"] == "rank 0: [10]  rank 1: [2]  rank 2: [3]  rank 3: [4]"
    assert lines["5"] == "rank 0: [0]  rank 1: [1]  rank 2: [2]  rank 3: [3]"
    assert lines["6"].startswith("rank 0: [[0], [1], [2], [3]]")
    assert lines["7"] == "[10]"
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert f"P(sum) -> R (full_tensor): {x.sum(0).tolist()}" in out
    assert out.count("equal to the tensor: True") == 2


def test_dtensor_tour():
    out = _run([sys.executable, "examples/dtensor_tour.py"])
    x = np.arange(70, dtype=np.float32).reshape(10, 7)
    assert "local shapes: [(5, 2), (5, 2), (5, 2), (5, 1), (5, 2), (5, 2), (5, 2), (5, 1)]" in out
    assert "redistribute keeps the value: True" in out
    assert f"P(sum) of ranks 0..7: {[float(sum(range(8)))] * 3}" in out
    total = float(re.search(r"^sum of x @ w: (\S+)$", out, re.M).group(1))
    assert total == float((x @ np.ones((7, 3), np.float32)).sum())
    assert "grad placements: (Replicate(), Shard(dim=0))" in out
    assert "grad matches NumPy: True" in out
    assert "to_jax: (8, 8) P('dp', None)" in out


def _seed_ddp_losses(world_size: int = 4, epochs: int = 10) -> list[float]:
    """Rank 0's printed losses, recomputed: Linear(10, 5), loss = sum of outputs, SGD 0.01, mean gradient."""
    bound = 1 / np.sqrt(10)
    rng = np.random.default_rng(0)  # rank 0's parameters, which DDP hands every rank
    w = rng.uniform(-bound, bound, (10, 5)).astype(np.float32).astype(np.float64)
    b = rng.uniform(-bound, bound, (5,)).astype(np.float32).astype(np.float64)
    data = [np.random.default_rng(1000 + r) for r in range(world_size)]
    losses = []
    for _ in range(epochs):
        xs = [d.standard_normal((20, 10)).astype(np.float32).astype(np.float64) for d in data]
        losses.append(float((xs[0] @ w + b).sum()))
        grad_w = np.mean([np.repeat(x.sum(0)[:, None], 5, axis=1) for x in xs], axis=0)
        w, b = w - 0.01 * grad_w, b - 0.01 * np.full(5, 20.0)
    return losses


def test_seed_ddp():
    out = _run([sys.executable, "examples/seed_ddp.py"])
    got = [float(v) for v in re.findall(r"^Epoch \d+, Loss: (\S+)$", out, re.M)]
    np.testing.assert_allclose(got, _seed_ddp_losses(), rtol=1e-5, atol=1e-4)
    assert "[Gloo]" not in out  # spawn's ranks drop gloo's connection lines (SPMD_VERBOSE=1 keeps them)


def test_own_model_3d():
    import jax
    import optax

    from tests.third_party.llama import Llama, LlamaConfig

    out = _run([sys.executable, "examples/own_model_3d.py"])
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    tokens = np.random.default_rng(0).integers(0, 64, (32, 17)).astype(np.int32)
    params = jax.jit(Llama(cfg).init)(jax.random.key(0), tokens[:2, :-1])["params"]
    logits = jax.jit(Llama(cfg).apply)({"params": params}, tokens[:, :-1])
    loss0 = float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())  # 1 device
    losses = [float(v) for v in re.findall(r"^step \d: loss (\S+)$", out, re.M)]
    assert len(losses) == 5 and losses[0] == pytest.approx(loss0, abs=1e-4)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    n = sum(x.size for x in jax.tree.leaves(params))
    assert f"parameters: {n} (64, 64)" in out
    assert "ParamPlan on mesh (dp=2, fsdp=2, tp=2)" in out


@pytest.mark.skipif(shutil.which("spmdrun") is None and not (Path(sys.executable).parent / "spmdrun").exists(),
                    reason="spmdrun is not installed (pip install -e .)")
def test_mp_collectives_under_spmdrun():
    spmdrun = shutil.which("spmdrun") or str(Path(sys.executable).parent / "spmdrun")
    out = _run([spmdrun, "--standalone", "--nproc-per-node", "2", "examples/mp_collectives.py"])
    lines = sorted(line for line in out.splitlines() if line.startswith("[rank"))
    assert lines == sorted([
        "[rank0]: all_reduce: [3]", "[rank1]: all_reduce: [3]",
        "[rank0]: broadcast: [0.0]", "[rank1]: broadcast: [0.0]",
        "[rank0]: all_gather: [[0], [1]]", "[rank1]: all_gather: [[0], [1]]",
        "[rank0]: reduce: [3]", "[rank1]: reduce: [2]",
        "[rank0]: scatter: [0.0]", "[rank1]: scatter: [1.0]",
        "[rank0]: gather: [[0.0], [1.0]]",
    ]), out
