"""Token dispatch to experts cut over a mesh dim, and the combine back (two all-to-alls per layer)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spmd._collectives import all_to_all
from spmd._groups import group_axes

__all__ = ["ExpertDispatch", "expert_capacity", "expert_dispatch", "expert_combine", "expert_places"]

from spmd.parallel.styles._experts import CPU_DROPLESS as _CPU_DROPLESS


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """How many of a routing group's ``tokens`` one expert takes:
    ``min(tokens, max(1, ceil(capacity_factor * tokens * top_k / num_experts)))``.

    ``capacity_factor=1`` gives each expert its even share of the group's ``tokens * top_k`` assignments;
    ``capacity_factor=num_experts / top_k`` gives every expert room for every token (nothing dropped).
    """
    where = "expert_capacity"
    for name, v in (("tokens", tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {name}={v!r} must be an int >= 1.")
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k={top_k!r} is more than num_experts={num_experts!r}; "
                         "a token picks top_k distinct experts.")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"{where}: capacity_factor={capacity_factor!r} must be a number > 0 (1.25 is usual).")
    return min(tokens, max(1, math.ceil(capacity_factor * tokens * top_k / num_experts)))


class ExpertDispatch(NamedTuple):
    """Where ``expert_dispatch`` put each of this rank's ``(token, choice)`` assignments, for
    ``expert_combine``: ``experts`` and ``slots`` ``[g, t, k]`` (the expert, and the place in its queue:
    the group's capacity where dropped), ``kept`` ``[g, t, k]`` (False: over capacity, dropped) and
    ``dropped``, this rank's count of dropped assignments (``all_reduce`` it over the token dims for the
    total)."""

    experts: Any
    slots: Any
    kept: Any
    dropped: Any


def _check(where: str, x, experts, num_experts) -> None:
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"{where}: x has shape {getattr(x, 'shape', None)!r}; it must be [groups, tokens, d] "
                         "(a routing group is one sequence: pass the [b, t, d] activations).")
    shape = getattr(experts, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(f"{where}: experts has shape {shape!r}; it must be [groups, tokens, top_k] with "
                         f"groups, tokens = {tuple(x.shape[:2])!r} as x's (the router's top-k indices).")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise TypeError(f"{where}: experts has dtype {experts.dtype}; it must hold integer expert indices "
                        "(jax.lax.top_k's second result).")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"{where}: num_experts={num_experts!r} must be an int >= 1.")


def expert_places(experts, num_experts: int):
    """Each ``(token, choice)`` assignment's place in its expert's queue, ``[g, t, k]`` from the router's top-k
    ``experts`` ``[g, t, k]``: every token's first choice first, in sequence order, then every second choice,
    and so on (GShard / Switch). A place at or past the capacity is a drop."""
    g, t, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)              # [g, t, k, E]
    order = onehot.transpose(0, 2, 1, 3).reshape(g, k * t, num_experts)
    place = (jnp.cumsum(order, axis=1) - 1).reshape(g, k, t, num_experts).transpose(0, 2, 1, 3)
    return (place * onehot).sum(-1)                                             # [g, t, k]


def expert_dispatch(x, experts, *, num_experts: int, capacity_factor: float = 1.25, group: Any = "ep",
                    dropless: bool = False):
    """Send this rank's routed tokens to the ranks holding their experts (one ``all_to_all``).

    Inside an SPMD region where the experts dim is cut over ``group`` (``ep`` ranks, ``E / ep`` experts
    each, expert ``e`` on rank ``e // (E / ep)``) and the tokens are this rank's own. ``x`` ``[g, t, d]``:
    ``g`` routing groups (sequences) of ``t`` tokens; ``experts`` ``[g, t, k]``: each token's ``top_k``
    experts. Each expert takes at most ``expert_capacity(t, E, k, capacity_factor)`` tokens of a group
    (first choices first, each in sequence order); the rest are dropped: ``expert_combine`` gives them
    zero, and the residual carries the token.

    Returns ``(buffers, dispatch)``: ``buffers`` ``[E / ep, ep * g * capacity, d]`` (the tokens of this
    rank's experts, from every rank of the group in rank order, zero where a place is empty) and an
    ``ExpertDispatch`` for ``expert_combine``. ``dropless=True`` (no capacity, ``ragged_all_to_all``) is
    refused: on CPU it cannot run; elsewhere it is not written yet.
    """
    where = "expert_dispatch"
    if dropless:
        if jax.default_backend() == "cpu":
            raise NotImplementedError(
                f"{where}: dropless=True needs lax.ragged_all_to_all, and {_CPU_DROPLESS} "
                f"(capacity_factor=num_experts / top_k drops nothing, with padding).")
        raise NotImplementedError(
            f"{where}: dropless=True (ragged_all_to_all) is not implemented; use a capacity factor "
            "(capacity_factor=num_experts / top_k drops nothing, with padding).")
    _check(where, x, experts, num_experts)
    axes, ep = group_axes(group, where)
    if num_experts % ep:
        raise ValueError(f"{where}: num_experts={num_experts!r} does not divide over group={group!r} of "
                         f"{ep} ranks; each rank holds num_experts / {ep} experts: use a multiple of {ep}.")
    g, t, d = x.shape
    k = experts.shape[-1]
    cap = expert_capacity(t, num_experts, k, capacity_factor)
    place = expert_places(experts, num_experts)
    kept = place < cap
    slots = jnp.where(kept, place, cap)
    # send buffer [E, g * cap, d]; a dropped assignment's index falls outside it and is not written
    flat = jnp.where(kept, (experts * g + jnp.arange(g)[:, None, None]) * cap + slots, num_experts * g * cap)
    src = jnp.broadcast_to(x[:, :, None, :], (g, t, k, d)).reshape(-1, d)
    send = jnp.zeros((num_experts * g * cap, d), x.dtype).at[flat.reshape(-1)].add(src, mode="drop")
    send = send.reshape(num_experts, g * cap, d)
    buffers = all_to_all(send, split_axis=0, concat_axis=1, group=axes)         # [E/ep, ep*g*cap, d]
    return buffers, ExpertDispatch(experts, slots, kept, (~kept).sum(dtype=jnp.int32))


def expert_combine(y, dispatch: ExpertDispatch, weights, *, group: Any = "ep"):
    """Send the experts' outputs back to their tokens' ranks (one ``all_to_all``) and sum them by weight.

    ``y`` ``[E / ep, ep * g * capacity, d]``: the local experts' outputs on ``expert_dispatch``'s buffers;
    ``dispatch``: its ``ExpertDispatch``; ``weights`` ``[g, t, k]``: the router's weights of each token's
    experts. Returns ``[g, t, d]``: ``sum_k weights * expert output``, zero for dropped assignments.
    """
    where = "expert_combine"
    if not isinstance(dispatch, ExpertDispatch):
        raise TypeError(f"expert_combine: dispatch={type(dispatch).__name__} must be the ExpertDispatch that "
                        "expert_dispatch returned with the buffers.")
    g, t, k = dispatch.experts.shape
    if getattr(weights, "shape", None) != (g, t, k):
        raise ValueError(f"{where}: weights has shape {getattr(weights, 'shape', None)!r}; it must be "
                         f"{(g, t, k)!r}, the router's weight of each token's top_k experts.")
    axes, ep = group_axes(group, where)
    if getattr(y, "ndim", None) != 3 or y.shape[1] % (ep * g):
        raise ValueError(f"{where}: y has shape {getattr(y, 'shape', None)!r}; it must be the shape of "
                         "expert_dispatch's buffers, [E / ep, ep * groups * capacity, d].")
    d = y.shape[-1]
    back = all_to_all(y, split_axis=1, concat_axis=0, group=axes)                # [E, g*cap, d]
    cap = back.shape[1] // g
    flat = (dispatch.experts * g + jnp.arange(g)[:, None, None]) * cap + jnp.minimum(dispatch.slots, cap - 1)
    out = back.reshape(-1, d)[flat.reshape(-1)].reshape(g, t, k, d)
    w = jnp.where(dispatch.kept, weights, 0).astype(y.dtype)
    return jnp.einsum("gtkd,gtk->gtd", out, w)
