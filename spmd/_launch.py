"""``init_device_mesh`` under a launcher: never N independent single-process worlds.

torch's ``init_device_mesh`` (``torch.distributed.device_mesh``) initialises the
default process group when it is not; ``spmd.distributed.init_device_mesh``
does the same. ``spmd.init_device_mesh`` (this package's, below
``spmd.distributed``) cannot start the job itself: under a launcher it refuses
to build a mesh of this process's devices alone and says how to join, and its
too-few-devices advice names the launcher's options instead of ``XLA_FLAGS``.
"""

from __future__ import annotations

import os

__all__ = ["launched_world_size", "check_joined", "missing_devices_hint"]


def launched_world_size() -> int:
    """``WORLD_SIZE`` as a launcher (spmdrun, torchrun) set it; 1 when absent or not an int."""
    raw = os.environ.get("WORLD_SIZE", "")
    return int(raw) if raw.strip().isdigit() else 1


def _joined() -> bool:
    from jax._src import distributed as jdist

    return jdist.global_state.client is not None


def check_joined(where: str) -> None:
    """Refuse a mesh of one process's devices in a process that a launcher started with others."""
    world = launched_world_size()
    if world > 1 and not _joined():
        raise RuntimeError(
            f"{where}: this process was started by a launcher with WORLD_SIZE={world} but has not joined the "
            "job, so a mesh would hold this process's devices only; call spmd.distributed.init_process_group() "
            "first, or use spmd.distributed.init_device_mesh, which joins the job as torch's init_device_mesh does."
        )


def missing_devices_hint(n: int, have: int, platform: str) -> str:
    """How to get ``n`` devices when ``have`` exist (the end of init_device_mesh's error)."""
    world = launched_world_size()
    if world > 1:
        return (
            f"; the {world} processes of this job hold {have} {platform} device(s) in all: launch more processes "
            f"or give each more devices (spmdrun --nproc-per-node N --devices-per-proc K with N*K = {n})"
        )
    if platform == "cpu":
        return f"; for more CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX is imported"
    return "; run more processes with spmdrun and spmd.distributed.init_device_mesh"
