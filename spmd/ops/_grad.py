"""Gradients of functions of DTensors, with torch autograd's gradient placements.

``jax.grad`` differentiates a DTensor through its storage, one block per device,
each block an independent variable. That derivative is exact, but it is laid out
as the blocks are used, not as the input's placements say: along a ``Replicate``
mesh dim the copies' gradients *sum* to the gradient (a ``Partial(sum)``), along a
``Partial`` mesh dim every block holds the whole gradient (a ``Replicate``); along a
``Shard`` dim each block is exactly its shard's gradient. :func:`grad` and
:func:`value_and_grad` relabel each DTensor gradient accordingly and reduce it as
torch does: the gradient of a ``Replicate`` input comes back ``Replicate``
(all-reduced over those mesh dims, once, as DDP's gradient all-reduce), of a
``Shard`` input ``Shard``, of a ``Partial`` input ``Replicate``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from placements import Partial, Replicate, Shard
from spmd.tensor._ops_exec import is_dtensor

__all__ = ["grad", "value_and_grad", "placed_gradient"]


def placed_gradient(g, primal):
    """``g`` (``jax.grad``'s cotangent of DTensor ``primal``) as a DTensor with torch's gradient
    placements: ``Shard`` kept, ``Replicate`` and ``Partial`` mesh dims ``Replicate``."""
    if not (is_dtensor(g) and is_dtensor(primal)):
        raise TypeError(
            f"placed_gradient: g={g!r} and primal={primal!r} must both be DTensors: pass jax.grad's result for a "
            "DTensor argument and that argument."
        )
    pl = primal.placements
    meaning = [Partial("sum") if isinstance(p, Replicate) else Replicate() if isinstance(p, Partial) else p for p in pl]
    (leaf,) = jax.tree_util.tree_leaves(g)
    exact = type(g).tree_unflatten((g.device_mesh, tuple(meaning), tuple(g.shape)), (leaf,))
    return exact.redistribute(placements=[p if isinstance(p, Shard) else Replicate() for p in pl])


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
