"""``init_process_group("mpi")``: joining a job that ``mpiexec`` launched, and its MPI communicators.

Under ``mpiexec -n N python script.py`` every process is a rank of
``MPI_COMM_WORLD``: rank and world size come from MPI (``RANK`` /
``WORLD_SIZE`` and ``rank=`` / ``world_size=``, when given, must agree). JAX's
distributed runtime is started from MPI too, so that ``@spmd`` regions, DTensors
and the train steps run across the processes as under ``spmdrun``: rank 0
picks the coordination service's port (``MASTER_PORT`` if set, else a free
one), binds it to ``127.0.0.1`` when every rank runs on its host (else to
``MASTER_ADDR``, else its host name) and ``MPI_Bcast`` tells the others. The
collectives inside compiled programs stay on gloo; the eager calls of
``spmd.distributed`` run over MPI (:mod:`spmd.distributed._mpi_ops`).

A group (``new_group(ranks)``) is an MPI communicator made from its ranks at
its first call (``MPI_Comm_create_group``: only the members take part, as
non-members need not call ``new_group``), once per process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import zlib
from typing import Any

import jax
from jax._src import distributed as jdist

from spmd.distributed._env import env_int, read_config
from spmd.distributed._errors import fail
from spmd.distributed._jaxconf import configure_multiprocess, configure_single_process
from spmd.distributed._state import State

__all__ = ["MPI", "init", "comm", "prepare_environment"]

MPI: Any = None  # mpi4py.MPI, once init ran


def prepare_environment() -> None:
    """MPICH's settings for the local machine, set before MPI starts (a value the user set wins):

    * a job whose ranks all run on one host (Hydra's MPI_LOCALNRANKS equals the world size) keeps
      MPICH's network modules (UCX, libfabric's tcp) off the host's other interfaces: they listen on
      loopback only;
    * with more ranks on the host than cores it may run on, a rank that waits in MPI sleeps between
      polls (``MPIR_CVAR_ENABLE_HEAVY_YIELD``) instead of spinning on a core another rank needs; with a
      core per rank spinning is faster and stays (docs/benchmarks.md, "Measurements behind the code")."""
    local, size = os.environ.get("MPI_LOCALNRANKS"), os.environ.get("PMI_SIZE")
    if local is not None and local == size:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    if local is not None and local.isdigit() and int(local) > len(os.sched_getaffinity(0)):
        os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def _import_mpi(where: str):
    global MPI
    if MPI is None:
        prepare_environment()
        try:
            from mpi4py import MPI as mpi  # initializes MPI (MPI_Init_thread) on first import
        except ImportError as e:  # resolve_backend checked the package; its library may still fail to load
            raise RuntimeError(
                f"{where}: backend='mpi' could not load mpi4py ({e}); reinstall it with pip install 'spmd[mpi]'."
            ) from e
        MPI = mpi
    return MPI


def _check_launch(arg_rank: int, arg_world: int, rank: int, world: int, where: str) -> None:
    """What the caller and the environment say must agree with what MPI says."""
    for name, value, truth in (
        ("world_size", arg_world, world),
        ("rank", arg_rank, rank),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {name}={value!r} must be an int (-1 reads it from the MPI launch).")
        if value >= 0 and value != truth:
            raise ValueError(
                f"{where}: {name}={value} disagrees with the MPI launch ({name} {truth} of mpiexec's job); "
                f"pass {name}=-1 (the default) to take it from MPI, or launch with mpiexec -n {value if name == 'world_size' else 'N'}."
            )
    for var, truth in (("WORLD_SIZE", world), ("RANK", rank)):
        value = env_int(var, where)
        if value is not None and value != truth:
            raise ValueError(
                f"{where}: the environment variable {var}={value} disagrees with the MPI launch "
                f"({'world size' if var == 'WORLD_SIZE' else 'rank'} {truth}); unset {var} under mpiexec "
                "(MPI gives rank and world size), or launch as many processes as it says."
            )


def _coordinator(world_comm, rank: int, addr: str | None, port: int | None) -> str:
    """``host:port`` of JAX's coordination service, chosen by rank 0 and broadcast over MPI."""
    hosts = world_comm.allgather(socket.gethostname())
    if rank == 0:
        host = "127.0.0.1" if len(set(hosts)) == 1 else (addr or hosts[0])
        if port is None:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        chosen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    else:
        chosen = None
    return world_comm.bcast(chosen, root=0)


def init(backend: Any, init_method: Any, timeout: Any, world_size: int, rank: int, where: str) -> State:
    """Join the job ``mpiexec`` launched; this process's state."""
    # rank/world_size are MPI's: read the rest of the configuration (timeouts, debug level) as one rank.
    config = read_config(backend, init_method, timeout, 1, 0, where)
    mpi = _import_mpi(where)
    world_comm = mpi.COMM_WORLD
    r, n = world_comm.Get_rank(), world_comm.Get_size()
    _check_launch(rank, world_size, r, n, where)
    config = dataclasses.replace(config, rank=r, world_size=n)
    if n == 1:
        configure_single_process(config)
        return State(0, 1, config.backend, config.timeout_s, False)
    gs = jdist.global_state
    if gs.client is not None:  # a second init after destroy_process_group
        if (gs.process_id, gs.num_processes) != (r, n):
            raise RuntimeError(
                f"{where}: JAX's distributed runtime of this process already runs as rank {gs.process_id} of "
                f"{gs.num_processes}; it cannot be restarted in one process (start a new process)."
            )
        return State(r, n, config.backend, config.timeout_s, True, config.debug == "DETAIL")
    configure_multiprocess(config, where)
    coordinator = _coordinator(world_comm, r, config.addr, config.port)

    def on_timeout():
        fail(
            f"{where}: rank {r} timed out after {config.timeout_s:g} s waiting for all {n} MPI ranks to join "
            f"JAX's coordination service at {coordinator} (raise the limit with init_process_group(timeout=...) "
            "or SPMD_TIMEOUT).",
            1,
        )

    watchdog = threading.Timer(config.timeout_s, on_timeout)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes=n,
            process_id=r,
            initialization_timeout=int(config.timeout_s) + 10,  # ours fires first, with a clearer message
            heartbeat_timeout_seconds=config.heartbeat_s,
            shutdown_timeout_seconds=int(config.shutdown_s),
            coordinator_bind_address=coordinator if r == 0 else None,
        )
        jax.devices()  # the global topology exchange (all ranks), still under the watchdog
    finally:
        watchdog.cancel()
    if jax.process_count() != n:
        fail(f"{where}: JAX sees {jax.process_count()} processes but MPI_COMM_WORLD has {n}.", 1)
    return State(r, n, config.backend, config.timeout_s, True, config.debug == "DETAIL")


_COMMS: dict[tuple[int, ...], Any] = {}
_WORLD: tuple[int, ...] | None = None


def comm(ranks: tuple[int, ...]):
    """The communicator of the group of global ``ranks`` (sorted; group rank i is ``ranks[i]``)."""
    c = _COMMS.get(ranks)
    if c is not None:
        return c
    world_comm = MPI.COMM_WORLD
    if ranks == tuple(range(world_comm.Get_size())):
        c = world_comm
    else:
        # Only the members call this (at the group's first collective, in program order, as they
        # call its collectives); the tag keeps concurrent creations of different groups apart.
        grp = world_comm.Get_group().Incl(list(ranks))
        c = world_comm.Create_group(grp, zlib.crc32(repr(ranks).encode()) % 32768)
        grp.Free()
    _COMMS[ranks] = c
    return c


def barrier(ranks: tuple[int, ...], timeout_s: float) -> None:
    """``MPI_Ibarrier`` of the group, waited for at most ``timeout_s`` (a TimeoutError)."""
    req = comm(ranks).Ibarrier()
    if not wait(req, timeout_s):
        raise TimeoutError(f"after {timeout_s:g} s")


def wait(req, timeout_s: float, status=None) -> bool:
    """Wait for an MPI request, at most ``timeout_s``: spin briefly (latency), then poll gently
    (the cores are shared); whether it completed (``status`` is filled)."""
    if req.Test(status):
        return True
    start = time.monotonic()
    deadline = start + timeout_s
    spin_until = start + 0.002
    while True:
        if req.Test(status):
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now > spin_until:
            time.sleep(0.0002)


def exchange(ranks: tuple[int, ...], payload: bytes | None, senders: tuple[int, ...], me: int, timeout_s: float,
             where: str) -> dict[int, bytes]:
    """The object collectives' transfer over MPI: every rank of ``ranks`` gets {sender: payload} of
    ``senders`` (all ranks: ``MPI_Iallgatherv``; one: ``MPI_Ibcast``), each wait at most ``timeout_s``
    (a TimeoutError). Bytes only: what arrives is decoded by the caller (never unpickled here)."""
    import numpy as np

    c = comm(ranks)

    def waited(req, what: str) -> None:
        if not wait(req, timeout_s):
            absent = [r for r in senders if r != me] if len(senders) == 1 else [r for r in ranks if r != me]
            raise TimeoutError(
                f"{where}: rank {me} waited {timeout_s:g} s for {what} from ranks {absent}, which did not take part; "
                "every rank of the group must call it (raise the limit with init_process_group(timeout=...) or "
                "SPMD_TIMEOUT)."
            )

    if len(senders) == 1:
        root = ranks.index(senders[0])
        size = np.array([len(payload) if me == senders[0] else 0], np.int64)
        waited(c.Ibcast(size, root=root), "the objects' size")
        buf = np.frombuffer(payload, np.uint8).copy() if me == senders[0] else np.empty(int(size[0]), np.uint8)
        waited(c.Ibcast(buf, root=root), "the objects")
        return {senders[0]: payload if me == senders[0] else buf.tobytes()}
    mine = np.frombuffer(payload, np.uint8)
    sizes = np.empty(len(ranks), np.int64)
    waited(c.Iallgather(np.array([mine.size], np.int64), sizes), "the objects' sizes")
    out = np.empty(int(sizes.sum()), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    waited(c.Iallgatherv(mine, [out, sizes, offsets, MPI.BYTE]), "the objects")
    return {r: out[offsets[i]:offsets[i] + sizes[i]].tobytes() for i, r in enumerate(ranks)}
