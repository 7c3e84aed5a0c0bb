"""The default process group: ``init_process_group`` and friends, on JAX's distributed runtime.

One process is one rank (as in torch). A process may own several devices
(``spmdrun --devices-per-proc K``); the c10d collectives of this package run on
each rank's first device, and the other devices are there for meshes and
DTensors over all processes' devices (``init_device_mesh``).

Time bounds (seconds; every one configurable):

* ``timeout`` (``init_process_group(timeout=...)``, else ``SPMD_TIMEOUT``,
  else 120): how long a rank waits for the others to join, at a ``barrier`` and
  in an object collective.
* ``SPMD_HEARTBEAT_TIMEOUT`` (default 10): a rank that dies is noticed by the
  coordination service within this time, which then ends every other rank.
* ``SPMD_SHUTDOWN_TIMEOUT`` (default 300): a rank that ends cleanly waits at
  exit (JAX's shutdown barrier) this long for the others to end too.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import numbers
import os
import socket
import sys
import threading
import time
from typing import Any

from spmd.distributed._backend import BackendSpec, resolve_backend

__all__ = [
    "init_process_group",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_backend",
    "destroy_process_group",
    "new_group",
    "Group",
    "group",
    "get_process_group_ranks",
    "get_group_rank",
    "get_global_rank",
    "state",
    "group_of",
    "peer_rank",
    "seconds",
    "fail",
]

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_S = 10
DEFAULT_SHUTDOWN_S = 300.0


@dataclasses.dataclass(frozen=True)
class _State:
    rank: int
    world_size: int
    backend: BackendSpec
    timeout_s: float
    multiprocess: bool  # jax.distributed is running


_STATE: _State | None = None


# --- groups -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Group:
    """A set of ranks (``new_group(ranks)``); ``ranks=None`` is the default group (WORLD).

    Group ranks follow the order of the global ranks (as torch sorts them).
    ``g.rank()`` is this process's rank in the group (-1 if it is not a member);
    ``g.size()`` the number of ranks.
    """

    ranks: tuple[int, ...] | None = None

    def global_ranks(self) -> tuple[int, ...]:
        return tuple(range(state("Group").world_size)) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self.global_ranks())

    def rank(self) -> int:
        me = state("Group.rank").rank
        ranks = self.global_ranks()
        return ranks.index(me) if me in ranks else -1

    def __repr__(self) -> str:
        return "Group(WORLD)" if self.ranks is None else f"Group(ranks={list(self.ranks)})"


class group:  # noqa: N801 - torch's name: dist.group.WORLD
    """``group.WORLD``: the default group of all ranks."""

    WORLD = Group(None)


def group_of(g: Any, where: str) -> Group:
    """The :class:`Group` meant by ``group=``: None (WORLD) or a Group; checks membership."""
    st = state(where)
    if g is None:
        g = group.WORLD
    if not isinstance(g, Group):
        raise TypeError(
            f"{where}: group={g!r} must be None (all ranks) or a group from dist.new_group(ranks)."
        )
    if g.ranks is not None and st.rank not in g.ranks:
        raise ValueError(
            f"{where}: rank {st.rank} is not a member of group={g!r}; only the group's ranks call its "
            "collectives (as in torch)."
        )
    return g


def _group_rank(g: Group, global_rank: Any, where: str, arg: str) -> int:
    ranks = g.global_ranks()
    if isinstance(global_rank, bool) or not isinstance(global_rank, numbers.Integral):
        raise TypeError(f"{where}: {arg}={global_rank!r} must be an int rank.")
    if int(global_rank) not in ranks:
        raise ValueError(f"{where}: {arg}={global_rank!r} is not a rank of {g!r} (ranks {list(ranks)}).")
    return ranks.index(int(global_rank))


def peer_rank(g: Group, global_rank: Any, group_rank: Any, where: str, arg: str) -> int:
    """The group rank meant by torch's ``src=``/``dst=`` (global) or ``group_src=``/``group_dst=``."""
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(f"{where}: pass {arg}= or group_{arg}=, not both.")
        n = g.size()
        if isinstance(group_rank, bool) or not isinstance(group_rank, numbers.Integral) or not 0 <= group_rank < n:
            raise ValueError(f"{where}: group_{arg}={group_rank!r} must be an int in [0, {n - 1}].")
        return int(group_rank)
    if global_rank is None:
        raise TypeError(f"{where}: {arg}= is required.")
    return _group_rank(g, global_rank, where, arg)


def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None, **kwargs) -> Group:
    """A group of some ranks, as ``torch.distributed.new_group(ranks)``.

    Any set of distinct ranks works: XLA runs a group's collective as a program
    over the members' devices only, so non-members need not call it (nor even
    call ``new_group``). ``ranks=None`` gives the default group.
    """
    where = "new_group"
    st = state(where)
    if ranks is None:
        return group.WORLD
    try:
        items = list(ranks)
    except TypeError:
        raise TypeError(f"{where}: ranks={ranks!r} must be a list of ints such as [0, 1].") from None
    if not items:
        raise ValueError(f"{where}: ranks={ranks!r} is empty; name at least one rank.")
    for r in items:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{where}: ranks={ranks!r} holds {r!r}; every rank must be an int.")
        if not 0 <= r < st.world_size:
            raise ValueError(
                f"{where}: ranks={ranks!r} holds {r}, out of range for world size {st.world_size}; "
                f"use ranks in [0, {st.world_size - 1}]."
            )
    if len(set(items)) != len(items):
        raise ValueError(f"{where}: ranks={ranks!r} repeats a rank; list each rank once.")
    if backend is not None and resolve_backend(backend, where).name != st.backend.name:
        raise ValueError(
            f"{where}: backend={backend!r} differs from the default group's {st.backend.name!r}; "
            "one process runs one backend here (omit backend=)."
        )
    ranks_t = tuple(sorted(items))
    return group.WORLD if ranks_t == tuple(range(st.world_size)) else Group(ranks_t)


def get_process_group_ranks(group: Any = None) -> list[int]:
    g = group_of_any(group, "get_process_group_ranks")
    return list(g.global_ranks())


def get_group_rank(group: Any, global_rank: int) -> int:
    return _group_rank(group_of_any(group, "get_group_rank"), global_rank, "get_group_rank", "global_rank")


def get_global_rank(group: Any, group_rank: int) -> int:
    g = group_of_any(group, "get_global_rank")
    ranks = g.global_ranks()
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(f"get_global_rank: group_rank={group_rank!r} is out of range for {g!r} of size {len(ranks)}.")
    return ranks[group_rank]


def group_of_any(g: Any, where: str) -> Group:
    """Like :func:`group_of` without the membership check."""
    state(where)
    g = group.WORLD if g is None else g
    if not isinstance(g, Group):
        raise TypeError(f"{where}: group={g!r} must be None (all ranks) or a group from dist.new_group(ranks).")
    return g


# --- state queries --------------------------------------------------------------------------
def state(where: str) -> _State:
    if _STATE is None:
        raise RuntimeError(
            f"{where}: the default process group is not initialized; call "
            "spmd.distributed.init_process_group() first (run the script with spmdrun for several processes)."
        )
    return _STATE


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _STATE is not None


def get_rank(group: Any = None) -> int:
    """This process's rank (in ``group`` if given; -1 if not a member), as torch."""
    if group is None:
        return state("get_rank").rank
    return group_of_any(group, "get_rank").rank()


def get_world_size(group: Any = None) -> int:
    if group is None:
        return state("get_world_size").world_size
    return group_of_any(group, "get_world_size").size()


def get_backend(group: Any = None) -> str:
    group_of_any(group, "get_backend")
    return state("get_backend").backend.name


def destroy_process_group(group: Any = None) -> None:
    """Forget the default group (or do nothing for a sub-group), as torch.

    JAX's distributed runtime stays up until the process exits (it cannot be
    restarted in one process); at exit every rank waits for the others, up to
    the timeout. ``init_process_group`` may be called again with the same rank
    and world size.
    """
    global _STATE
    if group is None or group is globals()["group"].WORLD:
        state("destroy_process_group")
        _STATE = None


# --- init -----------------------------------------------------------------------------------
def seconds(value: Any, where: str, arg: str) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {arg}={value!r} must be a datetime.timedelta or a number of seconds.")
    if not value > 0:
        raise ValueError(f"{where}: {arg}={value!r} must be positive.")
    return float(value)


def _env_int(name: str, where: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{where}: the environment variable {name}={raw!r} must be an integer.") from None


def _env_seconds(name: str, default: float, where: str) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{where}: the environment variable {name}={raw!r} must be a number of seconds.") from None
    if not value > 0:
        raise ValueError(f"{where}: the environment variable {name}={raw!r} must be positive.")
    return value


def _parse_init_method(init_method: Any, where: str) -> tuple[str | None, int | None]:
    if init_method is None or init_method == "env://":
        addr = os.environ.get("MASTER_ADDR") or None
        port = _env_int("MASTER_PORT", where)
        return addr, port
    if not isinstance(init_method, str):
        raise TypeError(f"{where}: init_method={init_method!r} must be a string such as 'env://' or 'tcp://host:port'.")
    if init_method.startswith("tcp://"):
        rest = init_method[len("tcp://") :].split("?", 1)[0].rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{where}: init_method={init_method!r} must look like 'tcp://10.1.1.20:23456'.")
        return host.strip("[]"), int(port)
    raise ValueError(
        f"{where}: init_method={init_method!r} is not supported; use 'env://' (MASTER_ADDR, MASTER_PORT, RANK, "
        "WORLD_SIZE, as spmdrun sets them) or 'tcp://host:port'."
    )


def fail(message: str, code: int = 1) -> None:
    """Print ``message`` and end this process now, skipping JAX's exit barrier."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(code)


def _install_excepthook() -> None:
    """An uncaught exception ends the process at once (after printing it), so that
    the other ranks see it die instead of waiting for it at JAX's exit barrier."""
    if getattr(sys.excepthook, "_spmd", False):
        return
    previous = sys.excepthook

    def hook(etype, value, tb):
        previous(etype, value, tb)
        if _STATE is not None and _STATE.multiprocess:
            fail(f"spmd.distributed: rank {_STATE.rank} raised {etype.__name__}; ending this rank now.", 1)

    hook._spmd = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _wait_for_coordinator(host: str, port: int, deadline: float, rank: int, timeout: float, where: str) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{where}: rank {rank} could not reach the coordinator (rank 0) at {host}:{port} within "
                f"{timeout:g} s ({last}); check MASTER_ADDR/MASTER_PORT and that rank 0 is running "
                "(raise the limit with init_process_group(timeout=...) or SPMD_TIMEOUT)."
            )
        time.sleep(0.1)


def _port_taken_error(port: int, where: str, detail: str) -> RuntimeError:
    return RuntimeError(
        f"{where}: rank 0 could not start the coordinator on port {port} (already in use?): {detail}. "
        "Choose a free MASTER_PORT, or run spmdrun --standalone, which picks one."
    )


def _check_port_free(port: int, where: str) -> None:
    """Rank 0: refuse a taken port before JAX tries it (its failure path can crash the process)."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            return
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _port_taken_error(port, where, str(e)) from None
        finally:
            s.close()


def _devices_per_proc(where: str) -> int | None:
    per_proc = _env_int("SPMD_DEVICES_PER_PROC", where)
    if per_proc is not None and per_proc < 1:
        raise ValueError(
            f"{where}: the environment variable SPMD_DEVICES_PER_PROC={per_proc!r} must be >= 1 "
            "(spmdrun --devices-per-proc sets it); unset it for one device per process."
        )
    return per_proc


def _single_process_devices(where: str) -> None:
    """World size 1: honour SPMD_DEVICES_PER_PROC (spmdrun --devices-per-proc) if JAX has not started."""
    import jax
    from jax._src import xla_bridge

    per_proc = _devices_per_proc(where)
    if per_proc is not None and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", per_proc)


def _configure_jax(spec: BackendSpec, where: str) -> list[int] | None:
    """Several processes: set JAX up for ``spec`` before its backends start; the local device ids."""
    import jax
    from jax._src import xla_bridge

    per_proc = _devices_per_proc(where)
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"{where}: JAX's backends are already initialized in this process (something called "
            "jax.devices() or ran a computation before init_process_group); call init_process_group "
            "before any other JAX work."
        )
    if spec.platform == "cpu":
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", spec.cpu_collectives)
        if per_proc is not None:
            jax.config.update("jax_num_cpu_devices", per_proc)
        return None
    local = _env_int("LOCAL_RANK", where)
    if per_proc is not None:
        return list(range((local or 0) * per_proc, ((local or 0) + 1) * per_proc))
    lws = _env_int("LOCAL_WORLD_SIZE", where)
    return [local] if local is not None and lws and lws > 1 else None


def init_process_group(
    backend: Any = None,
    init_method: Any = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Join the job, as ``torch.distributed.init_process_group``.

    ``init_method`` is ``"env://"`` (default: ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``, as ``spmdrun`` sets them) or ``"tcp://host:port"``;
    ``rank`` and ``world_size`` override the environment. Without any of them the
    process runs alone (world size 1). Rank 0 hosts JAX's coordination service
    on ``MASTER_PORT``; every rank calls ``jax.distributed.initialize``.

    ``backend``: ``"gloo"`` (CPU collectives over TCP), ``"nccl"`` (GPUs),
    ``"mpi"`` (CPU over MPI, needs ``MPITRAMPOLINE_LIB``), or None to pick the one
    this machine runs; ``"ucc"`` is refused. ``timeout`` (timedelta or seconds)
    bounds the wait for the other ranks; see the module notes for every bound.
    """
    global _STATE
    where = "init_process_group"
    if _STATE is not None:
        raise RuntimeError(
            f"{where}: the default process group is already initialized; call destroy_process_group() first."
        )
    if store is not None:
        raise ValueError(f"{where}: store={store!r} is not supported; use init_method='env://' or 'tcp://host:port'.")
    spec = resolve_backend(backend, where)
    timeout_s = seconds(timeout, where, "timeout") if timeout is not None else _env_seconds("SPMD_TIMEOUT", DEFAULT_TIMEOUT_S, where)
    heartbeat_s = max(1, int(round(_env_seconds("SPMD_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_S, where))))
    addr, port = _parse_init_method(init_method, where)
    for arg, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {arg}={value!r} must be an int (-1 reads it from the environment).")
    rank = rank if rank >= 0 else _env_int("RANK", where)
    world = world_size if world_size >= 0 else _env_int("WORLD_SIZE", where)
    if world is None:
        if rank not in (None, 0):
            raise ValueError(f"{where}: RANK={rank} is set but WORLD_SIZE is not; set both (spmdrun does).")
        world, rank = 1, 0
    if rank is None:
        raise ValueError(f"{where}: WORLD_SIZE={world} is set but RANK is not; set both (spmdrun does).")
    if world < 1:
        raise ValueError(f"{where}: world_size={world} must be >= 1.")
    if not 0 <= rank < world:
        raise ValueError(
            f"{where}: rank={rank} is out of range for world_size={world}; ranks are 0..{world - 1}. "
            "Check RANK and WORLD_SIZE."
        )
    if world == 1:
        _single_process_devices(where)
        _STATE = _State(0, 1, spec, timeout_s, False)
        return
    if addr is None or port is None:
        raise ValueError(
            f"{where}: world_size={world} needs the coordinator's address: set MASTER_ADDR and MASTER_PORT "
            "(spmdrun sets them), or pass init_method='tcp://host:port'."
        )
    if not 0 < port < 65536:
        raise ValueError(f"{where}: MASTER_PORT={port} must be in 1..65535.")
    local_ids = _configure_jax(spec, where)
    _STATE = _join(spec, rank, world, addr, port, timeout_s, heartbeat_s, local_ids, where)
    _install_excepthook()


def _join(spec, rank, world, addr, port, timeout_s, heartbeat_s, local_ids, where) -> _State:
    import jax
    from jax._src import distributed as jdist

    coordinator = f"{addr}:{port}"
    gs = jdist.global_state
    if gs.client is not None:
        # A second init after destroy_process_group: reuse the runtime if it matches.
        if (gs.process_id, gs.num_processes) != (rank, world):
            raise RuntimeError(
                f"{where}: JAX's distributed runtime of this process already runs as rank {gs.process_id} of "
                f"{gs.num_processes}; it cannot be restarted in one process (start a new process)."
            )
        return _State(rank, world, spec, timeout_s, True)
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        _wait_for_coordinator(addr, port, deadline, rank, timeout_s, where)
    else:
        _check_port_free(port, where)

    def on_timeout():
        fail(
            f"{where}: rank {rank} timed out after {timeout_s:g} s waiting for all {world} ranks to join the "
            f"coordinator at {coordinator}: check that WORLD_SIZE={world} is the number of processes launched "
            "and that every rank started (raise the limit with init_process_group(timeout=...) or SPMD_TIMEOUT).",
            1,
        )

    watchdog = threading.Timer(max(0.5, deadline - time.monotonic()), on_timeout)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            jax.distributed.initialize(
                coordinator,
                num_processes=world,
                process_id=rank,
                local_device_ids=local_ids,
                initialization_timeout=int(timeout_s) + 10,  # ours fires first, with a clearer message
                heartbeat_timeout_seconds=heartbeat_s,
                shutdown_timeout_seconds=int(_env_seconds("SPMD_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_S, where)),
            )
        except Exception as e:
            if rank == 0 and "Failed to start RPC server" in str(e):
                raise _port_taken_error(port, where, str(e)) from None
            raise
        client = gs.client
        key = "spmd/init/world_size"
        if rank == 0:
            client.key_value_set(key, str(world))
        got = int(client.blocking_key_value_get(key, int(max(1.0, deadline - time.monotonic()) * 1000)))
        if got != world:
            fail(
                f"{where}: rank {rank} was started with WORLD_SIZE={world} but rank 0 with WORLD_SIZE={got}; "
                "every rank must get the same WORLD_SIZE (spmdrun sets it).",
                1,
            )
        jax.devices()  # joins the global topology exchange (all ranks), still under the watchdog
    finally:
        watchdog.cancel()
    if jax.process_count() != world:
        fail(f"{where}: JAX sees {jax.process_count()} processes but WORLD_SIZE={world}.", 1)
    return _State(rank, world, spec, timeout_s, True)
