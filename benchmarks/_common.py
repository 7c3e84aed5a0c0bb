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
