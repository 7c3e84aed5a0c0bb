"""JAX's configuration for a job, set before its backends start.

World size 1 only honours ``SPMD_DEVICES_PER_PROC``; several processes also
pick the CPU collectives of the backend (gloo / MPI) and, on GPUs, the local
devices of this process.
"""

from __future__ import annotations

import jax
from jax._src import distributed as jdist
from jax._src import xla_bridge

from spmd.distributed._env import JobConfig

__all__ = ["configure_single_process", "configure_multiprocess"]


def configure_single_process(config: JobConfig) -> None:
    """World size 1: honour SPMD_DEVICES_PER_PROC (spmdrun --devices-per-proc) if JAX has not started."""
    if config.devices_per_proc is not None and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", config.devices_per_proc)


def configure_multiprocess(config: JobConfig, where: str) -> list[int] | None:
    """Several processes: set JAX up for the backend before it starts; the local device ids
    (None: JAX's default)."""
    gs = jdist.global_state
    if gs.client is None and gs.num_processes > 1:
        raise RuntimeError(
            f"{where}: JAX's distributed runtime of this process (rank {gs.process_id} of {gs.num_processes}) was "
            "shut down (after a refused join, or by jax.distributed.shutdown()); it cannot be started again in one "
            "process: start a new process."
        )
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"{where}: JAX's backends are already initialized in this process (something called "
            "jax.devices() or ran a computation before init_process_group); call init_process_group "
            "before any other JAX work."
        )
    spec, per_proc = config.backend, config.devices_per_proc
    if spec.platform == "cpu":
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", spec.cpu_collectives)
        if per_proc is not None:
            jax.config.update("jax_num_cpu_devices", per_proc)
        return None
    local = config.local_rank or 0
    if per_proc is not None:
        return list(range(local * per_proc, (local + 1) * per_proc))
    lws = config.local_world_size
    return [local] if config.local_rank is not None and lws and lws > 1 else None
