"""``DTensor.from_local``: storage from each rank's local tensor (one process, or this process's)."""

from __future__ import annotations

import itertools

import jax
import numpy as np

from placements import Replicate, Shard, coord_to_rank, format_placements, local_shape, rank_to_coord
from spmd._arrays import as_array
from spmd._x64 import x64_for
from spmd.tensor._source import replicas_from_coordinate_zero
from spmd.tensor._checks import check_mesh, check_shape, check_target
from spmd.tensor._storage import storage_of_blocks

__all__ = ["from_local_storage", "even_global_shape"]


def even_global_shape(local, mesh_shape, pl) -> tuple[int, ...]:
    """The global shape whose even shards have shape ``local`` (as torch's from_local infers it)."""
    g = list(local)
    for m, p in enumerate(pl):
        if isinstance(p, Shard):
            g[p.dim] *= mesh_shape[m]
    return tuple(g)


def from_local_storage(locals, device_mesh, placements, shape, run_check):
    """(mesh, storage, placements, global shape) of ``DTensor.from_local``'s arguments."""
    where = "DTensor.from_local"
    mesh = check_mesh(device_mesh, where)
    if not isinstance(run_check, bool):  # "no" would silently mean True
        raise TypeError(f"{where}: run_check={run_check!r} must be a bool.")
    n = mesh.size()
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    if jax.process_count() > 1 and not callable(locals) and not isinstance(locals, (list, tuple)):
        return (mesh, *_process_storage(locals, mesh, placements, shape, run_check, where))
    if callable(locals) and not isinstance(locals, (jax.Array, np.ndarray)):
        fn = locals
        locals = [fn(r) for r in range(n)]
    elif not isinstance(locals, (list, tuple)):
        what = f"an array of shape {tuple(locals.shape)}" if hasattr(locals, "shape") else repr(locals)
        raise TypeError(
            f"{where}: locals={what} is not a sequence of local tensors; in a single-process run pass a list of "
            f"{n} arrays indexed by rank (or a callable rank -> array)."
        )
    if len(locals) != n:
        raise ValueError(
            f"{where}: locals has {len(locals)} tensor(s) but {mesh!r} has {n} ranks; pass exactly one local "
            "tensor per rank, indexed by rank."
        )
    arrs = [as_array(x, where, f"locals[{r}]") for r, x in enumerate(locals)]
    dtypes = {np.dtype(a.dtype) for a in arrs}
    if len(dtypes) > 1:
        raise TypeError(
            f"{where}: locals have different dtypes {sorted(d.name for d in dtypes)}; cast them to one dtype."
        )
    ndims = {a.ndim for a in arrs}
    if len(ndims) > 1:
        raise ValueError(
            f"{where}: locals have different ranks {sorted(ndims)} (shapes {[tuple(a.shape) for a in arrs]}); "
            "every local tensor has the global tensor's rank."
        )
    pl = check_target(placements, mesh.ndim, arrs[0].ndim, arrs[0].dtype, where)
    gshape, hint = _global_shape(shape, arrs[0], mesh, pl, where)
    for r, a in enumerate(arrs):
        want = local_shape(gshape, mesh.shape, pl, rank_to_coord(r, mesh.shape))
        if tuple(a.shape) != want:
            raise ValueError(
                f"{where}: locals[{r}] has shape {tuple(a.shape)} but placements {format_placements(pl)} of a global "
                f"shape {gshape} give rank {r} the shape {want}; {_mismatch_hint(a.shape, want, pl, hint, arrs[0])}."
            )
    # A Replicate mesh dim holds one value (stored once, _storage.py): as torch's run_check=True, take
    # coordinate 0's along it; without run_check the replicas must already agree (never one kept silently).
    rep_dims = [d for d, p in enumerate(pl) if isinstance(p, Replicate)]
    src = []
    for r in range(n):
        c = list(rank_to_coord(r, mesh.shape))
        for d in rep_dims:
            c[d] = 0
        src.append(coord_to_rank(c, mesh.shape))
    if not run_check:
        _check_replicas(arrs, src, mesh, pl, where)
    arrs = [arrs[s] for s in src]
    blocks = {rank_to_coord(r, mesh.shape): a for r, a in enumerate(arrs)}
    with x64_for(arrs[0].dtype):  # int64 / float64 storage keeps its dtype (spmd/_x64.py)
        return mesh, storage_of_blocks(blocks, mesh, pl, gshape), pl, gshape


def _check_replicas(arrs, src, mesh, pl, where: str) -> None:
    """Each rank's tensor equals (bit for bit) the one at coordinate 0 of its Replicate mesh dims."""
    for r, s in enumerate(src):
        if r != s and not _same_bits(arrs[r], arrs[s]):
            rep = [n for n, p in zip(mesh.mesh_dim_names, pl) if isinstance(p, Replicate)]
            raise ValueError(
                f"{where}: placements {format_placements(pl)} replicate over mesh dim(s) {rep}, but locals[{r}] differs "
                f"from locals[{s}]; a Replicate value is one tensor. Pass equal tensors, run_check=True to take "
                "coordinate 0's (as torch), or Partial() if they are per-rank contributions to a sum."
            )


def _mismatch_hint(got, want, pl, hint: str, first) -> str:
    """The fix for a local of the wrong shape: ``hint`` (uneven shards: shape=) when a dim that differs is
    sharded; else every rank holds those dims whole, and shape= cannot help."""
    sharded = {p.dim % len(want) for p in pl if isinstance(p, Shard)}
    off = [d for d in range(len(want)) if got[d] != want[d]]
    if any(d in sharded for d in off):
        return hint
    dims = f"dim {off[0]} is" if len(off) == 1 else f"dims {off} are"
    return (f"{dims} not sharded by {format_placements(pl)}, so every rank holds all of it: give every rank's "
            f"local tensor the same size there (locals[0] has shape {tuple(first.shape)})")


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _global_shape(shape, a, mesh, pl, where: str):
    """(global shape, hint for a mismatch): ``shape`` checked, or the even shape of ``a``."""
    if shape is None:
        gshape = even_global_shape(a.shape, mesh.shape, pl)
        return gshape, f"give shape= (the global shape) for uneven shards; assuming even shards it is {gshape}"
    gshape = check_shape(shape, where)
    if len(gshape) != a.ndim:
        raise ValueError(
            f"{where}: shape={gshape!r} has {len(gshape)} dim(s) but the local tensors have {a.ndim}; "
            "give the global shape of the same rank."
        )
    return gshape, "check shape= or the locals"


def _process_storage(local, mesh, placements, shape, run_check: bool, where: str):
    """Multi-process: ``local`` is this process's tensor (one device per process)."""
    a = as_array(local, where, "local_tensor")
    pl = check_target(placements, mesh.ndim, a.ndim, a.dtype, where)
    gshape = even_global_shape(a.shape, mesh.shape, pl) if shape is None else check_shape(shape, where)
    mine = [
        c for c in itertools.product(*(range(s) for s in mesh.shape))
        if mesh.devices[c].process_index == jax.process_index()
    ]
    split = [d for d, p in enumerate(pl) if not isinstance(p, Replicate) and len({c[d] for c in mine}) > 1]
    if split:
        # One tensor cannot fill several blocks of a Shard dim, and would be counted twice on a Partial one.
        raise ValueError(
            f"{where}: this process holds {len(mine)} devices of {mesh!r} that differ along mesh dim(s) "
            f"{[mesh.mesh_dim_names[d] for d in split]}, where placements {format_placements(pl)} do not replicate; "
            "one local tensor cannot fill them. Use one device per process, Replicate() on those dims, or "
            "distribute_tensor with the global value."
        )
    for coord in mine:
        want = local_shape(gshape, mesh.shape, pl, coord)
        if tuple(a.shape) != want:
            raise ValueError(
                f"{where}: this process's local tensor has shape {tuple(a.shape)} but placements "
                f"{format_placements(pl)} of a global shape {gshape} give coordinate {coord} the shape {want}; "
                "give shape= (the global shape) for uneven shards."
            )
    a = np.asarray(a)
    if run_check:  # as torch: replicas take coordinate 0's tensor along Replicate mesh dims
        a = replicas_from_coordinate_zero(a, mesh, pl)
    with x64_for(a.dtype):
        return storage_of_blocks({coord: a for coord in mine}, mesh, pl, gshape), pl, gshape
