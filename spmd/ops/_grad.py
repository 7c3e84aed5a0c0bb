"""Gradients of functions of DTensors, with torch autograd's gradient placements.

``jax.grad`` differentiates a DTensor through its storage (``spmd/tensor/_storage.py``).
A ``Replicate`` value is stored once, so its gradient is one value, already reduced
as torch's autograd reduces it (one all-reduce where it met varying blocks), and a
``Shard`` block's gradient is its shard's: for inputs placed ``Shard`` / ``Replicate``,
``jax.grad``'s DTensor is torch's gradient, placements included. A ``Partial`` value
is one independent block per rank, and every block's gradient is the whole gradient:
torch labels it ``Replicate``, which :func:`grad` / :func:`value_and_grad` (and
:func:`placed_gradient` for ``jax.grad``'s result) do, without communication.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from placements import Partial, Replicate
from spmd._program import block_program
from spmd.tensor import _dispatch
from spmd.tensor._ops_exec import is_dtensor
from spmd.tensor._storage import spec

__all__ = ["grad", "value_and_grad", "placed_gradient"]


def placed_gradient(g, primal):
    """``g`` (``jax.grad``'s cotangent of DTensor ``primal``) as a DTensor with torch's gradient
    placements: ``Shard`` and ``Replicate`` kept, ``Partial`` mesh dims ``Replicate`` (every block
    already holds the whole gradient: a relabel, no communication)."""
    if not (is_dtensor(g) and is_dtensor(primal)):
        raise TypeError(
            f"placed_gradient: g={g!r} and primal={primal!r} must both be DTensors: pass jax.grad's result for a "
            "DTensor argument and that argument."
        )
    pl = primal.placements
    if not any(isinstance(p, Partial) for p in pl):
        return g
    mesh = g.device_mesh
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in pl)
    (leaf,) = jax.tree_util.tree_leaves(g)
    key = ("placed_gradient", pl, target)
    keep = _dispatch.lookup(mesh, key)
    if keep is None:  # the equal blocks of the Partial dims, stored once (trusted: check_vma=False)
        keep = block_program(mesh.jax_mesh, lambda b: b, specs=(spec(mesh, pl), spec(mesh, target)))
        _dispatch.remember(mesh, key, keep)
    return type(g).tree_unflatten((mesh, target, tuple(g.shape)), (keep(leaf),))


def _fix(grads, primals):
    return jax.tree_util.tree_map(
        lambda g, p: placed_gradient(g, p) if is_dtensor(p) else g, grads, primals, is_leaf=is_dtensor
    )


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` whose DTensor gradients carry torch's gradient placements."""
    vg = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        if isinstance(argnums, int):
            return value, _fix(grads, args[argnums])
        return value, tuple(_fix(g, args[i]) for g, i in zip(grads, argnums))

    return wrapped


def grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``jax.grad`` whose DTensor gradients carry torch's gradient placements (see the module doc)."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any):
        (value, grads) = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
