"""torch.distributed's collectives on this process's tensor.

Each function takes this rank's tensor (a jax.Array, a NumPy array, anything
``np.asarray`` takes) and RETURNS the result: JAX arrays are immutable, so
where torch writes into its argument, write ``t = dist.all_reduce(t)``.
Functions that fill a Python list in torch (``all_gather``, ``gather``,
``all_to_all``) fill it too, and return it.

Every collective is one jitted ``jax.shard_map`` over a 1-D mesh of the
group's ranks (each rank's first device), whose body calls the functional
collectives of :mod:`spmd._collectives`; this rank's tensor becomes its block
of a global array (``jax.make_array_from_single_device_arrays``). Programs are
cached per (group, collective, options); JAX caches per shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from placements import ReduceOp, as_reduce_op
from spmd import _collectives as C
from spmd._debug import record
from spmd._x64 import exact_array, x64_for
from spmd.distributed._errors import PeerError
from spmd.distributed._groups import Group, group_of, peer_rank
from spmd.distributed._state import state

__all__ = [
    "Work",
    "P2POp",
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
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "rank_devices",
]

_AXIS = "ranks"


# --- plumbing ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _devices_by_rank(world: int, multiprocess: bool) -> tuple:
    if not multiprocess:
        return (jax.local_devices()[0],)
    by: dict[int, list] = {}
    for d in jax.devices():
        by.setdefault(d.process_index, []).append(d)
    return tuple(min(by[p], key=lambda d: d.id) for p in range(world))


def rank_devices() -> tuple:
    """The device each rank's c10d collectives run on (its first device), by rank."""
    st = state("rank_devices")
    return _devices_by_rank(st.world_size, st.multiprocess)


@functools.lru_cache(maxsize=512)
def _program(devices: tuple, name: str, kwargs: tuple, scalar_in: bool):
    """(mesh, jitted program, info). The global array is the ranks' blocks concatenated on
    dim 0, so this rank's tensor is its block as it is (no copy, no reshape); a scalar
    travels as shape (1,). ``info[(shape, dtype)]`` says, once traced, whether the
    result is a scalar (it then travels as shape (1,) too)."""
    mesh = Mesh(np.array(devices, dtype=object), (_AXIS,))
    fn = getattr(C, name)
    kw = dict(kwargs)
    info: dict = {}

    def body(block):
        r = fn(block.reshape(()) if scalar_in else block, group=_AXIS, **kw)
        info[(tuple(block.shape), block.dtype)] = r.ndim == 0
        return r.reshape((1,)) if r.ndim == 0 else r

    spec = P(_AXIS)
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)), info


def _as_array(x: Any, where: str, arg: str) -> jax.Array:
    if isinstance(x, jax.Array):
        return x
    try:
        return exact_array(x)  # int64 / float64 keep their dtype and value (spmd/_x64.py)
    except Exception:
        raise TypeError(f"{where}: {arg}={x!r} must be an array (jax, NumPy, or anything np.asarray takes).") from None


def _run_on(ranks: Sequence[int], name: str, x: jax.Array, **kwargs) -> jax.Array:
    """Run collective ``name`` over ``ranks`` with this rank's block ``x``; this rank's result."""
    with x64_for(x):  # a 64-bit block runs in JAX's x64 mode (spmd/_x64.py); a no-op otherwise
        return _run_on_x(ranks, name, x, **kwargs)


def _run_on_x(ranks: Sequence[int], name: str, x: jax.Array, **kwargs) -> jax.Array:
    st = state(name)
    devs = rank_devices()
    scalar = x.ndim == 0
    mesh, fn, info = _program(tuple(devs[r] for r in ranks), name, tuple(sorted(kwargs.items())), scalar)
    me = list(ranks).index(st.rank)
    block = x.reshape((1,)) if scalar else x
    local = jax.device_put(block, mesh.devices[me])
    gshape = (len(ranks) * block.shape[0],) + tuple(block.shape[1:])
    garr = jax.make_array_from_single_device_arrays(gshape, NamedSharding(mesh, P(_AXIS)), [local])
    record(name, fn, garr)
    try:
        out = fn(garr).block_until_ready()
    except Exception as e:
        if not st.multiprocess:
            raise
        raise PeerError(
            f"{name}: the collective failed on rank {st.rank} (group ranks {list(ranks)}); another rank most "
            f"likely died or left the job (see its output): {e}"
        ) from e
    data = out.addressable_shards[0].data
    return data.reshape(()) if info.get((tuple(block.shape), block.dtype)) else data


def _run(g: Group, name: str, x: jax.Array, **kwargs) -> jax.Array:
    return _run_on(g.global_ranks(), name, x, **kwargs)


def _stack(items: Any, n: int, where: str, arg: str) -> jax.Array:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{where}: {arg}={items!r} must be a list of {n} arrays, one per rank of the group.")
    if len(items) != n:
        raise ValueError(f"{where}: {arg} holds {len(items)} array(s); the group has {n} ranks, give one per rank.")
    arrs = [_as_array(t, where, f"{arg}[{i}]") for i, t in enumerate(items)]
    shapes = {(a.shape, a.dtype) for a in arrs}
    if len(shapes) != 1:
        raise ValueError(
            f"{where}: the arrays of {arg} have different shapes/dtypes {sorted(map(str, shapes))}; "
            "they must all match (pad them to one shape)."
        )
    with x64_for(*arrs):
        return jnp.stack(arrs)


def _fill(target: Any, values: list) -> list:
    """torch fills the caller's list: do it too when it is a list, and return the values."""
    if isinstance(target, list) and len(target) == len(values):
        target[:] = values
        return target
    return values


@dataclasses.dataclass
class Work:
    """What ``async_op=True``, ``isend``/``irecv`` and ``batch_isend_irecv`` return.

    ``wait()`` runs whatever is still pending and returns True; ``result()`` is
    ``[tensor]`` (the received tensor for a recv, the collective's result for an
    async collective); ``tensor`` is the same tensor.
    """

    tensor: Any = None
    _pending: bool = False

    def wait(self, timeout: Any = None) -> bool:
        if self._pending:
            _flush_p2p()
        return True

    def is_completed(self) -> bool:
        return not self._pending

    def result(self) -> list:
        self.wait()
        return [self.tensor]

    def get_future(self):
        """A ``torch.futures.Future``-like handle: ``.wait()`` / ``.value()`` give ``result()``."""
        from spmd.distributed._future import Future

        return Future.of_work(self)


def _maybe_async(result: Any, async_op: bool) -> Any:
    return Work(result) if async_op else result


# --- collectives ------------------------------------------------------------------------------
def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """Reduce every rank's ``tensor`` with ``op``; returns the result on every rank."""
    where = "all_reduce"
    g = group_of(group, where)
    x = _as_array(tensor, where, "tensor")
    return _maybe_async(_run(g, "all_reduce", x, op=as_reduce_op(op, where=f"{where}: op")), async_op)


def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False, group_src: int | None = None):
    """Every rank gets rank ``src``'s ``tensor`` (``src`` is a global rank; ``group_src`` a group rank)."""
    where = "broadcast"
    g = group_of(group, where)
    s = peer_rank(g, src, group_src, where, "src")
    x = _as_array(tensor, where, "tensor")
    return _maybe_async(_run(g, "broadcast", x, src=s), async_op)


def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False):
    """Every rank gets every rank's ``tensor``: a list indexed by group rank (``tensor_list``
    is filled if it is a list of the group's size; it may also be None)."""
    where = "all_gather"
    g = group_of(group, where)
    x = _as_array(tensor, where, "tensor")
    if tensor_list is not None and not isinstance(tensor_list, list):
        raise TypeError(f"{where}: tensor_list={tensor_list!r} must be a list (or None).")
    if isinstance(tensor_list, list) and tensor_list and len(tensor_list) != g.size():
        raise ValueError(f"{where}: tensor_list holds {len(tensor_list)} entries; the group has {g.size()} ranks.")
    out = _run(g, "all_gather", x, axis=0, tiled=False)
    return _maybe_async(_fill(tensor_list, [out[i] for i in range(g.size())]), async_op)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False):
    """Every rank's ``input_tensor`` concatenated along dim 0 (or stacked, when ``output_tensor``
    has shape ``(group size, *input.shape)``); ``output_tensor`` may be None."""
    where = "all_gather_into_tensor"
    g = group_of(group, where)
    x = _as_array(input_tensor, where, "input_tensor")
    n = g.size()
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
    return _maybe_async(_run(g, "all_gather", x, axis=0, tiled=not stacked), async_op)


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, group_dst: int | None = None):
    """Rank ``dst`` gets the reduction; the other ranks get their ``tensor`` back (as torch)."""
    where = "reduce"
    g = group_of(group, where)
    d = peer_rank(g, dst, group_dst, where, "dst")
    x = _as_array(tensor, where, "tensor")
    return _maybe_async(_run(g, "reduce", x, dst=d, op=as_reduce_op(op, where=f"{where}: op")), async_op)


def scatter(tensor: Any, scatter_list: Any = None, src: int | None = None, group: Any = None, async_op: bool = False, group_src: int | None = None):
    """Rank ``i`` gets ``scatter_list[i]`` of rank ``src``; returns it.

    On the other ranks ``scatter_list`` is None and ``tensor`` (torch's output
    tensor) gives the shape and dtype; on ``src`` it may be None.
    """
    where = "scatter"
    g = group_of(group, where)
    s = peer_rank(g, 0 if src is None and group_src is None else src, group_src, where, "src")
    n = g.size()
    if g.rank() == s:
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
        t = _as_array(tensor, where, "tensor")
        with x64_for(t):
            x = jnp.zeros((n,) + tuple(t.shape), t.dtype)
    return _maybe_async(_run(g, "scatter", x, src=s), async_op)


def gather(tensor: Any, gather_list: Any = None, dst: int | None = None, group: Any = None, async_op: bool = False, group_dst: int | None = None):
    """Rank ``dst`` gets every rank's ``tensor`` as a list by group rank; the others get None."""
    where = "gather"
    g = group_of(group, where)
    d = peer_rank(g, 0 if dst is None and group_dst is None else dst, group_dst, where, "dst")
    x = _as_array(tensor, where, "tensor")
    out = _run(g, "gather", x, dst=d)
    if g.rank() != d:
        return _maybe_async(None, async_op)
    return _maybe_async(_fill(gather_list, [out[i] for i in range(g.size())]), async_op)


def reduce_scatter(output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """Rank ``i`` gets the reduction over ranks of their ``input_list[i]``; returns it."""
    where = "reduce_scatter"
    g = group_of(group, where)
    x = _stack(input_list, g.size(), where, "input_list")
    out = _run(g, "reduce_scatter", x, op=as_reduce_op(op, where=f"{where}: op"), scatter_dim=0)
    return _maybe_async(out[0], async_op)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False):  # noqa: A002
    """Reduce ``input`` over ranks and give rank ``i`` the ``i``-th chunk of dim 0."""
    where = "reduce_scatter_tensor"
    g = group_of(group, where)
    x = _as_array(input, where, "input")
    n = g.size()
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"{where}: input has shape {tuple(x.shape)}; its dim 0 must be a multiple of the group size {n}."
        )
    return _maybe_async(_run(g, "reduce_scatter", x, op=as_reduce_op(op, where=f"{where}: op"), scatter_dim=0), async_op)


def all_to_all(output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False):
    """Rank ``i`` sends ``input_tensor_list[j]`` to rank ``j``; returns what each rank sent it, by rank."""
    where = "all_to_all"
    g = group_of(group, where)
    n = g.size()
    x = _stack(input_tensor_list, n, where, "input_tensor_list")
    out = _run(g, "all_to_all", x, split_axis=0, concat_axis=0)
    return _maybe_async(_fill(output_tensor_list, [out[i] for i in range(n)]), async_op)


def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, group: Any = None, async_op: bool = False):  # noqa: A002
    """Cut ``input``'s dim 0 into group-size equal chunks, send chunk ``j`` to rank ``j``,
    concatenate what arrives in rank order. Uneven split sizes are refused."""
    where = "all_to_all_single"
    g = group_of(group, where)
    x = _as_array(input, where, "input")
    n = g.size()
    for arg, sizes in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if sizes is not None and (len(sizes) != n or len(set(sizes)) > 1):
            raise ValueError(
                f"{where}: {arg}={list(sizes)!r} is uneven; XLA's all-to-all cuts equal chunks (a ragged "
                "all-to-all does not run on CPU); pad every chunk to the largest size, or pass None."
            )
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(f"{where}: input has shape {tuple(x.shape)}; its dim 0 must be a multiple of the group size {n}.")
    return _maybe_async(_run(g, "all_to_all", x, split_axis=0, concat_axis=0), async_op)


# --- point to point ---------------------------------------------------------------------------
@dataclasses.dataclass
class _P2P:
    send: bool
    peer: int  # global rank
    array: jax.Array
    work: Work


_PENDING: list[_P2P] = []


def _exchange(src: int, dst: int, x: jax.Array) -> jax.Array:
    """One program over ranks {src, dst}: ``dst`` gets ``src``'s ``x``."""
    pair = tuple(sorted((src, dst)))
    return _run_on(pair, "permute", x, pairs=((pair.index(src), pair.index(dst)),))


def _flush_p2p() -> None:
    """Run the pending sends/recvs in one global order, (sender, receiver, issue order):
    every rank sorts its own the same way, so the smallest pending pair always finds
    both ends ready and the batch never deadlocks."""
    me = state("batch_isend_irecv").rank
    ops = list(_PENDING)
    _PENDING.clear()
    keyed = sorted(
        enumerate(ops), key=lambda io: ((me, io[1].peer) if io[1].send else (io[1].peer, me), io[0])
    )
    for _, op in keyed:
        src, dst = (me, op.peer) if op.send else (op.peer, me)
        out = _exchange(src, dst, op.array)
        op.work.tensor = None if op.send else out
        op.work._pending = False


def _p2p(send_: bool, tensor: Any, peer: Any, group: Any, group_peer: Any, where: str) -> _P2P:
    g = group_of(group, where)
    arg = "dst" if send_ else "src"
    if peer is None and group_peer is None:
        raise ValueError(f"{where}: {arg}= is required ({'recv from any rank' if not send_ else 'a destination'} cannot be expressed as an XLA program).")
    p = g.global_ranks()[peer_rank(g, peer, group_peer, where, arg)]
    me = state(where).rank
    if p == me:
        raise ValueError(f"{where}: {arg}={p} is this rank; send to / receive from another rank.")
    x = _as_array(tensor, where, "tensor")
    if not send_:
        with x64_for(x):
            x = jnp.zeros(x.shape, x.dtype)
    return _P2P(send_, p, x, Work(None, True))


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None) -> Work:
    """Queue a send of ``tensor`` to ``dst``; runs at the first ``wait()`` (with every op queued)."""
    op = _p2p(True, tensor, dst, group, group_dst, "isend")
    _PENDING.append(op)
    return op.work


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None) -> Work:
    """Queue a receive from ``src`` of an array shaped like ``tensor``; ``work.wait()`` then
    ``work.tensor`` (or ``work.result()[0]``) is what arrived."""
    op = _p2p(False, tensor, src, group, group_src, "irecv")
    _PENDING.append(op)
    return op.work


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst``, which calls ``recv`` (blocks until both ends meet)."""
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None) -> jax.Array:
    """Receive from rank ``src`` an array shaped like ``tensor``; RETURNS it (torch returns
    the sender's rank and writes into ``tensor``)."""
    w = irecv(tensor, src, group, tag, group_src)
    w.wait()
    return w.tensor


@dataclasses.dataclass(frozen=True)
class P2POp:
    """One op of :func:`batch_isend_irecv`: ``P2POp(dist.isend, tensor, peer)`` or ``P2POp(dist.irecv, ...)``."""

    op: Callable
    tensor: Any
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self):
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp: op={self.op!r} must be dist.isend or dist.irecv.")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Run a batch of sends and receives; returns one completed :class:`Work` per op (a recv's
    ``work.tensor`` is what arrived). Every rank of a matching pair must take part."""
    where = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise TypeError(f"{where}: p2p_op_list={p2p_op_list!r} must be a list of dist.P2POp.")
    works = [p.op(p.tensor, p.peer, p.group, p.tag, **({"group_dst": p.group_peer} if p.op is isend else {"group_src": p.group_peer})) for p in p2p_op_list]
    _flush_p2p()
    return works

