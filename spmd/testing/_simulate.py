"""A NumPy simulator of a redistribute plan, for tests and property checks.

It runs a plan on a NumPy storage array (``spmd/tensor/_storage.py``'s layout) with the
same index tables as the jitted program (``spmd/tensor/_tables.py``) and NumPy
stand-ins for the collectives: one function per transition lowering
(``placements/_transitions.py``), as ``spmd/tensor/_lower.py`` has one JAX
function per lowering. Tests check it against the real program block for block.
"""

from __future__ import annotations

import math

import numpy as np

from placements import padded_local_shape
from placements._plan import Plan, Step
from spmd.tensor._storage import extents, np_block, op_identity, stored_once
from spmd.tensor._tables import Geometry, coords, geometry

__all__ = ["simulate_plan", "np_storage", "SIMULATIONS"]


def _compact(x, dim, table, dev, fill=0):
    row = table[dev]
    idx = np.where(row < 0, 0, row)
    if x.shape[dim]:
        y = np.take(x, idx, axis=dim)
    else:
        y = np.zeros(x.shape[:dim] + (len(row),) + x.shape[dim + 1 :], x.dtype)
    shape = [1] * x.ndim
    shape[dim] = len(row)
    return np.where((row >= 0).reshape(shape), y, np.asarray(fill, x.dtype)).astype(x.dtype)


def _reduce(vals, op):
    stack = np.stack(vals)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if op == "avg" and stack.dtype.kind == "f" and stack.dtype.itemsize < 4:  # pre-divided (spmd/_reduce.py)
        return (stack.astype(np.float32) / len(vals)).astype(stack.dtype).sum(0, dtype=stack.dtype)
    if op == "avg":
        return (stack.sum(0, dtype=stack.dtype) / len(vals)).astype(stack.dtype)
    if op == "product":
        return stack.prod(0, dtype=stack.dtype)
    return stack.max(0) if op == "max" else stack.min(0)


def _chunk(x, dim, r, size):
    return np.take(x, range(r * size, (r + 1) * size), axis=dim)


# --- one NumPy stand-in per lowering (xs: every device's block, by linear index) ---------------
def _all_gather(step: Step, g: Geometry, xs):
    a = step.src.dim
    tab = g.gather(a)
    return [_compact(np.concatenate([xs[m] for m in g.members[d]], axis=a), a, tab, d) for d in range(len(xs))]


def _all_to_all(step: Step, g: Geometry, xs):
    a, b = step.src.dim, step.dst.dim
    tb, ta = g.split(b), g.gather(a)
    pre = [_compact(xs[d], b, tb, d) for d in range(len(xs))]
    out = []
    for d in range(len(xs)):
        r = g.members[d].index(d)
        out.append(_compact(np.concatenate([_chunk(pre[m], b, r, g.sa[b]) for m in g.members[d]], axis=a), a, ta, d))
    return out


def _fill_identity(step: Step, g: Geometry, xs):
    a = step.src.dim
    tab = g.local(a, fill_missing=True)
    fill = op_identity(step.dst.reduce_op, xs[0].dtype)
    return [_compact(xs[d], a, tab, d, fill=fill) for d in range(len(xs))]


def _slice(step: Step, g: Geometry, xs):
    b = step.dst.dim
    tab = g.local(b, fill_missing=False)
    return [_compact(xs[d], b, tab, d) for d in range(len(xs))]


def _partition(step: Step, g: Geometry, xs):
    op = step.dst.reduce_op
    if op not in ("sum", "product"):
        return xs
    fill = op_identity(op, xs[0].dtype)
    return [xs[d] if g.first[d] else np.full_like(xs[d], fill) for d in range(len(xs))]


def _all_reduce(step: Step, g: Geometry, xs):
    return [_reduce([xs[m] for m in g.members[d]], step.src.reduce_op) for d in range(len(xs))]


def _reduce_scatter(step: Step, g: Geometry, xs):
    b = step.dst.dim
    tb = g.split(b)
    pre = [_compact(xs[d], b, tb, d) for d in range(len(xs))]
    out = []
    for d in range(len(xs)):
        red = _reduce([pre[m] for m in g.members[d]], step.src.reduce_op)
        out.append(_chunk(red, b, g.members[d].index(d), g.sa[b]))
    return out


SIMULATIONS = {f.__name__[1:]: f for f in (
    _all_gather, _all_to_all, _fill_identity, _slice, _partition, _all_reduce, _reduce_scatter
)}  # by Step.lowering


def _stored(every: np.ndarray, mesh_shape, placements) -> np.ndarray:
    """Every device's block (``mesh_shape + block``) as storage: one block where stored once."""
    once = stored_once(mesh_shape, placements)
    return every[tuple(slice(0, 1) if o else slice(None) for o in once)]


def simulate_plan(plan: Plan, physical: np.ndarray) -> np.ndarray:
    """Run ``plan`` on a NumPy storage array (``spmd/tensor/_storage.py``'s layout) with the same
    tables as the jitted program and NumPy stand-ins for the collectives."""
    mesh_shape = tuple(plan.mesh_shape)
    gs = plan.global_shape
    if math.prod(gs) == 0:
        return np.zeros(extents(mesh_shape, plan.dst) + padded_local_shape(gs, mesh_shape, plan.dst), physical.dtype)
    every = np.broadcast_to(physical, mesh_shape + physical.shape[len(mesh_shape):])
    xs = [np.asarray(every[c]) for c in coords(mesh_shape)]
    for step in plan.steps:
        xs = SIMULATIONS[step.lowering](step, geometry(step, mesh_shape, gs), xs)
    return _stored(np.stack(xs).reshape(mesh_shape + xs[0].shape), mesh_shape, plan.dst)


def np_storage(x: np.ndarray, mesh_shape, placements) -> np.ndarray:
    """The storage of a global NumPy ``x`` placed by ``placements`` (Partial as ``R -> P``)."""
    mesh_shape = tuple(mesh_shape)
    blocks = [np_block(x, x.shape, mesh_shape, placements, c) for c in coords(mesh_shape)]
    every = np.stack(blocks).reshape(mesh_shape + padded_local_shape(x.shape, mesh_shape, placements))
    return _stored(every, mesh_shape, placements)
