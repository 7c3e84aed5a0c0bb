"""The JAX lowering of a redistribute plan: one function per transition (``Step.lowering``).

A plan runs as one jitted ``shard_map`` program over a DTensor's storage (built
by ``spmd/_program.py``). Each step's lowering function takes this device's
padded block, its linear position ``lin`` and the step's :class:`Geometry`
(index tables, ``_tables.py``), and calls the project's collectives
(``spmd/_collectives.py``) over the step's mesh dims. Which function runs is
the transition table's (``placements/_transitions.py``): the executor only
dispatches on ``step.lowering``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from placements import padded_local_shape
from placements._plan import Plan, Step
from spmd import _collectives as C
from spmd._program import block_program
from spmd.tensor._storage import op_identity
from spmd.tensor._tables import DONT_CARE, IDENTITY, Geometry, geometry

__all__ = ["LOWERINGS", "build_program"]


def _compact(x, dim: int, table: np.ndarray, lin, fill=0):
    """``x`` gathered along ``dim`` by ``table[lin]`` (static table, dynamic device index)."""
    n_in = x.shape[dim]
    out_len = table.shape[1]
    if (table == IDENTITY).any():
        idx = np.where(table < 0, n_in, table)
        idx = np.where(table == DONT_CARE, n_in, idx)
        row = jnp.asarray(idx.astype(np.int32))[lin]
        return jnp.take(x, row, axis=dim, mode="fill", fill_value=fill)
    # Contiguous per device? Then a (dynamic) slice.
    starts = []
    t = np.arange(out_len)
    for row in table:
        valid = row >= 0
        if not valid.any():
            starts.append(None)
            continue
        s = row[valid] - t[valid]
        if (s != s[0]).any() or s[0] < 0:
            break
        starts.append(int(s[0]))
    else:
        known = [s for s in starts if s is not None]
        starts = [known[0] if s is None and known else (s or 0) for s in starts]
        need = max(s + out_len for s in starts)
        if need > n_in:
            pad = [(0, 0)] * x.ndim
            pad[dim] = (0, need - n_in)
            x = jnp.pad(x, pad)
        if len(set(starts)) == 1:
            return lax.slice_in_dim(x, starts[0], starts[0] + out_len, axis=dim)
        return lax.dynamic_slice_in_dim(x, jnp.asarray(np.array(starts, np.int32))[lin], out_len, axis=dim)
    idx = np.where(table < 0, 0, table)
    row = jnp.asarray(idx.astype(np.int32))[lin]
    return jnp.take(x, row, axis=dim, mode="clip")


# --- one lowering per transition kind (placements/_transitions.py) ------------------------------
def _all_gather(step: Step, g: Geometry, x, lin, axes):
    a = step.src.dim
    # (check_vma=False here: C.all_gather is the varying all-gather, whose transpose sums every copy's
    # cotangent, as jax.grad through a DTensor needs.)
    y = C.all_gather(x, axis=a, tiled=True, group=axes) if g.k > 1 else x
    return _compact(y, a, g.gather(a), lin)


def _all_to_all(step: Step, g: Geometry, x, lin, axes):
    a, b = step.src.dim, step.dst.dim
    x = _compact(x, b, g.split(b), lin)
    y = C.all_to_all(x, b, a, group=axes) if g.k > 1 else x
    return _compact(y, a, g.gather(a), lin)


def _fill_identity(step: Step, g: Geometry, x, lin, axes):
    a = step.src.dim
    return _compact(x, a, g.local(a, fill_missing=True), lin, fill=op_identity(step.dst.reduce_op, x.dtype))


def _slice(step: Step, g: Geometry, x, lin, axes):
    b = step.dst.dim
    return _compact(x, b, g.local(b, fill_missing=False), lin)


def _partition(step: Step, g: Geometry, x, lin, axes):
    op = step.dst.reduce_op
    if op in ("avg", "max", "min") or g.k == 1:
        return x
    keep = jnp.asarray(g.first)[lin]
    return jnp.where(keep, x, jnp.asarray(op_identity(op, x.dtype), x.dtype))


def _all_reduce(step: Step, g: Geometry, x, lin, axes):
    return C.all_reduce(x, step.src.reduce_op, group=axes) if g.k > 1 else x


def _reduce_scatter(step: Step, g: Geometry, x, lin, axes):
    b = step.dst.dim
    x = _compact(x, b, g.split(b), lin)
    return C.reduce_scatter(x, step.src.reduce_op, scatter_dim=b, group=axes) if g.k > 1 else x


LOWERINGS = {f.__name__[1:]: f for f in (
    _all_gather, _all_to_all, _fill_identity, _slice, _partition, _all_reduce, _reduce_scatter
)}  # by Step.lowering


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """The per-device body of a plan: each step's lowering, in order."""

    plan: Plan
    names: tuple[str, ...]

    def __call__(self, x):
        plan = self.plan
        mesh_shape = plan.mesh_shape
        if math.prod(plan.global_shape) == 0:  # zero elements: no collective can (or needs to) run
            return jnp.zeros(padded_local_shape(plan.global_shape, mesh_shape, plan.dst), x.dtype)
        strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
        lin = sum(lax.axis_index(n) * s for n, s in zip(self.names, strides)) if mesh_shape else 0
        for step in plan.steps:
            g = geometry(step, mesh_shape, plan.global_shape)
            axes = tuple(self.names[d] for d in step.mesh_dims)
            x = LOWERINGS[step.lowering](step, g, x, lin, axes)
        return x


def build_program(mesh, plan: Plan):
    """The jitted program ``storage -> storage`` that runs ``plan`` on ``mesh`` (not cached:
    ``_dispatch.py`` holds the one cache)."""
    return block_program(mesh.jax_mesh, _RunPlan(plan, mesh.mesh_dim_names))
