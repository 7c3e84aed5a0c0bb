"""Run check scripts of this folder on ``backend="mpi"``: ``mpiexec -n N python mpi_run.py SCRIPT ARGS... [+ SCRIPT
ARGS...]``: several scripts, separated by ``+``, run one after the other in one job (one launch, one import of JAX,
one JAX runtime: each script joins and leaves the process group again). A script that fails ends the job.

The scripts are written for ``spmdrun`` (``init_process_group()``, ``RANK`` / ``WORLD_SIZE`` read back
to check them). Here ``init_process_group()`` without a backend joins with ``backend="mpi"``, and
``RANK`` / ``WORLD_SIZE`` are set from the MPI launch before the script starts (so the same checks
run on both backends; init_process_group checks that they agree with MPI). ``MASTER_ADDR`` /
``MASTER_PORT``, when the caller sets them, name JAX's coordination service (porting_check.py's
TCPStore reads them).
"""

import functools
import os
import runpy
import sys
import time

os.environ["RANK"] = os.environ["PMI_RANK"]
os.environ["WORLD_SIZE"] = os.environ["PMI_SIZE"]
os.environ["SPMD_TEST_BACKEND"] = "mpi"

import spmd.distributed as dist  # noqa: E402
from spmd.distributed import _init as init_module, device_mesh  # noqa: E402

_init = init_module.init_process_group


@functools.wraps(_init)
def init_process_group(backend=None, *args, **kwargs):
    return _init("mpi" if backend in (None, "gloo") else backend, *args, **kwargs)


dist.init_process_group = init_module.init_process_group = device_mesh.init_process_group = init_process_group
jobs, here = [[]], os.path.dirname(os.path.abspath(__file__))
for arg in sys.argv[1:]:
    if arg == "+":
        jobs.append([])
    else:
        jobs[-1].append(arg)
sys.path.insert(0, here)
for job in jobs:
    sys.argv = job
    t0 = time.monotonic()
    try:
        runpy.run_path(job[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    if dist.is_initialized():
        dist.destroy_process_group()
    if os.environ.get("SPMD_TEST_TIMES"):
        print(f"mpi_run: {os.path.basename(job[0])} took {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
