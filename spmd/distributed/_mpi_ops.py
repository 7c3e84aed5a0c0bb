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

With ``check_collectives`` (the default) an ``MPI_Allgather`` of every rank's fingerprint of the call
(:mod:`spmd.distributed._fingerprint`, 64 bytes a rank) comes first: where they differ, no data moves
and every rank raises a ValueError naming each rank's call. An ``async_op=True`` call returns before
its peers call, so its fingerprints travel in an ``MPI_Iallgather`` started with it and are compared
at ``wait()``, before the result is given.

A writable, C-contiguous NumPy array or CPU torch tensor of the result's shape
and dtype (``into``) receives the result directly (``MPI_IN_PLACE`` for
all_reduce / broadcast): no copy, as torch. Every call runs under
:mod:`spmd.distributed._guard`, as on gloo: bounded by the timeout on every
rank, checked across ranks on a group's first call and with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

``async_op=True`` is the same call in MPI's non-blocking form (``MPI_Iallreduce``, ``MPI_Iallgather``,
``MPI_Iscatter``, ``MPI_Igather``...), returned as a :class:`Work` once this rank has started it (the
group's first call, and every call under DETAIL, still meets the other ranks first to compare
signatures). Its ``wait()`` waits at most the timeout (then this rank ends, naming the call and the
group), then runs the step after the transfer (AVG's division, MAX / MIN's way back from ordered
integers, a list filled) and writes the result into the caller's buffer.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd import _debug
from spmd._x64 import exact_array
from spmd.distributed import _fingerprint, _guard, _mpi
from spmd.distributed._errors import PEER_EXIT_CODE, PeerError, absent_line, fail
from spmd.distributed._state import state
from spmd.distributed._work import Work, write_into

__all__ = ["run_on", "start_p2p", "then"]

from spmd.distributed._mpi_plan import _bytes, _host, _plan, _prepare, _same_memory, _target


def _call(c, name: str, nb: bool, *args):
    """MPI collective ``name`` on ``c`` (``Allreduce``...); with ``nb`` its non-blocking form (``Iallreduce``...),
    whose request is returned (None for the blocking form: the call is complete)."""
    if nb:
        return getattr(c, "I" + name.lower())(*args)
    getattr(c, name)(*args)
    return None


# Each collective: (the MPI request, or None when complete; what gives the result once it is complete).
def _all_reduce(c, x, into, op, where, nb):
    send, mop, back = _prepare(x, op, c.Get_size(), where)
    buf = _target(into, x.shape, x.dtype)
    if back is None and buf is not None:
        if not _same_memory(send, buf):
            np.copyto(buf, send)
        return _call(c, "Allreduce", nb, _mpi.MPI.IN_PLACE, buf, mop), lambda: into
    out = np.empty_like(send)
    return _call(c, "Allreduce", nb, send, out, mop), lambda: out if back is None else back(out)


def _reduce(c, x, into, op, dst, where, nb):
    send, mop, back = _prepare(x, op, c.Get_size(), where)
    if c.Get_rank() != dst:
        return _call(c, "Reduce", nb, send, None, mop, dst), lambda: x  # as torch: the others keep their tensor
    out = np.empty_like(send)
    return _call(c, "Reduce", nb, send, out, mop, dst), lambda: out if back is None else back(out)


def _broadcast(c, x, into, src, nb):
    buf = _target(into, x.shape, x.dtype)
    if buf is None:
        out = x.copy() if c.Get_rank() != src else x
        return _call(c, "Bcast", nb, _bytes(out), src), lambda: out
    if c.Get_rank() == src and not _same_memory(buf, x):
        np.copyto(buf, x)
    return _call(c, "Bcast", nb, _bytes(buf), src), lambda: into


def _new_or_into(into, shape, dtype):
    """(the buffer an MPI call writes, what gives the result): ``into`` when it can take it, else a new array."""
    buf = _target(into, shape, dtype)
    return (np.empty(shape, dtype), None) if buf is None else (buf, into)


def _all_gather(c, x, into, tiled, nb):
    n = c.Get_size()
    out, result = _new_or_into(into, ((n * x.shape[0],) + x.shape[1:]) if tiled else (n,) + x.shape, x.dtype)
    return _call(c, "Allgather", nb, _bytes(x), _bytes(out)), lambda: out if result is None else result


def _gather(c, x, dst, nb):
    if c.Get_rank() != dst:
        return _call(c, "Gather", nb, _bytes(x), None, dst), lambda: x
    out = np.empty((c.Get_size(),) + x.shape, x.dtype)
    return _call(c, "Gather", nb, _bytes(x), _bytes(out), dst), lambda: out


def _scatter(c, x, into, src, nb):
    out, result = _new_or_into(into, x.shape[1:], x.dtype)
    req = _call(c, "Scatter", nb, _bytes(x) if c.Get_rank() == src else None, _bytes(out), src)
    return req, lambda: out if result is None else result


def _reduce_scatter(c, x, into, op, where, nb):
    n = c.Get_size()
    send, mop, back = _prepare(x, op, n, where)
    shape = (x.shape[0] // n,) + x.shape[1:]
    buf = _target(into, shape, x.dtype) if back is None else None
    if buf is not None and not _same_memory(buf, send):
        return _call(c, "Reduce_scatter_block", nb, send, buf, mop), lambda: into
    out = np.empty(shape, send.dtype)
    return _call(c, "Reduce_scatter_block", nb, send, out, mop), lambda: out if back is None else back(out)


def _all_to_all(c, x, into, nb):
    out = _target(into, x.shape, x.dtype)
    if out is None or _same_memory(out, x):
        out = np.empty_like(x)
        return _call(c, "Alltoall", nb, _bytes(x), _bytes(out)), lambda: out
    return _call(c, "Alltoall", nb, _bytes(x), _bytes(out)), lambda: into


_DISPATCH = {
    "all_reduce": lambda c, a, into, kw, where, nb: _all_reduce(c, a, into, kw["op"], where, nb),
    "broadcast": lambda c, a, into, kw, where, nb: _broadcast(c, a, into, kw["src"], nb),
    "all_gather": lambda c, a, into, kw, where, nb: _all_gather(c, a, into, kw.get("tiled", False), nb),
    "reduce": lambda c, a, into, kw, where, nb: _reduce(c, a, into, kw["op"], kw["dst"], where, nb),
    "scatter": lambda c, a, into, kw, where, nb: _scatter(c, a, into, kw["src"], nb),
    "gather": lambda c, a, into, kw, where, nb: _gather(c, a, kw["dst"], nb),
    "reduce_scatter": lambda c, a, into, kw, where, nb: _reduce_scatter(c, a, into, kw["op"], where, nb),
    "all_to_all": lambda c, a, into, kw, where, nb: _all_to_all(c, a, into, nb),
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


def _pending(st, call: _guard.Call, req, result, where: str, checked=None) -> Work:
    """A :class:`Work` whose ``wait()`` waits for the MPI request, at most the timeout (then this
    rank ends naming the call, as a blocking collective would), then sets its tensor to ``result()``.
    ``checked``: the fingerprints' request and their check, waited for and made first."""
    work = Work(None)

    def finish() -> None:
        try:
            if checked is not None and _mpi.wait(checked[0], st.timeout_s):
                try:
                    checked[1]()  # a ValueError naming each rank's call: the result is not given
                except ValueError:
                    try:  # the transfer started with the call: let it end (briefly) before saying so
                        _mpi.wait(req, min(1.0, st.timeout_s))
                    except _mpi.MPI.Exception:
                        pass
                    raise
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
        work.tensor = result()
        work._flush = None

    work._flush = finish
    return work


def then(work: Work, fn) -> Work:
    """``work`` (from :func:`run_on` with ``async_op``) whose ``wait()`` also turns its result into
    ``fn(result)`` (e.g. fills the caller's list), once."""
    flush = work._flush

    def finish() -> None:
        flush()
        work.tensor = fn(work.tensor)

    work._flush = finish if flush is not None else None
    if flush is None:
        work.tensor = fn(work.tensor)
    return work


def run_on(ranks: tuple[int, ...], name: str, x: Any, *, where: str | None = None, into: Any = None,
           async_op: bool = False, **kwargs):
    """Run collective ``name`` over global ``ranks`` with this rank's block ``x``; this rank's result
    (``into`` itself when the result was written there; a ``jax.Array`` for a ``jax.Array`` input).
    With ``async_op``, a :class:`Work` holding the MPI non-blocking request: its ``wait()`` (bounded by
    the timeout) completes the call, writes the result into ``into`` when it is a writable buffer, and
    sets ``work.tensor`` to what the blocking call would return."""
    where = where or name
    st = state(where)
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case, first
        a, is_jax = x, False
    else:
        is_jax, a = isinstance(x, jax.Array), _host(x)
    _check_options(name, a, kwargs, len(ranks), where)
    _record(where, name, a.nbytes)
    call = _guard.enter(st, where, ranks, _guard.opts_of(kwargs), a.shape, a.dtype)
    c = _mpi.comm(ranks)
    checked = None
    try:
        if st.check_collectives:  # every rank's fingerprint of the call, compared before any data moves
            fp = _fingerprint.set_seq(_fingerprint.fingerprint(where, call.opts, a.shape, a.dtype), call.seq)
            seen = np.empty(len(ranks) * _fingerprint.WIDTH, np.int32)
            if async_op:  # returns before the peers call: compared at wait(), before the result is given
                checked = (c.Iallgather(fp, seen), lambda: _fingerprint.check(seen, fp, len(ranks), where, ranks,
                                                                              call.group, st.rank))
            else:
                c.Allgather(fp, seen)
                _fingerprint.check(seen, fp, len(ranks), where, ranks, call.group, st.rank)
        req, done = _DISPATCH[name](c, a, into, kwargs, where, async_op)
    except _mpi.MPI.Exception as e:
        raise PeerError(_guard.broken_message(st, call, e)) from e
    finally:
        _guard.leave(call)  # an async call's wait() is bounded by the timeout itself
    if async_op:
        return _pending(st, call, req, lambda: _result(done(), x, into, is_jax, True), where, checked)
    return _result(done(), x, into, is_jax, False)


def _result(out, x, into, is_jax: bool, deliver: bool):
    """What the call returns: ``into`` / ``x`` when the result is there; with ``deliver`` (async: no
    caller writes it afterwards) ``into`` once the result is written into it; a jax.Array for a jax input."""
    if out is into or out is x:
        return out
    if deliver and into is not None and write_into(into, out):
        return into
    return exact_array(out) if is_jax else out


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
