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


# A torch DTensor program on a fake process group (``torch.testing._internal.distributed.fake_pg``):
# one process stands for rank 0 of a world, and collectives do nothing. Sharding propagation is the
# same on every rank and needs no data, so this gives torch's output placements of many cases in
# seconds (their values are compared by the gloo tests).
PLACEMENTS_WORKER = """
import sys, pickle
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, DTensor, Shard, Replicate, Partial

def operand(mesh, shape, pl):
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    if not any(isinstance(p, Partial) for p in pl):
        return distribute_tensor(x, mesh, pl)
    base = distribute_tensor(x, mesh, [Replicate() if isinstance(p, Partial) else p for p in pl]).to_local()
    return DTensor.from_local(base, mesh, pl, run_check=False, shape=x.shape, stride=x.stride())

def main(cases, ops):
    S, R, P = Shard, Replicate, Partial
    ns = {"S": S, "R": R, "P": P}
    results = [None] * len(cases)
    for world in sorted({eval("__import__('math').prod(%r)" % (c[0],)) for c in cases}):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        meshes = {}
        for i, (mshape, op, args) in enumerate(cases):
            if __import__("math").prod(mshape) != world:
                continue
            if mshape not in meshes:
                meshes[mshape] = init_device_mesh("cpu", mshape)
            try:
                dts = [operand(meshes[mshape], shape, eval(pl, ns)) for shape, pl in args]
                y = eval(ops[op], dict(zip("abc", dts), torch=torch))
                results[i] = [("S", p.dim) if p.is_shard() else ("P", p.reduce_op) if p.is_partial() else ("R",)
                              for p in y.placements]
            except Exception as e:
                results[i] = ("error", f"{type(e).__name__}: {e}"[:300])
        dist.destroy_process_group()
    return results

if __name__ == "__main__":
    cases, ops = eval(open(sys.argv[1]).read()), eval(open(sys.argv[2]).read())
    with open(sys.argv[3], "wb") as f:
        pickle.dump(main(cases, ops), f)
"""


def torch_placements(tmp, cases: list, torch_ops: dict, timeout: float = 540) -> list:
    """torch's output placements of every case ``(mesh shape, op, [(shape, placements code), ...])``
    (``torch_ops[op]``: a torch expression over operands a, b, c): a list of ``("S", d)`` /
    ``("P", op)`` / ``("R",)`` per mesh dim, or ``("error", message)``."""
    script, cfile, ofile, rfile = tmp / "placements.py", tmp / "cases.txt", tmp / "ops.txt", tmp / "placements.pkl"
    script.write_text(PLACEMENTS_WORKER)
    cfile.write_text(repr(cases))
    ofile.write_text(repr(torch_ops))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(script), str(cfile), str(ofile), str(rfile)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and rfile.exists(), f"torch worker exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return pickle.loads(rfile.read_bytes())
