"""torch's ``src_data_rank`` for ``distribute_tensor`` across processes.

torch scatters the tensor of mesh rank ``src_data_rank`` (0 by default), so
ranks that built different values (per-rank random data) still get one
consistent DTensor, and ``Replicate`` replicas are identical. Here every
process of the mesh takes that rank's value first, bit for bit (its bytes are
broadcast as uint8 with JAX's ``multihost_utils.broadcast_one_to_all``, so
-0.0, NaN payloads and 64-bit values arrive unchanged), then lays out its own
blocks. ``src_data_rank=None`` uses each process's own value (no
communication; the caller guarantees they agree), as torch.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from jax.experimental import multihost_utils

from placements import Replicate

__all__ = ["from_source", "replicas_from_coordinate_zero"]


def from_source(arr: np.ndarray, mesh, src_data_rank, where: str) -> np.ndarray:
    """``arr`` as mesh rank ``src_data_rank`` holds it (every process of the mesh calls this)."""
    if src_data_rank is None:
        return arr
    n = mesh.size()
    if isinstance(src_data_rank, bool) or not isinstance(src_data_rank, numbers.Integral):
        raise TypeError(f"{where}: src_data_rank={src_data_rank!r} must be an int rank of the mesh, or None.")
    if not 0 <= src_data_rank < n:
        raise ValueError(f"{where}: src_data_rank={src_data_rank!r} is out of range for {mesh!r}; use 0..{n - 1} or None.")
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) == 1:
        return arr  # the mesh lives in this process: its value is the source's
    owner = mesh.devices.flat[int(src_data_rank)].process_index
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    got = multihost_utils.broadcast_one_to_all(raw, is_source=jax.process_index() == owner)
    return np.asarray(got).view(arr.dtype).reshape(arr.shape)


def replicas_from_coordinate_zero(a: np.ndarray, mesh, placements) -> np.ndarray:
    """torch's ``DTensor.from_local(..., run_check=True)`` across processes: along the Replicate
    mesh dims every process takes the local tensor of the process at coordinate 0 (bit for bit),
    so replicas agree. Every process of the job calls this."""
    rep = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    if not rep or len({d.process_index for d in mesh.devices.flat}) == 1:
        return a
    me = jax.process_index()
    coord = next(c for c in np.ndindex(*mesh.shape) if mesh.devices[c].process_index == me)
    src = tuple(0 if d in rep else c for d, c in enumerate(coord))
    source = mesh.devices[src].process_index
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    every = np.asarray(multihost_utils.process_allgather(padded))  # one row per process (uneven shards padded)
    return every[source][: sizes[source]].view(a.dtype).reshape(a.shape)
