"""The default process group: ``init_process_group`` and ``destroy_process_group``.

One process is one rank (as in torch). A process may own several devices
(``spmdrun --devices-per-proc K``); the c10d collectives of this package run on
each rank's first device, and the other devices are there for meshes and
DTensors over all processes' devices (``init_device_mesh``).

Time bounds (seconds; every one configurable):

* ``timeout`` (``init_process_group(timeout=...)``, else ``SPMD_TIMEOUT``,
  else 120): how long a rank waits for the others to join, at a ``barrier``, in
  an object collective and in every tensor collective.
* ``SPMD_HEARTBEAT_TIMEOUT`` (default 10): a rank that dies is noticed by the
  coordination service within this time, which then ends every other rank.
* ``SPMD_SHUTDOWN_TIMEOUT`` (default 300): a rank that ends cleanly waits at
  exit (JAX's shutdown barrier) this long for the others to end too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax._src import distributed as jdist

from spmd.distributed._backend import resolve_backend
from spmd.distributed._env import check_collectives as env_check_collectives
from spmd.distributed._env import debug_level, read_config
from spmd._spawn import quiet_rank_output
from spmd.distributed._errors import install_excepthook
from spmd.distributed._fingerprint import agree_on_setting
from spmd.distributed import _groups
from spmd.distributed._jaxconf import configure_multiprocess, configure_single_process
from spmd.distributed._join import join
from spmd.distributed import _mpi
from spmd.distributed._state import State, current, set_state, state

__all__ = ["init_process_group", "destroy_process_group"]


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
    *,
    check_collectives: bool | None = None,
) -> None:
    """Join the job, as ``torch.distributed.init_process_group``.

    ``init_method`` is ``"env://"`` (default: ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``, as ``spmdrun`` sets them) or ``"tcp://host:port"``;
    ``rank`` and ``world_size`` override the environment. Without any of them the
    process runs alone (world size 1). Rank 0 hosts JAX's coordination service
    on ``MASTER_PORT``; every rank calls ``jax.distributed.initialize``.

    ``backend``: ``"gloo"`` (CPU collectives over TCP), ``"nccl"`` (GPUs),
    ``"mpi"`` (under ``mpiexec``: rank and world size from MPI, eager calls over MPI;
    ``pip install 'spmd[mpi]'``, see ``docs/mpi.md``), or None to pick the one
    this machine runs; ``"ucc"`` is refused. ``timeout`` (timedelta or seconds)
    bounds the wait for the other ranks; see the module notes for every bound.

    ``check_collectives`` (default on; ``SPMD_CHECK_COLLECTIVES=0`` when not given):
    every tensor collective first compares a fingerprint of each rank's call (collective,
    op, root, dtype, shape, call number) and raises a ValueError naming each rank's call
    where they differ; ``False`` saves its cost on latency-bound jobs (every rank must use
    the same setting: the ranks compare it as they join). See ``docs/reliability.md``.
    """
    where = "init_process_group"
    if current() is not None:
        raise RuntimeError(
            f"{where}: the default process group is already initialized; call destroy_process_group() first."
        )
    if store is not None:
        raise ValueError(f"{where}: store={store!r} is not supported; use init_method='env://' or 'tcp://host:port'.")
    checked = env_check_collectives(check_collectives, where)
    started = jdist.global_state.client is None  # this call starts JAX's runtime (else it reuses an earlier one's)
    if resolve_backend(backend, where).name == "mpi":  # launched by mpiexec: rank and world size from MPI
        st = dataclasses.replace(_mpi.init(backend, init_method, timeout, world_size, rank, where),
                                 check_collectives=checked)
        if st.multiprocess:
            quiet_rank_output(debug_level(where))
            _agree_or_leave(st, where, started)
        set_state(st)
        install_excepthook()
        return
    config = read_config(backend, init_method, timeout, world_size, rank, where)
    if config.world_size == 1:
        configure_single_process(config)
        set_state(State(0, 1, config.backend, config.timeout_s, False))
        return
    quiet_rank_output(config.debug)  # gloo's connection lines, under a launcher that passes them on
    # A second init after destroy_process_group reuses the runtime (join checks rank and world size); JAX's
    # backends are set up for it already.
    local_ids = None if not started else configure_multiprocess(config, where)
    st = dataclasses.replace(join(config, local_ids, where), check_collectives=checked)
    _agree_or_leave(st, where, started)
    set_state(st)
    install_excepthook()


def _agree_or_leave(st: State, where: str, started: bool) -> None:
    """The ranks' settings compared (:func:`agree_on_setting`); where they are refused, the JAX runtime this
    call started is shut down again (every rank refuses alike, so all meet in its shutdown barrier): a rank
    that goes on after the refusal is not ended later by the heartbeat of a coordination service whose host
    (rank 0) has left."""
    try:
        agree_on_setting(st, where)
    except BaseException:
        if started and jdist.global_state.client is not None:
            try:
                jax.distributed.shutdown()
            except Exception:  # noqa: BLE001 - the refusal is the error to report
                pass
        raise


def destroy_process_group(group: Any = None) -> None:
    """Forget the default group (or do nothing for a sub-group), as torch.

    JAX's distributed runtime stays up until the process exits (it cannot be
    restarted in one process); at exit every rank waits for the others, up to
    the timeout. ``init_process_group`` may be called again with the same rank
    and world size.
    """
    if group is None or group is _groups.group.WORLD:
        state("destroy_process_group")
        set_state(None)

