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

__all__ = ["from_source"]


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
