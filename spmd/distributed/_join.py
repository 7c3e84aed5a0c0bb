"""Joining the job: rank 0 hosts JAX's coordination service, every rank connects to it.

Every wait is bounded by the job's ``timeout_s``: reaching the coordinator,
all ranks joining (a watchdog ends the rank with a clear message, as JAX's own
failure path can abort the process), and the agreement on ``WORLD_SIZE``.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import jax
from jax._src import distributed as jdist

from spmd.distributed._env import JobConfig
from spmd.distributed._errors import fail
from spmd.distributed._state import State

__all__ = ["join"]


def _wait_for_coordinator(config: JobConfig, deadline: float, where: str) -> None:
    while True:
        try:
            with socket.create_connection((config.addr, config.port), timeout=1.0):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{where}: rank {config.rank} could not reach the coordinator (rank 0) at {config.coordinator} "
                f"within {config.timeout_s:g} s ({last}); check MASTER_ADDR/MASTER_PORT and that rank 0 is "
                "running (raise the limit with init_process_group(timeout=...) or SPMD_TIMEOUT)."
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


def _state_of(config: JobConfig) -> State:
    return State(config.rank, config.world_size, config.backend, config.timeout_s, True, config.debug == "DETAIL")


def join(config: JobConfig, local_device_ids: list[int] | None, where: str) -> State:
    """Join the job described by ``config`` (world size > 1); this process's state."""
    rank, world = config.rank, config.world_size
    gs = jdist.global_state
    if gs.client is not None:
        # A second init after destroy_process_group: reuse the runtime if it matches.
        if (gs.process_id, gs.num_processes) != (rank, world):
            raise RuntimeError(
                f"{where}: JAX's distributed runtime of this process already runs as rank {gs.process_id} of "
                f"{gs.num_processes}; it cannot be restarted in one process (start a new process)."
            )
        return _state_of(config)
    deadline = time.monotonic() + config.timeout_s
    if rank != 0:
        _wait_for_coordinator(config, deadline, where)
    else:
        _check_port_free(config.port, where)

    def on_timeout():
        fail(
            f"{where}: rank {rank} timed out after {config.timeout_s:g} s waiting for all {world} ranks to join "
            f"the coordinator at {config.coordinator}: check that WORLD_SIZE={world} is the number of processes "
            "launched and that every rank started (raise the limit with init_process_group(timeout=...) or "
            "SPMD_TIMEOUT).",
            1,
        )

    watchdog = threading.Timer(max(0.5, deadline - time.monotonic()), on_timeout)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            jax.distributed.initialize(
                config.coordinator,
                num_processes=world,
                process_id=rank,
                local_device_ids=local_device_ids,
                initialization_timeout=int(config.timeout_s) + 10,  # ours fires first, with a clearer message
                heartbeat_timeout_seconds=config.heartbeat_s,
                shutdown_timeout_seconds=int(config.shutdown_s),
            )
        except Exception as e:
            if rank == 0 and "Failed to start RPC server" in str(e):
                raise _port_taken_error(config.port, where, str(e)) from None
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
    return _state_of(config)
