"""Point to point: ``send`` / ``recv``, ``isend`` / ``irecv`` and ``batch_isend_irecv``.

Each transfer is one program over the pair of ranks (a collective permute).
Queued ops run at the first ``wait()``, all of this rank's pending ops in one
global order, (sender, receiver, issue order): every rank sorts its own the
same way, so the smallest pending pair always finds both ends ready and a ring
never deadlocks. A receive writes into its tensor when that is a writable
buffer (NumPy, CPU torch), as torch does, and returns it either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from spmd.distributed import _mpi_ops
from spmd.distributed._groups import group_of, peer_of
from spmd.distributed._run import as_array, run_on, zeros
from spmd.distributed._state import state
from spmd.distributed._work import Work, write_into

__all__ = ["P2POp", "send", "recv", "isend", "irecv", "batch_isend_irecv"]


@dataclasses.dataclass
class _P2P:
    send: bool
    peer: int  # global rank
    array: jax.Array
    target: Any  # the caller's tensor (a recv writes into it when it can)
    work: Work


_PENDING: list[_P2P] = []


def _exchange(src: int, dst: int, x: jax.Array, where: str, into: Any = None) -> Any:
    """One program over ranks {src, dst}: ``dst`` gets ``src``'s ``x`` (in ``into`` when it can)."""
    pair = tuple(sorted((src, dst)))
    return run_on(pair, "permute", x, where=where, into=into, pairs=((pair.index(src), pair.index(dst)),))


def _flush() -> None:
    me = state("batch_isend_irecv").rank
    ops = list(_PENDING)
    _PENDING.clear()
    keyed = sorted(enumerate(ops), key=lambda io: ((me, io[1].peer) if io[1].send else (io[1].peer, me), io[0]))
    for _, op in keyed:
        src, dst = (me, op.peer) if op.send else (op.peer, me)
        out = _exchange(src, dst, op.array, "send/recv", None if op.send else op.target)
        if not op.send and out is not op.target:
            write_into(op.target, out)
        op.work.tensor = None if op.send else out
        op.work._flush = None


def _p2p(send_: bool, tensor: Any, peer: Any, group: Any, group_peer: Any, where: str) -> _P2P | None:
    g = group_of(group, where)
    if g is None:
        return None
    arg = "dst" if send_ else "src"
    if peer is None and group_peer is None:
        raise ValueError(f"{where}: {arg}= is required ({'recv from any rank' if not send_ else 'a destination'} cannot be expressed as an XLA program).")
    p = peer_of(g, peer, group_peer, where, arg)
    x = as_array(tensor, where, "tensor")
    if not send_:
        x = zeros(x.shape, x.dtype)
    return _P2P(send_, p, x, tensor, Work(None, _flush))


def _queue(op: _P2P | None, tag: int = 0, where: str = "send/recv") -> Work | None:
    if op is None:
        return None
    st = state(where)
    if st.backend.name == "mpi" and st.multiprocess:  # started now: MPI_Isend / MPI_Irecv
        return _mpi_ops.start_p2p(op.send, op.array, op.target, op.peer, tag, where)
    _PENDING.append(op)
    return op.work


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None) -> Work | None:
    """Queue a send of ``tensor`` to ``dst``; runs at the first ``wait()`` (with every op queued)."""
    return _queue(_p2p(True, tensor, dst, group, group_dst, "isend"), tag, "isend")


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None) -> Work | None:
    """Queue a receive from ``src`` of an array shaped like ``tensor``; ``work.wait()`` then
    ``work.tensor`` (or ``work.result()[0]``) is what arrived (also written into ``tensor``
    when it is a writable NumPy array / CPU torch tensor)."""
    return _queue(_p2p(False, tensor, src, group, group_src, "irecv"), tag, "irecv")


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst``, which calls ``recv`` (blocks until both ends meet)."""
    w = isend(tensor, dst, group, tag, group_dst)
    if w is not None:
        w.wait()


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None) -> jax.Array | None:
    """Receive from rank ``src`` an array shaped like ``tensor``; RETURNS it and writes it into
    ``tensor`` when that is writable (torch returns the sender's rank)."""
    w = irecv(tensor, src, group, tag, group_src)
    if w is None:
        return None
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
    _flush()
    for w in works:  # MPI's requests (the XLA path's ran in _flush)
        if w is not None:
            w.wait()
    return works
