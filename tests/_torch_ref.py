"""Run a torch reference program in gloo processes and read back each rank's results.

torch's gloo teardown can abort a process after all its work is done ("terminate called without an
active exception" from a gloo thread at exit, seen once in CI). The results are what the tests
compare, so each rank writes them atomically (a temporary file renamed into place) before it tears
down; a non-zero exit is accepted only when every rank's results are complete, and is an error
otherwise."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from spmd._spawn import free_port

# The end of every worker's main(rank, ...): results written atomically, then a barrier so that no
# rank tears its groups down while another still uses them.
SAVE = """
def save(out, rank, results):
    import os, pickle, torch.distributed as dist
    with open(f"{out}.{rank}.tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
"""


def run_torch_ranks(tmp, worker: str, args: list[str], world: int = 4, timeout: float = 540) -> list:
    """Run ``worker`` (source defining ``save`` via ``SAVE``) as ``worker.py PORT OUT *args``; each rank's results."""
    script = tmp / "worker.py"
    script.write_text(SAVE + worker)
    out = tmp / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(script), str(free_port()), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    files = [tmp / f"out.{r}" for r in range(world)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"torch worker exited {proc.returncode} before writing {missing}:\n{proc.stderr[-3000:]}"
    return [pickle.loads(f.read_bytes()) for f in files]
