"""``spmdrun --backend mpi``: the job started by MPICH's ``mpiexec`` instead of spmdrun's own processes.

    spmdrun --backend mpi --nproc-per-node 4 train.py --lr 0.1

runs ``mpiexec -n 4 python -u -m spmd.distributed._worker train.py --lr 0.1``
(the ``mpiexec`` next to this Python, as ``pip install 'spmd[mpi]'`` puts it,
else the one on ``PATH``) with ``SPMD_BACKEND=mpi`` set: the script's
``init_process_group()`` (or ``"gloo"``, the CPU backend torch scripts name)
then joins with ``backend="mpi"``, rank and world size from MPI. spmdrun
does not set ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` here: MPI gives them
(rank 0 picks the coordination service's port). Each output line is prefixed
``[rankN]: `` by ``mpiexec`` (``-prepend-pattern``; not with ``--no-prefix``).
When a rank fails ``mpiexec`` ends the others and exits non-zero; spmdrun says
so and relaunches the job up to ``--max-restarts`` times. SIGINT / SIGTERM go
to ``mpiexec``, which passes them to the ranks; anything still running after
``--stop-timeout`` seconds is killed with its whole process group. One node
only: for several hosts run ``mpiexec`` with a host file directly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable

__all__ = ["find_mpiexec", "run_once"]


def find_mpiexec() -> str | None:
    """The ``mpiexec`` next to this interpreter (the ``[mpi]`` extra's MPICH), else the one on PATH."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _command(args: Any, mpiexec: str) -> list[str]:
    cmd = [mpiexec, "-n", str(args.nproc_per_node)]
    if not args.no_prefix:
        cmd += ["-prepend-pattern", "[rank%r]: "]
    cmd += [sys.executable, "-u", "-m", "spmd.distributed._worker"] + (["-m"] if args.module else [])
    return cmd + [args.script, *args.script_args]


def _env(args: Any, restart: int, job: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(SPMD_BACKEND="mpi", SPMD_RESTART_COUNT=str(restart), SPMD_JOB_ID=job, PYTHONUNBUFFERED="1")
    if args.devices_per_proc is not None:
        env["SPMD_DEVICES_PER_PROC"] = str(args.devices_per_proc)
    if args.verbose:  # mpiexec passes the output on as it is: the ranks drop gloo's chatter themselves unless asked
        env["SPMD_VERBOSE"] = "1"
    return env


def run_once(args: Any, restart: int, received: list[int], job: str, say: Callable[[str], None],
             preexec: Callable[[], None]) -> tuple[int, bool]:
    """Run the job under ``mpiexec`` once; (exit code, whether a signal to spmdrun ended it)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        say("--backend mpi needs MPICH's mpiexec, which is not installed: pip install 'spmd[mpi]'")
        return 2, False
    start = time.monotonic()
    proc = subprocess.Popen(_command(args, mpiexec), env=_env(args, restart, job), stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=preexec)

    def stop(signum: int) -> None:
        for sig, wait_s in ((signum, args.stop_timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    while proc.poll() is None:
        if received:
            say(f"got {signal.Signals(received[0]).name}; stopping mpiexec's job")
            stop(received[0])
            return 128 + received[0], True
        time.sleep(0.05)
    code = proc.returncode
    try:  # whatever of the job is left (mpiexec ended first): its process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if code != 0:
        say(f"mpiexec's job of {args.nproc_per_node} ranks failed with exit code {code} after "
            f"{time.monotonic() - start:.1f} s (the failing rank's output is above, prefixed with its rank)")
    return (code if 0 < code < 256 else 1) if code else 0, False
