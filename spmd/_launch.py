"""What ``init_device_mesh`` does under a launcher: join the job first, as torch's does.

torch's ``init_device_mesh`` initialises the default process group when it is
not; here that is what turns each process's few devices into the job's devices
(JAX's distributed runtime). Without it, N processes started by a launcher
would each build a mesh of their own devices: N independent worlds.
"""

from __future__ import annotations

import os

__all__ = ["launched_world_size", "join_if_launched", "missing_devices_hint"]


def launched_world_size() -> int:
    """``WORLD_SIZE`` as a launcher (spmdrun, torchrun) set it; 1 when absent or not an int."""
    raw = os.environ.get("WORLD_SIZE", "")
    return int(raw) if raw.strip().isdigit() else 1


def join_if_launched() -> None:
    """Under a launcher with several processes, call ``init_process_group()`` unless done."""
    if launched_world_size() > 1:
        import spmd.distributed as dist  # torch's init_device_mesh calls into c10d the same way

        if not dist.is_initialized():
            dist.init_process_group()


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
    return "; run more processes with spmdrun (init_device_mesh then joins the job)"
