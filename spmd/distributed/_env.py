"""What ``init_process_group`` reads: its arguments and the launcher's environment, checked once.

``read_config`` turns ``init_process_group``'s arguments and the variables
``spmdrun`` sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``SPMD_DEVICES_PER_PROC``) and the
``SPMD_*`` time bounds into one frozen :class:`JobConfig`, or a ValueError /
TypeError naming the argument or variable.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

from spmd.distributed._backend import BackendSpec, resolve_backend

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_SHUTDOWN_S",
    "JobConfig",
    "read_config",
    "seconds",
    "env_int",
    "env_seconds",
    "parse_init_method",
    "devices_per_proc",
    "debug_level",
    "check_collectives",
]

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_S = 10
DEFAULT_SHUTDOWN_S = 300.0
_DEBUG_VARS = ("SPMD_DISTRIBUTED_DEBUG", "TORCH_DISTRIBUTED_DEBUG")
_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One process's view of the job, as ``init_process_group`` was asked to join it.

    ``addr``/``port``: the coordinator (rank 0); None when the world size is 1.
    ``timeout_s`` bounds joining, barriers and every collective;
    ``heartbeat_s`` how soon a dead rank is noticed; ``shutdown_s`` the wait at exit.
    """

    backend: BackendSpec
    rank: int
    world_size: int
    addr: str | None
    port: int | None
    timeout_s: float
    heartbeat_s: int
    shutdown_s: float
    devices_per_proc: int | None
    local_rank: int | None
    local_world_size: int | None
    debug: str = "OFF"

    @property
    def coordinator(self) -> str:
        return f"{self.addr}:{self.port}"


def seconds(value: Any, where: str, arg: str) -> float:
    """A positive number of seconds from a ``datetime.timedelta`` or a number."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {arg}={value!r} must be a datetime.timedelta or a number of seconds.")
    if not value > 0:
        raise ValueError(f"{where}: {arg}={value!r} must be positive.")
    return float(value)


def env_int(name: str, where: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{where}: the environment variable {name}={raw!r} must be an integer.") from None


def env_seconds(name: str, default: float, where: str) -> float:
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


def parse_init_method(init_method: Any, where: str) -> tuple[str | None, int | None]:
    """(host, port) of the coordinator from ``init_method`` (``env://`` reads MASTER_ADDR/PORT)."""
    if init_method is None or init_method == "env://":
        addr = os.environ.get("MASTER_ADDR") or None
        port = env_int("MASTER_PORT", where)
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


def devices_per_proc(where: str) -> int | None:
    """``SPMD_DEVICES_PER_PROC`` (``spmdrun --devices-per-proc``), checked; None when unset."""
    per_proc = env_int("SPMD_DEVICES_PER_PROC", where)
    if per_proc is not None and per_proc < 1:
        raise ValueError(
            f"{where}: the environment variable SPMD_DEVICES_PER_PROC={per_proc!r} must be >= 1 "
            "(spmdrun --devices-per-proc sets it); unset it for one device per process."
        )
    return per_proc


def debug_level(where: str) -> str:
    """``OFF`` / ``INFO`` / ``DETAIL`` from SPMD_DISTRIBUTED_DEBUG, else TORCH_DISTRIBUTED_DEBUG
    (``DETAIL`` checks every collective's signature across ranks)."""
    for var in _DEBUG_VARS:
        raw = os.environ.get(var)
        if raw:
            level = raw.strip().upper()
            if level not in _DEBUG_LEVELS:
                raise ValueError(
                    f"{where}: the environment variable {var}={raw!r} must be one of {list(_DEBUG_LEVELS)}."
                )
            return level
    return "OFF"


def check_collectives(value: Any, where: str) -> bool:
    """Whether every collective's fingerprint is checked across ranks: ``value``
    (``init_process_group(check_collectives=...)``) when given, else ``SPMD_CHECK_COLLECTIVES``, else on."""
    if value is not None:
        if not isinstance(value, bool):
            raise TypeError(f"{where}: check_collectives={value!r} must be True or False (or None: the default).")
        return value
    raw = os.environ.get("SPMD_CHECK_COLLECTIVES")
    if raw is None or raw.strip() == "":
        return True
    flag = raw.strip().lower()
    if flag in ("1", "true", "on", "yes"):
        return True
    if flag in ("0", "false", "off", "no"):
        return False
    raise ValueError(
        f"{where}: the environment variable SPMD_CHECK_COLLECTIVES={raw!r} must be 1 (check every collective, "
        "the default) or 0 (do not)."
    )


def _rank_and_world(rank: Any, world_size: Any, where: str) -> tuple[int, int]:
    for arg, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: {arg}={value!r} must be an int (-1 reads it from the environment).")
    r = rank if rank >= 0 else env_int("RANK", where)
    world = world_size if world_size >= 0 else env_int("WORLD_SIZE", where)
    if world is None:
        if r not in (None, 0):
            raise ValueError(f"{where}: RANK={r} is set but WORLD_SIZE is not; set both (spmdrun does).")
        return 0, 1
    if r is None:
        raise ValueError(f"{where}: WORLD_SIZE={world} is set but RANK is not; set both (spmdrun does).")
    if world < 1:
        raise ValueError(f"{where}: world_size={world} must be >= 1.")
    if not 0 <= r < world:
        raise ValueError(
            f"{where}: rank={r} is out of range for world_size={world}; ranks are 0..{world - 1}. "
            "Check RANK and WORLD_SIZE."
        )
    return r, world


def read_config(backend: Any, init_method: Any, timeout: Any, world_size: Any, rank: Any, where: str) -> JobConfig:
    """Check ``init_process_group``'s arguments and the environment; the job this process joins."""
    spec = resolve_backend(backend, where)
    timeout_s = (
        seconds(timeout, where, "timeout") if timeout is not None
        else env_seconds("SPMD_TIMEOUT", DEFAULT_TIMEOUT_S, where)
    )
    heartbeat_s = max(1, int(round(env_seconds("SPMD_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_S, where))))
    shutdown_s = env_seconds("SPMD_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_S, where)
    addr, port = parse_init_method(init_method, where)
    r, world = _rank_and_world(rank, world_size, where)
    per_proc = devices_per_proc(where)
    if world > 1:
        if addr is None or port is None:
            raise ValueError(
                f"{where}: world_size={world} needs the coordinator's address: set MASTER_ADDR and MASTER_PORT "
                "(spmdrun sets them), or pass init_method='tcp://host:port'."
            )
        if not 0 < port < 65536:
            raise ValueError(f"{where}: MASTER_PORT={port} must be in 1..65535.")
    return JobConfig(
        backend=spec,
        rank=r,
        world_size=world,
        addr=addr,
        port=port,
        timeout_s=timeout_s,
        heartbeat_s=heartbeat_s,
        shutdown_s=shutdown_s,
        devices_per_proc=per_proc,
        local_rank=env_int("LOCAL_RANK", where),
        local_world_size=env_int("LOCAL_WORLD_SIZE", where),
        debug=debug_level(where),
    )
