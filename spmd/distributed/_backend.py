"""Backends: torch's names mapped to XLA platforms and CPU collective implementations.

| torch backend | XLA platform | cross-process collectives            |
| ------------- | ------------ | ------------------------------------ |
| ``nccl``      | ``cuda``     | NCCL (XLA's GPU collectives)         |
| ``gloo``      | ``cpu``      | gloo over TCP (``jax_cpu_collectives_implementation='gloo'``) |
| ``mpi``       | ``cpu``      | eager c10d calls over MPI (mpi4py); XLA's own over gloo |
| ``ucc``       | none         | refused, with the alternatives named |

``mpi`` is torch's MPI backend: rank and world size come from the MPI launch
(``mpiexec -n N python script.py``), the eager collectives of
``spmd.distributed`` on host buffers run as MPI calls through mpi4py (the
``spmd[mpi]`` extra brings mpi4py and MPICH), and the collectives inside
compiled programs (``@spmd``, DTensor) stay on gloo: see ``docs/mpi.md``.

``backend=None`` picks ``mpi`` in a process that ``mpiexec`` started (and not
spmdrun / torchrun: no ``RANK``) when mpi4py is installed; under
``spmdrun --backend mpi`` (``SPMD_BACKEND=mpi``) ``None`` and ``"gloo"`` both
mean ``mpi``: the launcher chose how the script's CPU collectives run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

__all__ = ["Backend", "BackendSpec", "resolve_backend", "mpi_launched"]


class Backend(str):
    """A backend name, as ``torch.distributed.Backend``: ``Backend("GLOO") == "gloo"``.

    ``Backend.NCCL``, ``Backend.GLOO``, ``Backend.MPI``, ``Backend.UCC`` are the
    names torch has; see :func:`init_process_group` for what each maps to.
    """

    NCCL = "nccl"
    GLOO = "gloo"
    MPI = "mpi"
    UCC = "ucc"
    UNDEFINED = "undefined"

    def __new__(cls, name: str):
        if not isinstance(name, str):
            raise TypeError(f"Backend: name={name!r} must be a string such as 'gloo' or 'nccl'.")
        value = name.lower()
        if value not in _KNOWN:
            raise ValueError(f"Backend: name={name!r} is unknown; use one of {', '.join(repr(k) for k in _KNOWN)}.")
        return super().__new__(cls, value)


_KNOWN = ("nccl", "gloo", "mpi", "ucc")


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend name means on this machine."""

    name: str  # torch's name: "gloo", "nccl", "mpi"
    platform: str  # XLA platform: "cpu" or "cuda"
    cpu_collectives: str | None  # jax_cpu_collectives_implementation, or None on GPU


def _has_cuda_plugin() -> bool:
    for mod in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(mod) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _platforms_env() -> str:
    import jax

    return (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").lower()


# What MPI launchers put in each process's environment (MPICH/Hydra and Intel MPI: PMI_*; Open MPI;
# PMIx-based launchers, Slurm's srun --mpi=pmix included).
_MPI_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def _has_mpi4py() -> bool:
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def _has_mpi() -> bool:
    """mpi4py is installed (the ``spmd[mpi]`` extra)."""
    return _has_mpi4py()


def mpi_launched() -> bool:
    """This process was started by an MPI launcher (``mpiexec``)."""
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def _check_mpi(backend: Any, where: str) -> None:
    if not _has_mpi4py():
        raise RuntimeError(
            f"{where}: backend={backend!r} needs mpi4py and an MPI library, which are not installed: "
            "pip install 'spmd[mpi]' (mpi4py and MPICH, whose mpiexec launches the job), then run "
            "mpiexec -n N python script.py. Use backend='gloo' for CPU collectives over TCP, which needs no MPI."
        )
    if not mpi_launched():
        raise RuntimeError(
            f"{where}: backend={backend!r} needs an MPI launch, and this process was not started by one "
            f"(none of {', '.join(_MPI_LAUNCH_VARS)} is set): run the script as mpiexec -n N python script.py "
            "(MPICH's mpiexec comes with pip install 'spmd[mpi]'). Use backend='gloo' under spmdrun otherwise."
        )


def resolve_backend(backend: Any, where: str = "init_process_group") -> BackendSpec:
    """Check ``backend`` and say what it means here; clear errors for what cannot run."""
    launcher = os.environ.get("SPMD_BACKEND", "").strip().lower()  # spmdrun --backend mpi sets it
    if launcher == "mpi" and (backend is None or (isinstance(backend, str) and backend.lower() in ("gloo", "cpu:gloo"))):
        backend = "mpi"  # the launcher's choice: the script's CPU collectives run on MPI
    elif backend is None and mpi_launched() and "RANK" not in os.environ and _has_mpi4py():
        backend = "mpi"  # started by mpiexec, not by spmdrun / torchrun: MPI is how the ranks find each other
    if backend is None:
        platforms = _platforms_env()
        gpu = _has_cuda_plugin() and (not platforms or "cuda" in platforms or "gpu" in platforms)
        backend = "nccl" if gpu else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"{where}: backend={backend!r} must be a string such as 'gloo' or 'nccl' (or None).")
    name = backend.lower()
    if ":" in name or "," in name:
        # torch accepts "cpu:gloo,cuda:nccl": take the entry for the device we have.
        parts = dict(p.split(":", 1) for p in name.split(",") if ":" in p)
        name = parts.get("cuda") if "cuda" in parts and _has_cuda_plugin() else parts.get("cpu", name)
    if name == "gloo":
        return BackendSpec("gloo", "cpu", "gloo")
    if name == "nccl":
        if not _has_cuda_plugin():
            raise RuntimeError(
                f"{where}: backend={backend!r} needs NVIDIA GPUs and JAX's CUDA plugin "
                "(pip install 'jax[cuda12]'), and this machine has neither; use backend='gloo' "
                "for CPU collectives (or backend=None to pick the one this machine can run)."
            )
        return BackendSpec("nccl", "cuda", None)
    if name == "mpi":
        _check_mpi(backend, where)
        return BackendSpec("mpi", "cpu", "gloo")  # eager calls over MPI; compiled programs' collectives on gloo
    if name == "ucc":
        raise RuntimeError(
            f"{where}: backend={backend!r} is not available: XLA has no UCC collectives. "
            "Use backend='nccl' on NVIDIA GPUs, backend='gloo' on CPU, or backend='mpi' (pip install 'spmd[mpi]')."
        )
    raise ValueError(
        f"{where}: backend={backend!r} is unknown; use one of 'gloo' (CPU), 'nccl' (NVIDIA GPU), "
        "'mpi' (CPU over MPI), or None to pick the one this machine can run."
    )
