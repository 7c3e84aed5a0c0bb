"""The default process group's state: who this process is in the job, once ``init_process_group`` ran.

The bottom module of ``spmd.distributed``: everything else asks :func:`state`.
One process holds at most one default group (as torch); ``init_process_group``
sets it, ``destroy_process_group`` clears it.
"""

from __future__ import annotations

import dataclasses

from spmd.distributed._backend import BackendSpec

__all__ = ["State", "state", "current", "set_state", "is_available", "is_initialized"]


@dataclasses.dataclass(frozen=True)
class State:
    """This process in the job: its rank, the world size, the backend, the collective
    timeout (seconds), whether JAX's distributed runtime runs (world size > 1),
    whether every collective's signature is checked across ranks through the
    coordination service first (``DETAIL``) and whether every collective's
    fingerprint travels with it (:mod:`spmd.distributed._fingerprint`)."""

    rank: int
    world_size: int
    backend: BackendSpec
    timeout_s: float
    multiprocess: bool
    check_calls: bool = False
    check_collectives: bool = True


_STATE: State | None = None


def current() -> State | None:
    """The state, or None before ``init_process_group``."""
    return _STATE


def set_state(new: State | None) -> None:
    global _STATE
    _STATE = new


def state(where: str) -> State:
    """The state; a RuntimeError naming ``where`` before ``init_process_group``."""
    if _STATE is None:
        raise RuntimeError(
            f"{where}: the default process group is not initialized; call "
            "spmd.distributed.init_process_group() first (run the script with spmdrun for several processes)."
        )
    return _STATE


def is_available() -> bool:
    """``True``: the distributed package is always available (torch's ``dist.is_available()``)."""
    return True


def is_initialized() -> bool:
    """Whether ``init_process_group`` has run in this process and ``destroy_process_group`` has not."""
    return _STATE is not None
