"""The eager collectives and point-to-point transfers of ``backend="mpi"``: one MPI call each.

:func:`run_on` takes the same (ranks, collective, this rank's block, options)
as the XLA path (:func:`spmd.distributed._run.run_on`) and gives the same
result, with the same semantics as on gloo (``spmd/_reduce.py``):

* the op is checked before any communication (:func:`spmd._reduce.check_op`:
  the same TypeError / ValueError as on gloo, on the rank that made it);
* AVG divides the sum by the group size (floats narrower than float32 are
  pre-divided, as NCCL does), PREMUL_SUM multiplies before summing (in float32
  at least, rounded once);
* MAX / MIN of floats propagate NaN: the float's bits are mapped to integers
  of the same width in float order, NaN beyond +-inf, and reduced as integers
  (the same bytes, MPI's own integer MAX / MIN); bools reduce as torch's
  (SUM -> or, PRODUCT -> and);
* 64-bit dtypes are MPI's own (exact); float16 / bfloat16 sums run in float32
  and round once; data movement (broadcast, gathers, scatter, all-to-all,
  send / recv) moves bytes, bit for bit, for every dtype.

A writable, C-contiguous NumPy array or CPU torch tensor of the result's shape
and dtype (``into``) receives the result directly (``MPI_IN_PLACE`` for
all_reduce / broadcast): no copy, as torch. Every call runs under
:mod:`spmd.distributed._guard`, as on gloo: bounded by the timeout on every
rank, checked across ranks on a group's first call and with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd import _debug
from spmd._x64 import exact_array
from spmd.distributed import _guard, _mpi
from spmd.distributed._errors import PEER_EXIT_CODE, PeerError, absent_line, fail
from spmd.distributed._state import state
from spmd.distributed._work import Work, write_into

__all__ = ["run_on", "start_p2p"]

from spmd.distributed._mpi_plan import _bytes, _host, _plan, _prepare, _same_memory, _target


def _all_reduce(c, x, into, op, where):
    send, mop, back = _prepare(x, op, c.Get_size(), where)
    buf = _target(into, x.shape, x.dtype)
    if back is None and buf is not None:
        if not _same_memory(send, buf):
            np.copyto(buf, send)
        c.Allreduce(_mpi.MPI.IN_PLACE, buf, mop)
        return into
    out = np.empty_like(send)
    c.Allreduce(send, out, mop)
    return out if back is None else back(out)


def _reduce(c, x, into, op, dst, where):
    send, mop, back = _prepare(x, op, c.Get_size(), where)
    if c.Get_rank() != dst:
        c.Reduce(send, None, mop, root=dst)
        return x  # as torch: the other ranks keep their tensor
    out = np.empty_like(send)
    c.Reduce(send, out, mop, root=dst)
    return out if back is None else back(out)


def _broadcast(c, x, into, src):
    buf = _target(into, x.shape, x.dtype)
    if buf is None:
        out = x.copy() if c.Get_rank() != src else x
        c.Bcast(_bytes(out), root=src)
        return out
    if c.Get_rank() == src and not _same_memory(buf, x):
        np.copyto(buf, x)
    c.Bcast(_bytes(buf), root=src)
    return into


def _all_gather(c, x, into, tiled):
    n = c.Get_size()
    shape = ((n * x.shape[0],) + x.shape[1:]) if tiled else (n,) + x.shape
    out = _target(into, shape, x.dtype)
    result = into if out is not None else None
    if out is None:
        out = np.empty(shape, x.dtype)
    c.Allgather(_bytes(x), _bytes(out))
    return out if result is None else result


def _gather(c, x, dst):
    n = c.Get_size()
    if c.Get_rank() != dst:
        c.Gather(_bytes(x), None, root=dst)
        return x
    out = np.empty((n,) + x.shape, x.dtype)
    c.Gather(_bytes(x), _bytes(out), root=dst)
    return out


def _scatter(c, x, into, src):
    shape = x.shape[1:]
    out = _target(into, shape, x.dtype)
    result = into if out is not None else None
    if out is None:
        out = np.empty(shape, x.dtype)
    c.Scatter(_bytes(x) if c.Get_rank() == src else None, _bytes(out), root=src)
    return out if result is None else result


def _reduce_scatter(c, x, into, op, where):
    n = c.Get_size()
    send, mop, back = _prepare(x, op, n, where)
    shape = (x.shape[0] // n,) + x.shape[1:]
    buf = _target(into, shape, x.dtype) if back is None else None
    if buf is not None and not _same_memory(buf, send):
        c.Reduce_scatter_block(send, buf, mop)
        return into
    out = np.empty(shape, send.dtype)
    c.Reduce_scatter_block(send, out, mop)
    return out if back is None else back(out)


def _all_to_all(c, x, into):
    out = _target(into, x.shape, x.dtype)
    if out is None or _same_memory(out, x):
        out = np.empty_like(x)
        c.Alltoall(_bytes(x), _bytes(out))
        return out
    c.Alltoall(_bytes(x), _bytes(out))
    return into


_DISPATCH = {
    "all_reduce": lambda c, a, into, kw, where: _all_reduce(c, a, into, kw["op"], where),
    "broadcast": lambda c, a, into, kw, where: _broadcast(c, a, into, kw["src"]),
    "all_gather": lambda c, a, into, kw, where: _all_gather(c, a, into, kw.get("tiled", False)),
    "reduce": lambda c, a, into, kw, where: _reduce(c, a, into, kw["op"], kw["dst"], where),
    "scatter": lambda c, a, into, kw, where: _scatter(c, a, into, kw["src"]),
    "gather": lambda c, a, into, kw, where: _gather(c, a, kw["dst"]),
    "reduce_scatter": lambda c, a, into, kw, where: _reduce_scatter(c, a, into, kw["op"], where),
    "all_to_all": lambda c, a, into, kw, where: _all_to_all(c, a, into),
}

# CommDebugMode's kinds (HLO names) for the MPI calls: what the same call counts on gloo.
_KIND = {"all_reduce": "all-reduce", "reduce": "all-reduce", "broadcast": "all-reduce", "all_gather": "all-gather",
         "gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all",
         "scatter": "all-to-all", "permute": "collective-permute"}


def _record(where: str, name: str, nbytes: int) -> None:
    """Count one MPI call in the active ``CommDebugMode``s (one context-variable read otherwise)."""
    modes = _debug._ACTIVE.get()
    for mode in modes:
        kind_ = _KIND[name]
        mode._counts[kind_] += 1
        mode._bytes[kind_] += nbytes
        mode.log.append((where, kind_, 1, nbytes))


def _check_options(name: str, x: np.ndarray, kwargs: dict, n: int, where: str) -> None:
    """What the XLA path would refuse at compile time, refused before communicating."""
    if name in ("all_reduce", "reduce", "reduce_scatter"):
        _plan(kwargs.get("op"), x.dtype, n, where)
    if name in ("reduce_scatter", "all_to_all") and (x.ndim == 0 or x.shape[0] % n):
        raise ValueError(f"{where}: input has shape {tuple(x.shape)}; its dim 0 must be a multiple of the group size {n}.")


def _start(c, name: str, a: np.ndarray, into: Any, kw: dict, where: str):
    """The non-blocking MPI call of ``name`` writing straight into the caller's buffer ``into`` (a request),
    or None where the result needs a step after the transfer (AVG, MAX of floats, a new buffer...)."""
    M = _mpi.MPI
    n = c.Get_size()
    if name in ("all_reduce", "reduce_scatter"):
        pre, mop, post = _plan(kw["op"], a.dtype, n, where)
        if pre is not None or post is not None:
            return None
        if name == "all_reduce":
            buf = _target(into, a.shape, a.dtype)
            if buf is None:
                return None
            if not _same_memory(a, buf):
                np.copyto(buf, a)
            return c.Iallreduce(M.IN_PLACE, buf, mop)
        buf = _target(into, (a.shape[0] // n,) + a.shape[1:], a.dtype)
        return None if buf is None else c.Ireduce_scatter_block(a, buf, mop)
    if name == "reduce":
        pre, mop, post = _plan(kw["op"], a.dtype, n, where)
        if pre is not None or post is not None:
            return None
        if c.Get_rank() != kw["dst"]:
            return c.Ireduce(a, None, mop, root=kw["dst"])  # as torch: this rank keeps its tensor
        buf = _target(into, a.shape, a.dtype)
        if buf is None:
            return None
        if not _same_memory(a, buf):
            np.copyto(buf, a)
        return c.Ireduce(M.IN_PLACE, buf, mop, root=kw["dst"])
    if name == "broadcast":
        buf = _target(into, a.shape, a.dtype)
        if buf is None:
            return None
        if c.Get_rank() == kw["src"] and not _same_memory(a, buf):
            np.copyto(buf, a)
        return c.Ibcast(_bytes(buf), root=kw["src"])
    if name == "all_gather":
        shape = ((n * a.shape[0],) + a.shape[1:]) if kw.get("tiled") else (n,) + a.shape
        buf = _target(into, shape, a.dtype)
        return None if buf is None else c.Iallgather(_bytes(a), _bytes(buf))
    if name == "all_to_all":
        buf = _target(into, a.shape, a.dtype)
        return None if buf is None or _same_memory(a, buf) else c.Ialltoall(_bytes(a), _bytes(buf))
    return None


def _pending(st, call: _guard.Call, req, into: Any, where: str) -> Work:
    """A :class:`Work` whose ``wait()`` waits for the MPI request, at most the timeout (then this
    rank ends naming the call, as a blocking collective would)."""
    work = Work(into)

    def finish() -> None:
        try:
            done = _mpi.wait(req, st.timeout_s)
        except _mpi.MPI.Exception as e:
            raise PeerError(_guard.broken_message(st, call, e)) from e
        if not done:
            fail(
                f"{where}: rank {st.rank} waited {st.timeout_s:g} s (the timeout) for {call.describe()} "
                f"({call.signature}, async_op=True) to complete; ranks {[r for r in call.ranks if r != st.rank]} "
                "did not all take part. Every rank of the group must call the same collectives in the same order; "
                "raise the limit with init_process_group(timeout=...) or SPMD_TIMEOUT. Ending this rank now.",
                PEER_EXIT_CODE,
            )
        work._flush = None

    work._flush = finish
    return work


def run_on(ranks: tuple[int, ...], name: str, x: Any, *, where: str | None = None, into: Any = None,
           async_op: bool = False, **kwargs):
    """Run collective ``name`` over global ``ranks`` with this rank's block ``x``; this rank's result
    (``into`` itself when the result was written there; a ``jax.Array`` for a ``jax.Array`` input).
    With ``async_op``, a :class:`Work` holding the MPI request when the call can write straight into
    ``into``; otherwise the call completes here, as on gloo."""
    where = where or name
    st = state(where)
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case, first
        a, is_jax = x, False
    else:
        is_jax, a = isinstance(x, jax.Array), _host(x)
    _check_options(name, a, kwargs, len(ranks), where)
    _record(where, name, a.nbytes)
    call = _guard.enter(st, where, ranks, _guard.opts_of(kwargs), a.shape, a.dtype)
    if async_op and into is not None:
        try:
            req = _start(_mpi.comm(ranks), name, a, into, kwargs, where)
        except _mpi.MPI.Exception as e:
            _guard.leave(call)
            raise PeerError(_guard.broken_message(st, call, e)) from e
        if req is not None:
            _guard.leave(call)  # the Work's wait() is bounded by the timeout itself
            return _pending(st, call, req, into, where)
    try:
        out = _DISPATCH[name](_mpi.comm(ranks), a, into, kwargs, where)
    except _mpi.MPI.Exception as e:
        raise PeerError(_guard.broken_message(st, call, e)) from e
    finally:
        _guard.leave(call)
    if out is into or out is x:
        return out
    if is_jax:
        return exact_array(out)
    return out


# --- point to point -------------------------------------------------------------------------------
def start_p2p(send: bool, array: Any, tensor: Any, peer: int, tag: int, where: str) -> Work:
    """Start an ``MPI_Isend`` of ``array`` / an ``MPI_Irecv`` of an array shaped like it, with ``peer``
    (a global rank); the :class:`Work` waits for it (bounded by the timeout; a receive writes into
    ``tensor``, the caller's, when it is a writable buffer)."""
    st = state(where)
    M = _mpi.MPI
    c = M.COMM_WORLD
    if send:
        a = _host(array)
        req = c.Isend(_bytes(a), dest=peer, tag=tag)
        into = None
    else:
        into = _target(tensor, tuple(array.shape), np.dtype(array.dtype))
        a = into if into is not None else np.empty(array.shape, array.dtype)
        req = c.Irecv(_bytes(a), source=peer, tag=tag)
    work = Work(None)

    def finish() -> None:
        status = M.Status()
        try:
            done = _mpi.wait(req, st.timeout_s, status)
        except M.Exception as e:  # e.g. a longer message than this receive's buffer
            raise PeerError(
                f"{where}: rank {st.rank}'s transfer with rank {peer} (tag {tag}, {a.dtype}{list(a.shape)}) failed: "
                f"{e}. A send and its recv must have the same shape and dtype."
            ) from e
        if not done:
            fail(
                f"{where}: rank {st.rank} waited {st.timeout_s:g} s (the timeout) for rank {peer} to "
                f"{'receive' if send else 'send'} {a.dtype}{list(a.shape)} (tag {tag}); it did not. Every send needs "
                "a matching recv of the same shape and dtype; raise the limit with init_process_group(timeout=...) "
                f"or SPMD_TIMEOUT. Ending this rank now.\n{absent_line([peer])}",
                PEER_EXIT_CODE,
            )
        work._flush = None
        if send:
            return
        if status.Get_count(M.BYTE) != a.nbytes:
            raise PeerError(
                f"{where}: rank {st.rank} received {status.Get_count(M.BYTE)} bytes from rank {peer} (tag {tag}) "
                f"into a buffer of {a.nbytes} bytes ({a.dtype}{list(a.shape)}). A send and its recv must have the "
                "same shape and dtype."
            )
        if into is not None or write_into(tensor, a):
            work.tensor = tensor
        else:
            work.tensor = exact_array(a) if isinstance(tensor, jax.Array) else a

    work._flush = finish
    return work
