"""torch.distributed's tensor collectives on this process's tensor.

Each function takes this rank's tensor (a jax.Array, a NumPy array, a CPU torch
tensor, anything ``np.asarray`` takes) and RETURNS the result; where torch
writes into its argument, the result is also written there when the argument
is a writable buffer (NumPy, CPU torch: see :mod:`spmd.distributed._work`), so
``dist.all_reduce(t)`` works as in torch for those, and ``t = dist.all_reduce(t)``
works for every input. Functions that fill a Python list in torch
(``all_gather``, ``gather``, ``all_to_all``) fill it too, and return it.

A rank that is not a member of ``group`` gets a warning and None, as in torch.
How one collective runs (compiled once per shape and dtype, bounded by the
timeout, checked across ranks on request): :mod:`spmd.distributed._run`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from placements import ReduceOp, as_reduce_op
from spmd.distributed import _mpi_ops
from spmd.distributed._mpi_fast import FAST
from spmd.distributed._groups import Group, members_only, peer_rank
from spmd.distributed._run import as_array, run_on, stack, zeros
from spmd.distributed._state import state
from spmd.distributed._work import Work, deliver, maybe_async, write_into

__all__ = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "scatter",
    "gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
]


def _run(g: Group, name: str, where: str, x: jax.Array, into: Any = None, async_op: bool = False, **kwargs):
    """This rank's result; on mpi with ``async_op`` a :class:`Work` holding the MPI request instead
    (its ``wait()`` completes the call; :func:`_then` adds a step after it)."""
    st = state(where)
    if st.backend.name == "mpi" and st.multiprocess:  # one MPI call (spmd/distributed/_mpi_ops.py)
        return _mpi_ops.run_on(g.global_ranks(), name, x, where=where, into=into, async_op=async_op, **kwargs)
    return run_on(g.global_ranks(), name, x, where=where, into=into, **kwargs)


def _then(out: Any, fn: Any, async_op: bool) -> Any:
    """``fn(out)``, as a Work with ``async_op``; ``fn`` runs at ``wait()`` when ``out`` is MPI's pending Work."""
    if isinstance(out, Work):
        return _mpi_ops.then(out, fn)
    return maybe_async(fn(out), async_op)


def _stack(items: Any, n: int, where: str, arg: str) -> jax.Array:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{where}: {arg}={items!r} must be a list of {n} arrays, one per rank of the group.")
    if len(items) != n:
        raise ValueError(f"{where}: {arg} holds {len(items)} array(s); the group has {n} ranks, give one per rank.")
    arrs = [as_array(t, where, f"{arg}[{i}]") for i, t in enumerate(items)]
    shapes = {(a.shape, a.dtype) for a in arrs}
    if len(shapes) != 1:
        raise ValueError(
            f"{where}: the arrays of {arg} have different shapes/dtypes {sorted(map(str, shapes))}; "
            "they must all match (pad them to one shape)."
        )
    return stack(arrs)


def _fill(target: Any, values: list) -> list:
    """torch fills the caller's list: do it too when it is a list (writing into its writable
    buffers, replacing the other entries), and return the values."""
    if isinstance(target, list) and len(target) == len(values):
        for i, v in enumerate(values):
            if not write_into(target[i], v):
                target[i] = v
        return target
    return values


# --- collectives ------------------------------------------------------------------------------
@members_only(fast=FAST["all_reduce"])
def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """Reduce every rank's ``tensor`` with ``op``; returns the result on every rank."""
    where = "all_reduce"
    x = as_array(tensor, where, "tensor")
    out = _run(group, "all_reduce", where, x, into=tensor, async_op=async_op, op=as_reduce_op(op, where=f"{where}: op"))
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(tensor, out, where, "tensor"), async_op)


@members_only(fast=FAST["broadcast"])
def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False, group_src: int | None = None):
    """Every rank gets rank ``src``'s ``tensor`` (``src`` is a global rank; ``group_src`` a group rank)."""
    where = "broadcast"
    s = peer_rank(group, src, group_src, where, "src")
    x = as_array(tensor, where, "tensor")
    out = _run(group, "broadcast", where, x, into=tensor, async_op=async_op, src=s)
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(tensor, out, where, "tensor"), async_op)


@members_only
def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False):
    """Every rank gets every rank's ``tensor``: a list indexed by group rank (``tensor_list``
    is filled if it is a list of the group's size; it may also be None)."""
    where = "all_gather"
    x = as_array(tensor, where, "tensor")
    if tensor_list is not None and not isinstance(tensor_list, list):
        raise TypeError(f"{where}: tensor_list={tensor_list!r} must be a list (or None).")
    if isinstance(tensor_list, list) and tensor_list and len(tensor_list) != group.size():
        raise ValueError(f"{where}: tensor_list holds {len(tensor_list)} entries; the group has {group.size()} ranks.")
    out = _run(group, "all_gather", where, x, async_op=async_op, axis=0, tiled=False)
    return _then(out, lambda o: _fill(tensor_list, [o[i] for i in range(group.size())]), async_op)


@members_only(fast=FAST["all_gather_into_tensor"])
def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False):
    """Every rank's ``input_tensor`` concatenated along dim 0 (or stacked, when ``output_tensor``
    has shape ``(group size, *input.shape)``); ``output_tensor`` may be None."""
    where = "all_gather_into_tensor"
    x = as_array(input_tensor, where, "input_tensor")
    n = group.size()
    stacked = False
    if output_tensor is not None:
        out_shape = tuple(np.shape(output_tensor))
        cat_shape = (n * x.shape[0],) + tuple(x.shape[1:]) if x.ndim else None
        if out_shape == (n,) + tuple(x.shape):
            stacked = True
        elif out_shape != cat_shape:
            raise ValueError(
                f"{where}: output_tensor has shape {out_shape}; for an input of shape {tuple(x.shape)} on "
                f"{n} ranks it must be {cat_shape} (concatenated) or {(n,) + tuple(x.shape)} (stacked)."
            )
    if x.ndim == 0:
        stacked = True
    out = _run(group, "all_gather", where, x, into=output_tensor, async_op=async_op, axis=0, tiled=not stacked)
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(output_tensor, out, where, "output_tensor"), async_op)


@members_only
def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, group_dst: int | None = None):
    """Rank ``dst`` gets the reduction; the other ranks get their ``tensor`` back (as torch)."""
    where = "reduce"
    d = peer_rank(group, dst, group_dst, where, "dst")
    x = as_array(tensor, where, "tensor")
    out = _run(group, "reduce", where, x, into=tensor, async_op=async_op, dst=d, op=as_reduce_op(op, where=f"{where}: op"))
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(tensor, out, where, "tensor"), async_op)


@members_only
def scatter(tensor: Any, scatter_list: Any = None, src: int | None = None, group: Any = None, async_op: bool = False, group_src: int | None = None):
    """Rank ``i`` gets ``scatter_list[i]`` of rank ``src``; returns it.

    On the other ranks ``scatter_list`` is None and ``tensor`` (torch's output
    tensor) gives the shape and dtype; on ``src`` it may be None.
    """
    where = "scatter"
    s = peer_rank(group, 0 if src is None and group_src is None else src, group_src, where, "src")
    n = group.size()
    if group.rank() == s:
        x = _stack(scatter_list, n, where, "scatter_list")
        if tensor is not None and tuple(np.shape(tensor)) != tuple(x.shape[1:]):
            raise ValueError(
                f"{where}: tensor has shape {tuple(np.shape(tensor))} but scatter_list's arrays have shape "
                f"{tuple(x.shape[1:])}; they must match."
            )
    else:
        if scatter_list is not None:
            raise ValueError(f"{where}: scatter_list is given on rank {state(where).rank}, which is not src; pass None.")
        if tensor is None:
            raise ValueError(f"{where}: tensor is None on a rank that receives; pass an array of the piece's shape and dtype.")
        t = as_array(tensor, where, "tensor")
        x = zeros((n,) + tuple(t.shape), t.dtype)
    out = _run(group, "scatter", where, x, into=tensor, async_op=async_op, src=s)
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(tensor, out, where, "tensor"), async_op)


@members_only
def gather(tensor: Any, gather_list: Any = None, dst: int | None = None, group: Any = None, async_op: bool = False, group_dst: int | None = None):
    """Rank ``dst`` gets every rank's ``tensor`` as a list by group rank; the others get ``[]``."""
    where = "gather"
    d = peer_rank(group, 0 if dst is None and group_dst is None else dst, group_dst, where, "dst")
    x = as_array(tensor, where, "tensor")
    out = _run(group, "gather", where, x, async_op=async_op, dst=d)
    if group.rank() != d:
        return _then(out, lambda o: [], async_op)  # as torch: only dst gets the list
    return _then(out, lambda o: _fill(gather_list, [o[i] for i in range(group.size())]), async_op)


@members_only
def reduce_scatter(output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """Rank ``i`` gets the reduction over ranks of their ``input_list[i]``; returns it."""
    where = "reduce_scatter"
    x = _stack(input_list, group.size(), where, "input_list")
    out = _run(group, "reduce_scatter", where, x, async_op=async_op, op=as_reduce_op(op, where=f"{where}: op"),
               scatter_dim=0)
    if isinstance(out, Work):
        return _mpi_ops.then(out, lambda o: output if write_into(output, o[0]) else o[0])
    return maybe_async(deliver(output, out[0], where, "output"), async_op)


@members_only(fast=FAST["reduce_scatter_tensor"])
def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):  # noqa: A002
    """Reduce ``input`` over ranks and give rank ``i`` the ``i``-th chunk of dim 0."""
    where = "reduce_scatter_tensor"
    x = as_array(input, where, "input")
    n = group.size()
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"{where}: input has shape {tuple(x.shape)}; its dim 0 must be a multiple of the group size {n}."
        )
    out = _run(group, "reduce_scatter", where, x, into=output, async_op=async_op, op=as_reduce_op(op, where=f"{where}: op"),
               scatter_dim=0)
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(output, out, where, "output"), async_op)


@members_only
def all_to_all(output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False):
    """Rank ``i`` sends ``input_tensor_list[j]`` to rank ``j``; returns what each rank sent it, by rank."""
    where = "all_to_all"
    n = group.size()
    x = _stack(input_tensor_list, n, where, "input_tensor_list")
    out = _run(group, "all_to_all", where, x, async_op=async_op, split_axis=0, concat_axis=0)
    return _then(out, lambda o: _fill(output_tensor_list, [o[i] for i in range(n)]), async_op)


@members_only(fast=FAST["all_to_all_single"])
def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, group: Any = None, async_op: bool = False):  # noqa: A002
    """Cut ``input``'s dim 0 into group-size equal chunks, send chunk ``j`` to rank ``j``,
    concatenate what arrives in rank order. Uneven split sizes are refused."""
    where = "all_to_all_single"
    x = as_array(input, where, "input")
    n = group.size()
    for arg, sizes in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if sizes is not None and (len(sizes) != n or len(set(sizes)) > 1):
            raise ValueError(
                f"{where}: {arg}={list(sizes)!r} is uneven; XLA's all-to-all cuts equal chunks (a ragged "
                "all-to-all does not run on CPU); pad every chunk to the largest size, or pass None."
            )
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(f"{where}: input has shape {tuple(x.shape)}; its dim 0 must be a multiple of the group size {n}.")
    out = _run(group, "all_to_all", where, x, into=output, async_op=async_op, split_axis=0, concat_axis=0)
    if isinstance(out, Work):
        return out
    return maybe_async(deliver(output, out, where, "output"), async_op)
