"""The eager collectives' fast path on ``backend="mpi"``: a repeated call is one cached MPI call.

A training loop calls the same collective on the same buffer again and again
(``dist.all_reduce(grad)``). The first call of each (collective, group, op,
src, dtype, shape) takes the full path (:mod:`spmd.distributed._c10d` ->
:mod:`spmd.distributed._mpi_ops`): it resolves the group, checks the arguments
and the op, and on a group's first call compares the ranks' signatures.
When it ran as one plain MPI call into the caller's buffer (a writable,
C-contiguous NumPy array; an op that needs no step before or after the
transfer), what it resolved is kept here: the communicator, the MPI op, the
root, the group's call counter, the call's :class:`~spmd.distributed._guard.Spec`.
The next call with the same arguments is then that MPI call alone, under the
same timeout guard (the watchdog's mark is a ``(spec, seq, start)`` tuple,
made into a :class:`~spmd.distributed._guard.Call` only when the call is slow),
numbered in the group's sequence as the full path numbers it, and (with
``check_collectives``) after the same ``MPI_Allgather`` of the call's
fingerprint as the full path's (:mod:`spmd.distributed._fingerprint`).

Nothing is cached, and every call takes the full path, when the cross-rank
check runs on every call (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), inside a
``CommDebugMode`` (which counts calls), for ``async_op=True``, for anything but
a NumPy array, or after the process group changed (the cache belongs to one
``init_process_group``). The cache is keyed by the identity of the ``op`` and
``group`` objects (kept alive by their entry) and bounded.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from placements import ReduceOp, as_reduce_op
from spmd import _debug
from spmd.distributed import _fingerprint, _guard, _mpi, _state
from spmd.distributed._errors import PeerError
from spmd.distributed._groups import group_of, peer_rank

__all__ = ["FAST"]

_DIRECT = frozenset("bBhHiIlLqQfdFD")  # dtypes mpi4py takes as they are; others move as bytes
_MAX_ENTRIES = 512
_ENTRIES: dict[tuple, "_Entry"] = {}
_FOR: Any = None  # the State the entries belong to (None: no fast path now)
_ACTIVE = _debug._ACTIVE
_ND = np.ndarray
_TORCH: Any = None  # torch.Tensor, once a call saw one (torch is never imported here)
_monotonic = time.monotonic


class _Entry:
    """One cached call: its spec, the group's counter, the watchdog, the bound MPI method, the MPI op,
    the root (MPI_IN_PLACE for all_reduce), whether the buffers go as they are, and the key's objects;
    with ``check_collectives``, the call's fingerprint, the buffer of the group's and the bound gather."""

    __slots__ = ("spec", "counter", "wd", "run", "mop", "root", "direct", "keep", "fp", "seen", "gather")

    def __init__(self, spec, wd, comm, name: str, mop=None, root: Any = 0, direct: bool = True, keep=(),
                 checked: bool = True):
        self.spec, self.wd, self.counter = spec, wd, wd.counter(spec.ranks)
        self.run = getattr(comm, name)
        self.mop, self.root, self.direct, self.keep = mop, root, direct, keep
        self.fp = _fingerprint.fingerprint(spec.where, spec.opts, spec.shape, spec.dtype) if checked else None
        self.seen = np.empty(len(spec.ranks) * _fingerprint.WIDTH, np.int32)
        self.gather = comm.Allgather


def _guarded(e: _Entry, *args: Any) -> None:
    """``e``'s MPI call on ``args``, numbered in its group's sequence, under the timeout guard (after the
    group's fingerprints of the call agree, with ``check_collectives``)."""
    wd = e.wd
    wd.active = mark = (e.spec, next(e.counter), _monotonic())
    try:
        fp = e.fp
        if fp is not None:
            fp[1] = mark[1] & 0x7FFF_FFFF  # the call number (_fingerprint.set_seq, inlined)
            e.gather(fp, e.seen)
            if e.seen.tobytes() != fp.tobytes() * len(e.spec.ranks):
                call = _guard.as_call(mark)
                _fingerprint.check(e.seen, fp, len(call.ranks), call.where, call.ranks, call.group, _FOR.rank)
        e.run(*args)
    except _mpi.MPI.Exception as err:
        raise PeerError(_guard.broken_message(_FOR, _guard.as_call(mark), err)) from err
    finally:
        wd.active = None
        if wd.published is mark:
            wd.unpublish(mark)


def _view(x: Any) -> np.ndarray | None:
    """The NumPy view of a plain CPU torch tensor (not a view of another, no grad), else None."""
    if type(x) is not _TORCH or x.requires_grad or x._base is not None:
        return None
    try:
        return x.numpy()  # raises for a tensor not in CPU memory, and for bfloat16 (the full path's)
    except (TypeError, RuntimeError):
        return None


def _buffer(x: Any) -> np.ndarray | None:
    """What the fast path calls MPI on for ``x``: a NumPy array itself, a torch tensor's view (noted)."""
    global _TORCH
    if type(x) is _ND:
        return x
    if _TORCH is None and type(x).__name__ == "Tensor" and type(x).__module__.startswith("torch"):
        _TORCH = type(x)
    return _view(x)


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _usable() -> Any:
    """The state when cached calls may be made for it (the entries reset for a new state)."""
    global _FOR
    st = _state._STATE
    if st is not _FOR:
        _ENTRIES.clear()
        ok = st is not None and st.backend.name == "mpi" and st.multiprocess and not st.check_calls
        _FOR = st if ok else None
    if _FOR is None or _guard.watchdog_of(st) is None:
        return None
    return st


def _learn(st: Any, key: tuple, ranks: tuple, opts: dict, x: np.ndarray, name: str, keep: tuple, **kw) -> None:
    """Keep the call of ``key`` (its collective first) on the group of ``ranks``: MPI method ``name`` on ``x``."""
    spec = _guard.Spec(key[0], ranks, _guard.opts_of(opts), x.shape, x.dtype, st.world_size, st.timeout_s)
    if len(_ENTRIES) >= _MAX_ENTRIES:
        _ENTRIES.clear()
    _ENTRIES[key] = _Entry(spec, _guard.watchdog_of(st), _mpi.comm(ranks), name, keep=keep,
                           checked=st.check_collectives, **kw)


def _reduction(op: Any, dtype: np.dtype, n: int, where: str):
    """The MPI op of ``op`` on ``dtype`` when it needs no step before or after the transfer, else None."""
    from spmd.distributed._mpi_plan import _plan

    rop = as_reduce_op(op, where=f"{where}: op")
    pre, mop, post = _plan(rop, dtype, n, where)
    return (rop, mop) if pre is None and post is None else (rop, None)


# --- all_reduce -------------------------------------------------------------------------------------
def _all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    b = tensor if type(tensor) is _ND else _view(tensor)
    if b is None or async_op or _state._STATE is not _FOR or _ACTIVE.get():
        return NotImplemented
    e = _ENTRIES.get(("all_reduce", b.dtype, b.shape, id(op), id(group)))
    if e is None:
        return NotImplemented
    f = b.flags
    if not (f.writeable and f.c_contiguous):
        return NotImplemented
    _guarded(e, e.root, b, e.mop)  # root: MPI_IN_PLACE
    return tensor


def _all_reduce_learn(out, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    b = None if out is not tensor or async_op else _buffer(tensor)
    st = None if b is None else _usable()
    if st is None:
        return
    ranks = group_of(group, "all_reduce", non_member="allow").global_ranks()
    rop, mop = _reduction(op, b.dtype, len(ranks), "all_reduce")
    if mop is not None:
        _learn(st, ("all_reduce", b.dtype, b.shape, id(op), id(group)), ranks, {"op": rop},
               b, "Allreduce", (op, group), mop=mop, root=_mpi.MPI.IN_PLACE)


# --- broadcast --------------------------------------------------------------------------------------
def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    b = tensor if type(tensor) is _ND else _view(tensor)
    if b is None or async_op or _state._STATE is not _FOR or _ACTIVE.get():
        return NotImplemented
    if not (type(src) is int or src is None) or not (type(group_src) is int or group_src is None):
        return NotImplemented  # the full path says what is wrong with them
    e = _ENTRIES.get(("broadcast", b.dtype, b.shape, src, group_src, id(group)))
    if e is None:
        return NotImplemented
    f = b.flags
    if not (f.writeable and f.c_contiguous):
        return NotImplemented
    _guarded(e, b if e.direct else _bytes(b), e.root)
    return tensor


def _broadcast_learn(out, tensor, src=None, group=None, async_op=False, group_src=None):
    b = None if out is not tensor or async_op else _buffer(tensor)
    st = None if b is None else _usable()
    if st is None:
        return
    g = group_of(group, "broadcast", non_member="allow")
    root = peer_rank(g, src, group_src, "broadcast", "src")
    _learn(st, ("broadcast", b.dtype, b.shape, src, group_src, id(group)), g.global_ranks(), {"src": root},
           b, "Bcast", (group,), root=root, direct=b.dtype.char in _DIRECT)


# --- output <- input: all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single ---------------
def _pair(name: str, output, input, op, group, async_op):  # noqa: A002
    """The cached call of ``name`` from ``input`` into ``output``, or NotImplemented."""
    result = output
    if output is input or async_op or _state._STATE is not _FOR or _ACTIVE.get():
        return NotImplemented
    if type(output) is not _ND or type(input) is not _ND:  # torch tensors: neither a view of another
        output = output if type(output) is _ND else _view(output)
        input = input if type(input) is _ND else _view(input)
        if output is None or input is None:
            return NotImplemented
    e = _ENTRIES.get((name, output.dtype, output.shape, input.dtype, input.shape, id(op), id(group)))
    if e is None:
        return NotImplemented
    f = output.flags
    if not (f.writeable and f.c_contiguous and input.flags.c_contiguous):
        return NotImplemented
    base = output.base
    if type(result) is _ND and base is not None and (base is input or base is input.base):  # aliased: full path
        return NotImplemented
    if e.mop is not None:
        _guarded(e, input, output, e.mop)
    elif e.direct:
        _guarded(e, input, output)
    else:
        _guarded(e, _bytes(input), _bytes(output))
    return result


def _pair_learn(name: str, out, output, input, op, group, async_op) -> None:  # noqa: A002
    if out is not output or output is input or async_op:
        return
    output, input = _buffer(output), _buffer(input)
    st = None if output is None or input is None or input.ndim == 0 else _usable()
    if st is None:
        return
    ranks = group_of(group, name, non_member="allow").global_ranks()
    n = len(ranks)
    key = (name, output.dtype, output.shape, input.dtype, input.shape, id(op), id(group))
    direct = input.dtype.char in _DIRECT
    if name == "all_gather_into_tensor":
        tiled = output.shape != (n,) + input.shape
        _learn(st, key, ranks, {"axis": 0, "tiled": tiled}, input, "Allgather", (op, group), direct=direct)
    elif name == "reduce_scatter_tensor":
        rop, mop = _reduction(op, input.dtype, n, name)
        if mop is not None:
            _learn(st, key, ranks, {"op": rop, "scatter_dim": 0}, input, "Reduce_scatter_block", (op, group), mop=mop)
    else:
        _learn(st, key, ranks, {"split_axis": 0, "concat_axis": 0}, input, "Alltoall", (op, group), direct=direct)


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _pair("all_gather_into_tensor", output_tensor, input_tensor, None, group, async_op)


def _all_gather_into_tensor_learn(out, output_tensor, input_tensor, group=None, async_op=False):
    _pair_learn("all_gather_into_tensor", out, output_tensor, input_tensor, None, group, async_op)


def _reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    return _pair("reduce_scatter_tensor", output, input, op, group, async_op)


def _reduce_scatter_tensor_learn(out, output, input, op=ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    _pair_learn("reduce_scatter_tensor", out, output, input, op, group, async_op)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                       async_op=False):
    if output_split_sizes is not None or input_split_sizes is not None:
        return NotImplemented
    return _pair("all_to_all_single", output, input, None, group, async_op)


def _all_to_all_single_learn(out, output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                             async_op=False):
    if output_split_sizes is None and input_split_sizes is None:
        _pair_learn("all_to_all_single", out, output, input, None, group, async_op)


# (try the cached call: its result or NotImplemented; after a full call: keep what it resolved), by collective
FAST = {
    "all_reduce": (_all_reduce, _all_reduce_learn),
    "broadcast": (_broadcast, _broadcast_learn),
    "all_gather_into_tensor": (_all_gather_into_tensor, _all_gather_into_tensor_learn),
    "reduce_scatter_tensor": (_reduce_scatter_tensor, _reduce_scatter_tensor_learn),
    "all_to_all_single": (_all_to_all_single, _all_to_all_single_learn),
}
