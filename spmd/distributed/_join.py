"""Joining the job: rank 0 hosts JAX's coordination service, every rank connects to it.

Each rank first passes the job's front door (:mod:`spmd.distributed._rendezvous`
on ``MASTER_ADDR:MASTER_PORT``: same job, same ``WORLD_SIZE``, a rank not
already taken), which tells it the coordination service's port; rank 0 binds
the service to ``MASTER_ADDR`` only. Every wait is bounded by the job's
``timeout_s``: reaching rank 0, and all ranks joining (a watchdog ends the rank
with a clear message, as JAX's own failure path can abort the process).
"""

from __future__ import annotations

import threading
import time

import jax
from jax._src import distributed as jdist

from spmd.distributed._env import JobConfig
from spmd.distributed._errors import fail
from spmd.distributed._rendezvous import host_port, knock, serve
from spmd.distributed._state import State

__all__ = ["join"]


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
    coordinator_port = serve(config, where) if rank == 0 else knock(config, deadline, where)
    coordinator = host_port(config.addr, coordinator_port)

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
        jax.distributed.initialize(
            coordinator,
            num_processes=world,
            process_id=rank,
            local_device_ids=local_device_ids,
            initialization_timeout=int(config.timeout_s) + 10,  # ours fires first, with a clearer message
            heartbeat_timeout_seconds=config.heartbeat_s,
            shutdown_timeout_seconds=int(config.shutdown_s),
            coordinator_bind_address=coordinator if rank == 0 else None,
        )
        jax.devices()  # joins the global topology exchange (all ranks), still under the watchdog
    finally:
        watchdog.cancel()
    if jax.process_count() != world:
        fail(f"{where}: JAX sees {jax.process_count()} processes but WORLD_SIZE={world}.", 1)
    return _state_of(config)
