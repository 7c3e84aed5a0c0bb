"""What the benchmarks share: a free port for torch's rendezvous, and running a benchmark's torch side
in a child process (``SCRIPT --torch-worker ARGS OUT_PATH``, without this process's ``XLA_FLAGS``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


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
