"""The job's front door on ``MASTER_ADDR:MASTER_PORT``: who may join, before anyone touches JAX's runtime.

Rank 0 listens on ``MASTER_ADDR:MASTER_PORT`` (only that address: loopback
under ``spmdrun --standalone``) and starts JAX's coordination service on
another free port of the same address. Every other rank knocks first: one line
``SPMD-JOIN 1 job=<id> rank=<r> world=<n> pid=<pid>``; rank 0 answers
``OK <coordinator port>`` or ``NO <why>``. So:

* a process of another job (a second ``spmdrun`` on the same port: another
  ``SPMD_JOB_ID``), a second process with the same rank, or anything that is
  not a join request is refused with a clear message, and the running job
  never sees it (JAX's coordination service would abort the whole job when a
  task registers twice);
* ranks that disagree on ``WORLD_SIZE`` end with a message naming both sizes;
* a second process with ``RANK=0`` cannot bind the port and is told that rank 0
  already runs.

``SPMD_JOB_ID`` is set by ``spmdrun`` and ``spmd.spawn`` (a fresh id per
launch); processes started by hand without it form a job with the empty id.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

from spmd.distributed._env import JobConfig
from spmd.distributed._errors import fail

__all__ = ["JOB_ID_VAR", "host_port", "serve", "knock"]

JOB_ID_VAR = "SPMD_JOB_ID"
_HELLO = "SPMD-JOIN 1"
_LINE_MAX = 512


def host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def _request(config: JobConfig, job: str) -> str:
    return f"{_HELLO} job={job} rank={config.rank} world={config.world_size} pid={os.getpid()}\n"


def _parse(line: str) -> dict[str, str] | None:
    if not line.startswith(_HELLO + " "):
        return None
    fields = dict(part.split("=", 1) for part in line[len(_HELLO) + 1 :].split() if "=" in part)
    return fields if {"job", "rank", "world", "pid"} <= fields.keys() else None


def _read_line(conn: socket.socket, timeout: float) -> str:
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n") and len(data) < _LINE_MAX:
        chunk = conn.recv(_LINE_MAX - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


class _Door:
    """Rank 0's listener: answers each knock, for the life of the process."""

    def __init__(self, sock: socket.socket, config: JobConfig, job: str, coordinator_port: int, where: str):
        self.sock, self.config, self.job, self.coordinator_port, self.where = sock, config, job, coordinator_port, where
        self.joined: dict[int, str] = {0: str(os.getpid())}
        threading.Thread(target=self._serve, name="spmd-rendezvous", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            fatal = None
            with conn:
                try:
                    reply, fatal = self._answer(_read_line(conn, 5.0))
                    conn.sendall(reply.encode())
                except OSError:
                    pass
            if fatal is not None:  # the job cannot run: end rank 0 too, after the joiner was told
                fail(f"{self.where}: {fatal}", 1)

    def _answer(self, line: str) -> tuple[str, str | None]:
        """(the reply, a message that ends rank 0 too, or None)."""
        cfg, req = self.config, _parse(line)
        if req is None:
            return "NO this port hosts an spmd job's coordinator; the request is not an spmd join request.\n", None
        if req["job"] != self.job:
            return (
                f"NO this port hosts another job (SPMD_JOB_ID={self.job!r}; yours is {req['job']!r}): each spmdrun "
                "needs its own --master-port (or use --standalone, which picks a free one).\n"
            ), None
        if req["world"] != str(cfg.world_size):
            why = (
                f"rank {req['rank']} (pid {req['pid']}) was started with WORLD_SIZE={req['world']} but rank 0 "
                f"(pid {os.getpid()}) with WORLD_SIZE={cfg.world_size}; every rank must get the same WORLD_SIZE "
                "(spmdrun sets it)."
            )
            return f"NO {why}\n", why
        rank = int(req["rank"]) if req["rank"].isdigit() else -1
        if rank in self.joined:
            return (
                f"NO rank {rank} of this job is already running (pid {self.joined[rank]}); two processes were "
                f"given RANK={rank}: give each process its own rank in [0, {cfg.world_size - 1}].\n"
            ), None
        self.joined[rank] = req["pid"]
        return f"OK {self.coordinator_port}\n", None


def _free_port(addr: str) -> int:
    with socket.socket(_family(addr), socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def serve(config: JobConfig, where: str) -> int:
    """Rank 0: open the door on MASTER_ADDR:MASTER_PORT; the coordination service's port."""
    addr, port = config.addr, config.port
    sock = socket.socket(_family(addr), socket.SOCK_STREAM)
    # As torch's TCPStore: the previous job's connections to this port linger in TIME_WAIT for a minute after
    # it ends; without SO_REUSEADDR the next job on the same MASTER_PORT could not bind it. (On Linux a port
    # that a live process still listens on stays refused, so a second rank 0 is still caught below.)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise _bind_error(config, e, where) from None
    sock.listen(64)
    coordinator_port = _free_port(addr)
    _Door(sock, config, os.environ.get(JOB_ID_VAR, ""), coordinator_port, where)
    return coordinator_port


def _unresolved(config: JobConfig, e: OSError, where: str) -> ValueError:
    return ValueError(
        f"{where}: rank {config.rank} cannot use MASTER_ADDR={config.addr!r}: the host name does not resolve to an "
        f"address ({e}); set MASTER_ADDR (spmdrun --master-addr) to rank 0's host name or IP address."
    )


def _bind_error(config: JobConfig, e: OSError, where: str) -> Exception:
    if isinstance(e, socket.gaierror):  # before the port: no address, so the port was never tried
        return _unresolved(config, e, where)
    if e.errno == errno.EADDRNOTAVAIL:
        return ValueError(
            f"{where}: rank 0 cannot listen on MASTER_ADDR={config.addr!r}: it is not an address of this machine "
            "(rank 0 hosts the coordinator: set MASTER_ADDR to rank 0's address)."
        )
    try:  # is it our own job's rank 0?
        reply = _knock_once(config, os.environ.get(JOB_ID_VAR, ""), 2.0)
    except OSError:
        reply = ""
    if reply.startswith("NO rank 0 of this job is already running"):
        return ValueError(f"{where}: {reply[3:]}")
    if reply.startswith("NO "):  # another spmd job's door: name it instead of a bare "in use"
        return RuntimeError(
            f"{where}: rank 0 was refused by the process on {host_port(config.addr, config.port)}: {reply[3:]}"
        )
    return RuntimeError(
        f"{where}: rank 0 could not start the coordinator on port {config.port} (already in use?): {e}. "
        "Choose a free MASTER_PORT, or run spmdrun --standalone, which picks one."
    )


def _knock_once(config: JobConfig, job: str, timeout: float) -> str:
    with socket.create_connection((config.addr, config.port), timeout=min(1.0, timeout)) as conn:
        conn.sendall(_request(config, job).encode())
        return _read_line(conn, timeout)


def knock(config: JobConfig, deadline: float, where: str) -> int:
    """Ranks > 0: ask rank 0 to join, until ``deadline``; the coordination service's port."""
    job = os.environ.get(JOB_ID_VAR, "")
    last: Exception | str = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            reply = _knock_once(config, job, max(0.5, left))
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN:  # a name that does not exist will not start to: say so now
                raise _unresolved(config, e, where) from None
            last = e
        except OSError as e:
            last = e
        else:
            if reply.startswith("OK ") and reply[3:].isdigit():
                return int(reply[3:])
            if reply.startswith("NO "):
                raise RuntimeError(
                    f"{where}: rank {config.rank} was refused by the process on {host_port(config.addr, config.port)}: "
                    f"{reply[3:]}"
                )
            last = f"an answer that is not spmd's: {reply[:80]!r}"
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{where}: rank {config.rank} could not reach the coordinator (rank 0) at "
                f"{host_port(config.addr, config.port)} within {config.timeout_s:g} s ({last}); check "
                "MASTER_ADDR/MASTER_PORT and that rank 0 is running (raise the limit with "
                "init_process_group(timeout=...) or SPMD_TIMEOUT)."
            )
        time.sleep(0.1)
