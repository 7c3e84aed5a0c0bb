"""``spmdrun``: the ``torchrun`` of spmd. Also ``python -m spmd.run``.

    spmdrun --standalone --nproc-per-node 4 train.py --lr 0.1

starts 4 processes of ``train.py`` with ``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``SPMD_JOB_ID``
(and ``SPMD_DEVICES_PER_PROC`` with ``--devices-per-proc``) set, so
``dist.init_process_group()`` needs no arguments. Each output line is prefixed
with its rank (``[rank0]: ...``). When a rank fails, the others get SIGTERM at
once (their whole process groups), then SIGKILL after ``--stop-timeout``
seconds; spmdrun prints which rank failed, its exit code and its last lines,
and exits non-zero (after relaunching every rank up to ``--max-restarts``
times). SIGINT / SIGTERM are forwarded to every rank the same way. Ranks die
with spmdrun (``PR_SET_PDEATHSIG``), so none is left behind. gloo's
``[Gloo] Rank N is connected to M peer ranks`` lines are dropped unless
``--verbose`` (or ``SPMD_VERBOSE=1``); a short-of-peers one is always shown (ranks
started another way, by ``mpiexec`` or on several nodes by hand, drop them themselves:
``init_process_group``).
``--backend mpi`` starts the job with MPICH's ``mpiexec`` instead (:mod:`spmd._mpirun`).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from spmd import _mpirun
from spmd._spawn import chatter as _chatter
from spmd._spawn import free_port, signal_name, stop_processes
from spmd._spawn import verbose as spawn_verbose
from spmd.distributed._errors import PEER_EXIT_CODE, parse_absent

__all__ = ["main", "parse_args", "target_problem"]

_TAIL = 20
# What JAX's runtime prints (then aborts) in a rank that fails because another rank died first;
# this project's own victims exit with PEER_EXIT_CODE instead.
_JAX_VICTIM_MARKERS = (
    "JAX distributed service detected fatal errors",
    "Connection closed by peer",
    "Connection reset by peer",
)
def _flag(parser: argparse.ArgumentParser, name: str, **kw) -> None:
    # torchrun accepts both --nproc-per-node and --nproc_per_node (a one-word name has no second spelling).
    names = dict.fromkeys((f"--{name}", f"--{name.replace('-', '_')}"))
    parser.add_argument(*names, **kw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spmdrun",
        description="Launch a script on several processes with the torch.distributed environment (spmd).",
    )
    _flag(p, "nproc-per-node", type=int, default=1, help="processes (ranks) on this node (default 1)")
    _flag(p, "nnodes", type=int, default=1, help="number of nodes (default 1)")
    _flag(p, "node-rank", type=int, default=0, help="this node's index in [0, nnodes) (default 0)")
    _flag(p, "master-addr", default="127.0.0.1", help="address of rank 0's node (default 127.0.0.1)")
    _flag(p, "master-port", type=int, default=29500, help="port of the coordinator on rank 0 (default 29500)")
    p.add_argument("--standalone", action="store_true", help="single node: loopback and a free port")
    _flag(p, "max-restarts", type=int, default=0, help="relaunch all ranks up to K times after a failure")
    _flag(p, "devices-per-proc", type=int, default=None, help="CPU devices per process (SPMD_DEVICES_PER_PROC)")
    _flag(p, "stop-timeout", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)")
    _flag(p, "no-prefix", action="store_true", help="do not prefix output lines with [rankN]:")
    _flag(p, "job-id", default=None,
          help="the job's identity (SPMD_JOB_ID; torchrun's --rdzv-id): ranks of another job are refused. "
               "Default: a fresh id with one node; with --nnodes > 1 pass the same value on every node")
    p.add_argument("-v", "--verbose", action="store_true", default=None,
                   help="also pass on the ranks' runtime chatter (gloo's '[Gloo] Rank N is connected to M peer "
                        "ranks' lines); SPMD_VERBOSE=1 does the same")
    p.add_argument("--backend", choices=("gloo", "mpi"), default=None,
                   help="mpi: start the job with MPICH's mpiexec (pip install 'spmd[mpi]'); the script's "
                        "init_process_group() or ('gloo') joins with backend='mpi'. Default: spmdrun's own processes")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="job_id", help=argparse.SUPPRESS)
    p.add_argument("script", help="the script (or module with -m) to run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = p.parse_args(argv)
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank={args.node_rank} must be in [0, {args.nnodes - 1}] for --nnodes={args.nnodes}")
    if args.standalone and args.nnodes != 1:
        p.error("--standalone runs on one node; drop --nnodes or --standalone")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        p.error("--devices-per-proc must be >= 1")
    if not args.stop_timeout > 0:
        p.error("--stop-timeout must be positive")
    if args.backend == "mpi" and args.nnodes != 1:
        p.error("--backend mpi runs on one node; for several hosts run mpiexec with a host file directly")
    if not 0 < args.master_port < 65536:
        p.error("--master-port must be in 1..65535")
    if not args.standalone:
        try:
            socket.getaddrinfo(args.master_addr, args.master_port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            p.error(f"--master-addr={args.master_addr!r} does not resolve to an address ({e}); give rank 0's host "
                    "name or IP address (or --standalone on one machine)")
    if args.verbose is None:
        args.verbose = spawn_verbose()
    return args


def _module_problem(name: str) -> str | None:
    """What is wrong with ``-m name`` as the ranks will import it (their working directory first, then
    PYTHONPATH and site-packages), found without importing anything; None when it runs."""
    import importlib.util
    from importlib.machinery import PathFinder

    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return (f"-m {name!r} is not a module name (dotted Python names, such as pkg.train); to run a file, "
                "drop -m and give its path")
    where = (f"on the ranks' path (the working directory {os.getcwd()}, then PYTHONPATH and site-packages); check "
             "the name, run spmdrun from the directory that holds it, or add that directory to PYTHONPATH")
    path = [os.getcwd(), *(p for p in sys.path if p)]
    spec = PathFinder.find_spec(parts[0], path)
    if spec is None:
        sys.path.insert(0, os.getcwd())
        try:  # a top-level name is found without importing it (builtins, editable installs' finders too)
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
        finally:
            sys.path.pop(0)
    for i, part in enumerate(parts[1:], start=1):
        if spec is None:
            break
        if spec.submodule_search_locations is None:
            return f"-m {name}: {'.'.join(parts[:i])!r} is a module, not a package, so it holds no module {part!r}"
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    if spec is None:
        return f"-m {name}: no module named {name!r} {where}"
    if spec.submodule_search_locations is not None and PathFinder.find_spec(
            f"{name}.__main__", list(spec.submodule_search_locations)) is None:
        return (f"-m {name}: {name!r} is a package without a __main__ module, so it cannot run; name a module in "
                f"it (-m {name}.train) or add {name.replace('.', '/')}/__main__.py")
    return None


def target_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the script (or ``-m`` module) every rank would run, checked before any rank
    starts (a missing file, a directory without ``__main__.py``, an unknown module); None when nothing is."""
    if args.module:
        return _module_problem(args.script)
    script = args.script
    if not os.path.exists(script):
        hint = ""
        if not script.endswith(".py") and "/" not in script and all(p.isidentifier() for p in script.split(".")):
            hint = f", or -m {script} to run the module {script!r}"
        return (f"the script {script!r} does not exist (relative to the working directory {os.getcwd()}); give the "
                f"path of the Python file every rank runs{hint}")
    if os.path.isdir(script):
        if os.path.exists(os.path.join(script, "__main__.py")):
            return None  # python runs a directory's __main__.py, and so do the ranks
        files = sorted(f for f in os.listdir(script) if f.endswith(".py"))[:3]
        some = f" (it holds {', '.join(files)})" if files else ""
        return (f"the script {script!r} is a directory without a __main__.py{some}; give the Python file in it "
                "that every rank runs, or add a __main__.py")
    if not os.access(script, os.R_OK):
        return f"the script {script!r} cannot be read (permission denied); fix its permissions or run it as its owner"
    return None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when spmdrun dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Rank:
    def __init__(self, rank: int, local_rank: int, cmd: list[str], env: dict, prefix: bool, lock: threading.Lock,
                 verbose: bool = False):
        self.rank = rank
        self.verbose = verbose
        self.local_rank = local_rank
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self.err_tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        tag = f"[rank{rank}]: ".encode() if prefix else b""
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, tag, False), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, tag, True), daemon=True),
        ]
        self._lock = lock
        self.exit_time: float | None = None
        for t in self.threads:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        self.proc.wait()
        t = time.monotonic()
        self.join_output(3.0)  # its last lines, before anyone reads them
        self.exit_time = t

    def _pump(self, src, dst, tag: bytes, is_err: bool) -> None:
        out = getattr(dst, "buffer", None)
        for line in iter(src.readline, b""):
            if not self.verbose and _chatter(line):
                continue
            text = line.decode(errors="replace").rstrip("\n")
            self.tail.append(text)
            if is_err:
                self.err_tail.append(text)
            with self._lock:
                try:
                    if out is not None:
                        out.write(tag + line if line.endswith(b"\n") else tag + line + b"\n")
                        out.flush()
                    else:
                        dst.write(tag.decode() + text + "\n")
                        dst.flush()
                except (BrokenPipeError, ValueError):
                    pass
        src.close()

    def is_victim(self) -> bool:
        """Whether it failed because of a peer (not the cause): it exited with PEER_EXIT_CODE,
        or JAX's runtime said so before aborting it."""
        if self.proc.returncode == PEER_EXIT_CODE:
            return True
        return any(marker in line for line in self.tail for marker in _JAX_VICTIM_MARKERS)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def join_output(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def _say(msg: str) -> None:
    sys.stderr.write(f"spmdrun: {msg}\n")
    sys.stderr.flush()


def _absent(ranks: list, failed: list) -> list:
    """The ranks the failed ranks named as not arriving, else those still running."""
    named = {n for r in failed for line in r.tail for n in parse_absent(line)}
    return [r for r in ranks if r.rank in named] or [r for r in ranks if r.alive()]


def _job_id(args) -> str:
    """``--job-id``, else SPMD_JOB_ID, else a fresh id (one node) or none (several nodes must agree)."""
    if args.job_id is not None:
        return args.job_id
    if os.environ.get("SPMD_JOB_ID"):
        return os.environ["SPMD_JOB_ID"]
    return uuid.uuid4().hex if args.nnodes == 1 else ""


def _process_state(pid: int) -> str:
    """What a live rank is doing, from /proc (Linux): stopped, or running/sleeping."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "is still running: busy elsewhere or hung"
    if state in ("T", "t"):
        return "is stopped: SIGSTOP or a debugger"
    return "is still running: busy elsewhere or hung"


def _describe(code: int) -> str:
    sig = signal_name(code)
    return f"was killed by {sig} (exit code {code})" if sig else f"failed with exit code {code}"


def _run_once(args, port: int, restart: int, received: list[int]) -> tuple[int, bool]:
    """Run every local rank once; (exit code, whether a signal to spmdrun ended it)."""
    n = args.nproc_per_node
    world = n * args.nnodes
    job = _job_id(args)
    addr = "127.0.0.1" if args.standalone else args.master_addr
    base = [sys.executable, "-u", "-m", "spmd.distributed._worker"] + (["-m"] if args.module else [])
    lock = threading.Lock()
    ranks: list[_Rank] = []
    start = time.monotonic()
    for local in range(n):
        rank = args.node_rank * n + local
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(n),
            GROUP_RANK=str(args.node_rank),
            NODE_RANK=str(args.node_rank),
            SPMD_RESTART_COUNT=str(restart),
            SPMD_JOB_ID=job,
            TORCHELASTIC_RESTART_COUNT=str(restart),
            PYTHONUNBUFFERED="1",
            SPMD_CHATTER_FILTERED="1",  # this launcher drops gloo's chatter (unless --verbose): the ranks need not
        )
        if args.devices_per_proc is not None:
            env["SPMD_DEVICES_PER_PROC"] = str(args.devices_per_proc)
        ranks.append(_Rank(rank, local, base + [args.script, *args.script_args], env, not args.no_prefix, lock,
                           args.verbose))

    def stop_all() -> float:
        t0 = time.monotonic()
        stop_processes([(r.proc.pid, r.alive) for r in ranks], args.stop_timeout, group=True)
        for r in ranks:
            try:
                r.proc.wait(timeout=max(1.0, args.stop_timeout))
            except subprocess.TimeoutExpired:
                pass
            r.join_output(2.0)
        return time.monotonic() - t0

    while True:
        if received:
            signum = received[0]
            _say(f"got {signal.Signals(signum).name}; stopping all ranks")
            for r in ranks:
                try:
                    os.killpg(r.proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            took = stop_all()
            _say(f"all ranks stopped in {took:.1f} s")
            return 128 + signum, True
        failed = [r for r in ranks if r.exit_time is not None and r.proc.returncode != 0]
        if failed:
            # Peers of a dead rank fail right after it (their collective breaks): wait a moment
            # and blame the rank that exited first.
            time.sleep(0.1)
            failed = [r for r in ranks if r.exit_time is not None and r.proc.returncode != 0]
            for r in failed:
                r.join_output(1.0)  # dead: their pipes end now
            causes = [r for r in failed if not r.is_victim()]
            first = min(causes or failed, key=lambda r: r.exit_time)
            code = first.proc.returncode
            # Every failed rank failed because of a peer: blame the ranks they named as absent, else
            # the ranks still running (stopped or hung).
            absent = [] if causes else _absent(ranks, failed)
            if absent:
                for r in absent:
                    how = _process_state(r.proc.pid) if r.alive() else f"then {_describe(r.proc.returncode)}"
                    _say(
                        f"rank {r.rank} (local rank {r.local_rank}, pid {r.proc.pid}) did not arrive at the collective "
                        f"its peers waited in (it {how}); rank {first.rank} gave up waiting after "
                        f"{first.exit_time - start:.1f} s; stopping all ranks"
                    )
            else:
                _say(
                    f"rank {first.rank} (local rank {first.local_rank}, pid {first.proc.pid}) {_describe(code)} "
                    f"after {first.exit_time - start:.1f} s; stopping the other ranks"
                )
            took = stop_all()
            lines = list(first.err_tail) or list(first.tail)
            if lines:
                _say(f"last lines of rank {first.rank}:")
                for line in lines[-_TAIL:]:
                    sys.stderr.write(f"    {line}\n")
            also = [f"rank {r.rank} ({_describe(r.proc.returncode)})" for r in failed if r is not first]
            if also:
                _say("then also failed: " + ", ".join(also))
            others = [r.rank for r in ranks if r is not first and r not in failed]
            if others:
                _say(f"stopped ranks {others} in {took:.1f} s")
            return (code if 0 < code < 256 else 1), False
        if all(r.exit_time is not None and r.proc.returncode == 0 for r in ranks):
            for r in ranks:
                r.join_output(2.0)
            return 0, False
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = target_problem(args)
    if problem is not None:  # say it once, before any rank starts (each rank would print Python's error)
        sys.stderr.write(f"spmdrun: error: {problem}\n")
        return 2
    received: list[int] = []

    def on_signal(signum, frame):
        if not received:
            received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        restart = 0
        while True:
            if args.backend == "mpi":
                code, signalled = _mpirun.run_once(args, restart, received, _job_id(args), _say, _die_with_parent)
            else:
                port = free_port() if args.standalone else args.master_port
                code, signalled = _run_once(args, port, restart, received)
            if code == 0 or signalled:
                return code
            if restart >= args.max_restarts:
                if args.max_restarts:
                    _say(f"giving up after {args.max_restarts} restart(s)")
                return code
            restart += 1
            _say(f"restarting all ranks (restart {restart} of {args.max_restarts})")
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
