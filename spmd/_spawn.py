"""``spmd.spawn``: run ``fn(rank, *args)`` in ``nprocs`` processes, as ``torch.multiprocessing.spawn``.

Each process gets ``MASTER_ADDR``/``MASTER_PORT`` (127.0.0.1 and a free port
unless already set), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``SPMD_JOB_ID`` (a fresh id), so ``dist.init_process_group()`` needs no arguments.
When one process fails, the others get SIGTERM, then SIGKILL after
``stop_timeout`` seconds, and ``spawn`` raises naming the rank, its exit code
and its traceback.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Callable

__all__ = ["spawn", "SpawnContext", "ProcessRaisedException", "ProcessExitedException", "free_port", "signal_name"]


class ProcessException(Exception):
    def __init__(self, msg: str, error_index: int, error_pid: int):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = error_pid


class ProcessRaisedException(ProcessException):
    """A spawned process raised; the message holds its traceback."""


class ProcessExitedException(ProcessException):
    """A spawned process exited with a non-zero code or was killed by a signal."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int, signal_name: str | None = None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def signal_name(code: int) -> str | None:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


# gloo prints one such line to stdout per communicator it connects (C++, unconditionally: no switch turns it
# off); spmdrun and spawn's ranks drop the healthy ones (all expected peers connected) unless --verbose /
# SPMD_VERBOSE=1.
_GLOO_CONNECTED = re.compile(rb"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                             rb"Expected number of connected peer ranks is : (\d+)\s*$")


def chatter(line: bytes) -> bool:
    """Whether ``line`` is gloo's note that a communicator connected all its peers."""
    m = _GLOO_CONNECTED.match(line)
    return m is not None and m.group(1) == m.group(2)


def verbose() -> bool:
    return os.environ.get("SPMD_VERBOSE", "").strip().lower() not in ("", "0", "false", "no", "off")


FILTERED = "SPMD_CHATTER_FILTERED"  # set where gloo's chatter is already dropped (spmdrun's pump, this filter)
_RESTORES: list[Callable[[], None]] = []  # the filter installed in this process by quiet_rank_output


def quiet_rank_output(debug: str = "OFF") -> None:
    """Drop gloo's chatter from this rank's stdout when no launcher does (``mpiexec``, ``srun``, by hand: a
    multi-node job), unless ``SPMD_VERBOSE=1`` or the debug level (``SPMD_DISTRIBUTED_DEBUG`` /
    ``TORCH_DISTRIBUTED_DEBUG``) is INFO or DETAIL; the filter drains at exit (and in :func:`drain_stdout`)."""
    if verbose() or debug in ("INFO", "DETAIL") or os.environ.get(FILTERED) == "1":
        return
    _RESTORES.append(_quiet_stdout())
    if len(_RESTORES) == 1:
        atexit.register(drain_stdout)


def drain_stdout() -> None:
    """Put this process's stdout back and pass on what the filter holds (before an ``os._exit``)."""
    while _RESTORES:
        _RESTORES.pop()()


def _quiet_stdout() -> Callable[[], None]:
    """This process's stdout (fd 1, where gloo's C++ writes) passed on without gloo's chatter lines; returns
    the function that puts fd 1 back and drains the filter (call it before the process ends)."""
    if verbose():
        return lambda: None
    os.environ[FILTERED] = "1"  # its children write into the same filter
    out, (r, w) = os.dup(1), os.pipe()
    os.dup2(w, 1)
    os.close(w)

    def pump() -> None:
        with os.fdopen(r, "rb") as src:
            for line in src:
                if not chatter(line):
                    os.write(out, line)

    t = threading.Thread(target=pump, daemon=True)
    t.start()

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(out, 1)  # the pipe's last writer closes: the pump reads to its end
        t.join(timeout=5)

    return restore


def _child(fn: Callable, i: int, args: tuple, env: dict, error_file: str) -> None:
    os.environ.update(env)
    restore = _quiet_stdout()
    try:
        fn(i, *args)
    except SystemExit as e:
        if e.code in (None, 0):
            return
        with open(error_file, "w") as f:
            f.write(f"SystemExit({e.code!r})\n")
        restore()
        os._exit(e.code if isinstance(e.code, int) and 0 < e.code < 256 else 1)
    except BaseException:
        text = traceback.format_exc()
        try:
            with open(error_file, "w") as f:
                f.write(text)
        finally:
            sys.stderr.write(text)
            sys.stderr.flush()
            restore()
            os._exit(1)
    finally:
        restore()


def stop_processes(pids_alive: list[tuple[int, Callable[[], bool]]], grace: float, *, group: bool) -> None:
    """SIGTERM each (its process group if ``group``), then SIGKILL what is left after ``grace`` s."""
    kill = os.killpg if group else os.kill
    for pid, _ in pids_alive:
        try:
            kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive() for _, alive in pids_alive):
        time.sleep(0.05)
    for pid, _ in pids_alive:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class SpawnContext:
    """The running processes of :func:`spawn` (``join=False``); ``join()`` waits for them."""

    def __init__(self, processes: list, error_files: list[str], stop_timeout: float):
        self.processes = processes
        self.error_files = error_files
        self.stop_timeout = stop_timeout

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) for the processes; True when all ended well.

        On the first failure the others are stopped and an exception is raised.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            alive = [p for p in self.processes if p.exitcode is None]
            failed = [(i, p) for i, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
            if failed:
                i, p = failed[0]
                self._stop()
                self._raise(i, p)
            if not alive:
                return True
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=wait)
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _stop(self) -> None:
        stop_processes([(p.pid, p.is_alive) for p in self.processes if p.is_alive()], self.stop_timeout, group=False)
        for p in self.processes:
            p.join(1.0)

    def _raise(self, i: int, p) -> None:
        text = ""
        try:
            with open(self.error_files[i]) as f:
                text = f.read()
        except OSError:
            pass
        code = p.exitcode
        if text and not text.startswith("SystemExit("):
            raise ProcessRaisedException(f"\n\n-- Process {i} terminated with the following error:\n{text}", i, p.pid)
        sig = signal_name(code)
        how = f"was killed by {sig}" if sig else f"exited with code {code}"
        raise ProcessExitedException(f"process {i} {how}", i, p.pid, exit_code=code, signal_name=sig)


def _check_spawn(fn, args, nprocs, start_method, devices_per_proc, stop_timeout, env, where):
    """Validate :func:`spawn`'s arguments before any process starts; the multiprocessing context."""
    if not callable(fn):
        raise TypeError(f"{where}: fn={fn!r} must be a callable fn(rank, *args).")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"{where}: nprocs={nprocs!r} must be an int >= 1.")
    if not isinstance(args, tuple):
        raise TypeError(f"{where}: args={args!r} must be a tuple.")
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(f"{where}: start_method={start_method!r} is not one of this platform's {methods}.")
    if devices_per_proc is not None and (isinstance(devices_per_proc, bool) or not isinstance(devices_per_proc, int)):
        raise TypeError(f"{where}: devices_per_proc={devices_per_proc!r} must be an int >= 1 (or None).")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"{where}: devices_per_proc={devices_per_proc!r} must be an int >= 1 (or None).")
    if isinstance(stop_timeout, bool) or not isinstance(stop_timeout, (int, float)):
        raise TypeError(f"{where}: stop_timeout={stop_timeout!r} must be a number of seconds.")
    if not stop_timeout > 0:
        raise ValueError(f"{where}: stop_timeout={stop_timeout!r} must be positive (seconds between SIGTERM and SIGKILL).")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"{where}: env={env!r} must be a dict of str to str.")
    if start_method != "fork":
        try:  # the child unpickles (fn, args): refuse what cannot travel now, not as a child's traceback
            pickle.dumps((fn, args))
        except Exception as e:
            raise TypeError(
                f"{where}: fn={fn!r} and args must be picklable with start_method={start_method!r} ({e}); "
                "use a module-level function (not a lambda or a nested function)."
            ) from None
    return multiprocessing.get_context(start_method)


def spawn(
    fn: Callable,
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    devices_per_proc: int | None = None,
    stop_timeout: float = 5.0,
    env: dict[str, str] | None = None,
) -> SpawnContext | None:
    """Run ``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in its own process (one rank each).

    As ``torch.multiprocessing.spawn``: with ``join=True`` returns None when all
    succeed and raises :class:`ProcessRaisedException` / :class:`ProcessExitedException`
    when one fails (after stopping the others); with ``join=False`` returns a
    :class:`SpawnContext`. ``fn`` must be picklable (a module-level function).
    ``devices_per_proc`` sets each process's CPU device count.
    """
    where = "spawn"
    ctx = _check_spawn(fn, args, nprocs, start_method, devices_per_proc, stop_timeout, env, where)
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT") or str(free_port())
    job = os.environ.get("SPMD_JOB_ID") or uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="spmd-spawn-")
    processes, files = [], []
    for i in range(nprocs):
        child_env = {
            "MASTER_ADDR": addr,
            "MASTER_PORT": port,
            "RANK": str(i),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_RANK": str(i),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "SPMD_JOB_ID": job,
        }
        if devices_per_proc is not None:
            child_env["SPMD_DEVICES_PER_PROC"] = str(devices_per_proc)
        child_env.update(env or {})
        err = os.path.join(tmp, f"error-{i}.txt")
        p = ctx.Process(target=_child, args=(fn, i, args, child_env, err), daemon=daemon)
        p.start()
        processes.append(p)
        files.append(err)
    context = SpawnContext(processes, files, stop_timeout)
    if not join:
        return context
    try:
        context.join()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None
