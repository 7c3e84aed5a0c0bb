"""What torch programs ask about the machine and the launch: ``is_*_available``,
``is_torchelastic_launched``, ``get_node_local_rank``, ``get_default_backend_for_device``.

None of these starts JAX's backends (``init_process_group`` must come first).
"""

from __future__ import annotations

import os
from typing import Any

from spmd.distributed import _backend

__all__ = [
    "is_gloo_available",
    "is_nccl_available",
    "is_mpi_available",
    "is_ucc_available",
    "is_torchelastic_launched",
    "get_node_local_rank",
    "get_default_backend_for_device",
]


def is_gloo_available() -> bool:
    """True: jaxlib always carries gloo for CPU collectives across processes."""
    return True


def is_nccl_available() -> bool:
    """Whether JAX's CUDA plugin (which brings NCCL) is installed."""
    return _backend._has_cuda_plugin()


def is_mpi_available() -> bool:
    """Whether mpi4py (and so an MPI library) is installed: ``pip install 'spmd[mpi]'``."""
    return _backend._has_mpi()


def is_ucc_available() -> bool:
    """False: XLA has no UCC collectives."""
    return False


def is_torchelastic_launched() -> bool:
    """Whether a launcher started this process: spmdrun (it sets ``SPMD_RESTART_COUNT``) or torchrun."""
    return "SPMD_RESTART_COUNT" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")  # spmdrun/torchrun, MPICH, Open MPI


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``, which spmdrun sets; under mpiexec the MPI
    launcher's ``MPI_LOCALRANKID`` / ``OMPI_COMM_WORLD_LOCAL_RANK``), else ``fallback_rank``."""
    for var in _LOCAL_RANK_VARS:
        raw = os.environ.get(var)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"get_node_local_rank: the environment variable {var}={raw!r} must be an integer.") from None
    if fallback_rank is not None:
        if isinstance(fallback_rank, bool) or not isinstance(fallback_rank, int):
            raise TypeError(f"get_node_local_rank: fallback_rank={fallback_rank!r} must be an int.")
        return fallback_rank
    raise RuntimeError(
        "get_node_local_rank: LOCAL_RANK is not in the environment; launch with spmdrun or mpiexec (which set it) "
        "or pass fallback_rank=."
    )


_DEFAULT = {"cpu": "gloo", "cuda": "nccl", "gpu": "nccl"}


def get_default_backend_for_device(device: Any) -> str:
    """The backend torch would pick for a device type: 'cpu' -> 'gloo', 'cuda' (or 'gpu') -> 'nccl'.
    Takes a string such as 'cuda:0', or a JAX device."""
    where = "get_default_backend_for_device"
    name = getattr(device, "platform", getattr(device, "type", device))
    if not isinstance(name, str):
        raise TypeError(f"{where}: device={device!r} must be a device type such as 'cpu' or 'cuda', or a JAX device.")
    kind = name.split(":", 1)[0].lower()
    if kind not in _DEFAULT:
        raise ValueError(f"{where}: device={device!r} has no backend here; use 'cpu' (gloo) or 'cuda' (nccl).")
    return _DEFAULT[kind]
