"""What the benchmarks share: a free port for torch's rendezvous, and running a benchmark's torch side
in a child process (``SCRIPT --torch-worker ARGS OUT_PATH``, without this process's ``XLA_FLAGS``)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys


def benchmark_args(argv, doc: str, quick_help: str, torch_name: str, torch_main, root: str):
    """A benchmark's command line: ``--quick``, ``--no-torch``, and the hidden ``--torch-worker WHAT WORLD
    STEPS WARMUP OUT_PATH`` of its :func:`run_torch_worker` child, which runs ``torch_main`` with those
    and gives None. Otherwise JAX (not yet imported) is asked for 8 CPU devices, the project ``root``
    goes on ``sys.path``, and the parsed arguments come back."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--no-torch", action="store_true", help=f"skip {torch_name}")
    p.add_argument("--torch-worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.torch_worker:
        what, world, steps, warmup, out_path = a.torch_worker
        torch_main(what, int(world), int(steps), int(warmup), out_path)
        return None
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, root)
    return a


def save_figure(fig, path: str) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_worker(script: str, args: list, out_path: str, timeout: float, tail: int = 500) -> dict:
    """Run ``python script --torch-worker *args out_path`` and return the JSON it wrote to ``out_path``;
    ``{"error": ...}`` (the last ``tail`` characters of its output) if it failed or ran past ``timeout`` s."""
    if os.path.exists(out_path):
        os.remove(out_path)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, os.path.abspath(script), "--torch-worker", *map(str, args), out_path]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not os.path.exists(out_path):
        return {"error": (proc.stderr or proc.stdout)[-tail:]}
    with open(out_path) as f:
        res = json.load(f)
    os.remove(out_path)
    return res


def torch_timed(step, warmup: int, steps: int) -> tuple[float, float]:
    """(wall s, this process's CPU s) of ``steps`` calls ``step(i)`` after ``warmup`` (torch workers; every
    rank calls it: barriers before and after the timed steps)."""
    import time

    import torch.distributed as dist

    for i in range(warmup):
        step(i)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        step(i)
    dist.barrier()
    return time.perf_counter() - t0, time.process_time() - c0


def torch_gpt(vocab: int, seq: int, d: int, layers: int, heads: int):
    """The torch twin of the project's Transformer that the benchmarks time: pre-LayerNorm blocks
    (causal attention, GELU MLP), learned positions for ``seq`` tokens, the embedding tied as output."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.embed.weight.T

    return GPT()


def versus_gspmd(label: str, preps: dict) -> tuple[dict | None, str]:
    """Our layout ``label`` over GSPMD's on the same mesh (``"ours fsdp=8 keep"`` -> ``"gspmd fsdp=8"``) in
    samples/s, round by round (both timed in the same interleaved rounds, at the same batch): ``({"median",
    "min", "max"} of the per-round ratios, printable text)``, so a difference can be told from the noise;
    ``(None, "")`` for a layout without a GSPMD twin."""
    import statistics

    twin = preps.get("gspmd " + label.split()[1]) if label.startswith("ours") else None
    if twin is None:
        return None, ""
    ratios = [r / o for o, r in zip(preps[label].wall, twin.wall)]
    got = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return got, "  vs GSPMD {median:.2f}x [{min:.2f}-{max:.2f}]".format(**got)
