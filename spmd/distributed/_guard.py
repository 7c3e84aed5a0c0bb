"""Every tensor collective on the multi-process path is bounded and, on request, checked across ranks.

**Timeout (always on).** A watchdog thread per process watches the collective
this rank is in. Once a call has waited half a second it publishes where this
rank is (``spmd/pos/<rank>`` in JAX's coordination service: collective, group,
the group's call number, signature); once it has waited the job's timeout
(``init_process_group(timeout=...)``, else ``SPMD_TIMEOUT``) it reads the
group's positions and ends this rank (exit code ``PEER_EXIT_CODE``) with a
message naming the collective, the group and the ranks that did not arrive
(and where each of them is instead, when it is in another collective). The
fast path costs two attribute writes per call: nothing is sent unless a call
is slow. The cached MPI calls of :mod:`spmd.distributed._mpi_fast` mark the
call with a ``(Spec, seq, start)`` tuple instead of a :class:`Call`: the
watchdog makes the Call from it only for a slow call.

**Cross-rank check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or
``SPMD_DISTRIBUTED_DEBUG=DETAIL``; always for a group's first call).** Before each call every rank publishes
its signature (collective, op, src/dst, dtype, shape, group) and reads the
others', within the timeout; a difference raises ValueError on every rank
naming what differs, a rank missing raises :class:`PeerError` naming it.
Every other call is checked by its fingerprint, which travels with the call
(:mod:`spmd.distributed._fingerprint`, on by default); with that turned off,
ranks that call different collectives or with different dtypes or shapes get
XLA's behaviour (a hang ended by the timeout above, a wrong result, or an
abort). ``benchmarks/multiprocess.py --check-cost`` and ``--fingerprint``
measure what the checks cost.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from typing import Any

from spmd.distributed._errors import PEER_EXIT_CODE, PeerError, absent_line, fail
from spmd.distributed._state import State

__all__ = ["Call", "Spec", "opts_of", "as_call", "enter", "leave", "broken_message", "watchdog_of"]

_TICK_S = 0.1
_PUBLISH_AFTER_S = 0.5
_EARLY_S = 0.5  # a signature read that fails this long before the deadline did not time out


def _group_label(ranks: tuple, world: int) -> str:
    return "Group(WORLD)" if ranks == tuple(range(world)) else f"Group(ranks={list(ranks)})"


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective call of this rank: what, over which ranks, the group's call number.
    Its texts are formatted only when needed (a slow call, a check, an error)."""

    where: str
    ranks: tuple[int, ...]
    seq: int
    opts: tuple
    shape: tuple
    dtype: Any
    world: int
    start: float
    deadline: float

    @functools.cached_property
    def signature(self) -> str:
        parts = [f"{k}={v}" for k, v in self.opts] + [f"dtype={self.dtype}", f"shape={tuple(self.shape)}"]
        return ", ".join(parts)

    @functools.cached_property
    def group(self) -> str:
        return _group_label(self.ranks, self.world)

    def position(self) -> str:
        return f"{self.group}|{self.seq}|{self.where}|{self.signature}"

    def describe(self) -> str:
        return f"{self.where} (call #{self.seq} of {self.group})"


class Spec:
    """What a cached fast-path call (``spmd.distributed._mpi_fast``) repeats: everything of a
    :class:`Call` but its number and start. The fast path marks the call it is in with the tuple
    ``(spec, seq, start)``; the watchdog makes the :class:`Call` from it only when the call is slow."""

    __slots__ = ("where", "ranks", "opts", "shape", "dtype", "world", "timeout_s")

    def __init__(self, where: str, ranks: tuple, opts: tuple, shape: tuple, dtype: Any, world: int, timeout_s: float):
        self.where, self.ranks, self.opts, self.shape = where, ranks, opts, shape
        self.dtype, self.world, self.timeout_s = dtype, world, timeout_s

    def call(self, seq: int, start: float) -> Call:
        return Call(self.where, self.ranks, seq, self.opts, self.shape, self.dtype, self.world, start,
                    start + self.timeout_s)


def as_call(active: Any) -> Call:
    """The :class:`Call` a watchdog mark stands for (a Call, or a fast path's ``(spec, seq, start)``)."""
    return active if type(active) is Call else active[0].call(active[1], active[2])


def opts_of(kwargs: dict) -> tuple:
    """A call's options as its signature lists them (sorted by name): the full path and the fast path
    must number and describe a call alike."""
    return tuple(sorted(kwargs.items())) if len(kwargs) > 1 else tuple(kwargs.items())


def _client():
    from jax._src import distributed as jdist  # JAX's runtime client: set by jax.distributed.initialize

    return jdist.global_state.client


class _Watchdog:
    """The process's watchdog thread and its per-group call counters."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.active: Any = None  # the call this rank is in: a Call, or a fast path's (spec, seq, start)
        self.published: Any = None  # the mark whose position is published
        self._counters: dict[tuple, itertools.count] = {}
        self._thread = threading.Thread(target=self._watch, name="spmd-collective-watchdog", daemon=True)
        self._thread.start()

    def next_seq(self, ranks: tuple) -> int:
        return next(self.counter(ranks))

    def counter(self, ranks: tuple) -> itertools.count:
        """The call counter of the group of ``ranks`` (the fast path draws its numbers from it too)."""
        return self._counters.setdefault(ranks, itertools.count())

    # --- the thread ---
    def _watch(self) -> None:
        seen: tuple = (None, None)  # (mark, its Call): a fast path's mark becomes a Call once
        while True:
            time.sleep(_TICK_S)
            mark = self.active
            if mark is None:
                continue
            if seen[0] is not mark:
                seen = (mark, as_call(mark))
            call = seen[1]
            now = time.monotonic()
            if self.published is not mark and now - call.start >= _PUBLISH_AFTER_S:
                self._publish(mark, call)
            if now >= call.deadline and self.active is mark:
                # Rank 0 hosts the coordination service: it lingers so that the others can read it first.
                fail(self._timeout_message(call), PEER_EXIT_CODE, 2 * _TICK_S + _PUBLISH_AFTER_S if self.rank == 0 else 0)

    def _publish(self, mark: Any, call: Call) -> None:
        try:
            _client().key_value_set(f"spmd/pos/{self.rank}", call.position(), allow_overwrite=True)
            self.published = mark
        except Exception:  # the service is gone: the heartbeat ends this process soon
            pass

    def unpublish(self, mark: Any) -> None:
        if self.published is mark:
            self.published = None
            try:
                _client().key_value_delete(f"spmd/pos/{self.rank}")
            except Exception:
                pass

    def _positions(self, call: Call) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        client = _client()
        for r in call.ranks:
            if r == self.rank:
                continue
            try:
                out[r] = client.key_value_try_get(f"spmd/pos/{r}")
            except Exception:
                out[r] = None
        return out

    def missing(self, call: Call) -> list[tuple[int, str]]:
        """The group's ranks that are not in ``call``, each with where it is instead."""
        positions = self._positions(call)
        if any(p != call.position() for p in positions.values()):
            time.sleep(2 * _TICK_S + _PUBLISH_AFTER_S)  # a late arrival publishes within this
            positions = self._positions(call)
        out = []
        for r, pos in positions.items():
            if pos == call.position():
                continue
            if pos is None:
                out.append((r, "is not in any collective (busy elsewhere, hung or stopped)"))
                continue
            group, seq, where, sig = pos.split("|", 3)
            if group == call.group and seq == str(call.seq):
                out.append((r, f"is in the same call with a different signature: {where}({sig})"))
            else:
                out.append((r, f"is in {where} (call #{seq} of {group})"))
        return out

    def _timeout_message(self, call: Call) -> str:
        timeout = call.deadline - call.start
        try:
            missing = self.missing(call)
        except Exception as e:  # noqa: BLE001 - the message must still go out
            missing = [(r, f"(could not ask the coordination service: {e})") for r in call.ranks if r != self.rank]
        names = [r for r, _ in missing]
        detail = "; ".join(f"rank {r} {why}" for r, why in missing) or "every rank arrived, the transfer stalled"
        return (
            f"{call.where}: rank {self.rank} waited {timeout:g} s (the timeout) in {call.describe()} "
            f"({call.signature}); ranks {names} did not arrive: {detail}. Every rank of the group must call the "
            "same collectives in the same order; raise the limit with init_process_group(timeout=...) or "
            f"SPMD_TIMEOUT. Ending this rank now.\n{absent_line(names)}"
        )


_WATCHDOG: _Watchdog | None = None


def watchdog_of(st: State) -> _Watchdog | None:
    """The watchdog of this process for ``st``, if it runs (the fast path marks its calls there)."""
    wd = _WATCHDOG
    return wd if wd is not None and (wd.rank, wd.world) == (st.rank, st.world_size) else None


def _watchdog(st: State, where: str) -> _Watchdog:
    global _WATCHDOG
    if _WATCHDOG is None or (_WATCHDOG.rank, _WATCHDOG.world) != (st.rank, st.world_size):
        _WATCHDOG = _Watchdog(st.rank, st.world_size)
    return _WATCHDOG


def enter(st: State, where: str, ranks: tuple, opts: tuple, shape: tuple, dtype: Any) -> Call:
    """This rank enters a collective: counted, watched, and checked across ranks if asked."""
    wd = _watchdog(st, where)
    now = time.monotonic()
    call = Call(where, ranks, wd.next_seq(ranks), opts, shape, dtype, st.world_size, now, now + st.timeout_s)
    if st.check_calls or call.seq == 0:
        # The first call of a group always meets here: gloo connects the group at its first
        # collective with a fixed 30 s limit, which must not cut a longer timeout short.
        _check_across_ranks(wd, call)
    wd.active = call
    return call


def leave(call: Call) -> None:
    wd = _WATCHDOG
    if wd is not None:
        wd.active = None
        wd.unpublish(call)


def broken_message(st: State, call: Call, error: Exception) -> str:
    """The message of a collective that failed while running (gloo broke: a peer died)."""
    return (
        f"{call.where}: the collective failed on rank {st.rank} in {call.describe()}; another rank most likely "
        f"died or left the job (see its output): {error}"
    )


def _check_across_ranks(wd: _Watchdog, call: Call) -> None:
    """Publish this call's signature, read the group's, within the timeout (DETAIL mode)."""
    client = _client()
    base = f"spmd/sig/{call.group}/{call.seq}"
    client.key_value_set(f"{base}/{wd.rank}", f"{call.where}({call.signature})")
    got: dict[int, str] = {}
    missing = []
    broke: Exception | None = None  # a read that failed before the deadline: the service stopped answering
    for r in call.ranks:
        if r == wd.rank:
            continue
        left_ms = max(1, int((call.deadline - time.monotonic()) * 1000))
        try:
            got[r] = client.blocking_key_value_get(f"{base}/{r}", left_ms)
        except Exception as e:  # noqa: BLE001 - a timeout, or the service (rank 0) is gone
            missing.append(r)
            if broke is None and time.monotonic() < call.deadline - _EARLY_S:
                broke = e
    if call.seq:
        try:
            client.key_value_delete(f"spmd/sig/{call.group}/{call.seq - 1}/{wd.rank}")  # every peer has read it
        except Exception:
            pass
    if missing and broke is not None:
        elapsed, limit = time.monotonic() - call.start, call.deadline - call.start
        first = (str(broke).strip().splitlines() or [type(broke).__name__])[0][:200]
        raise PeerError(
            f"{call.where}: rank {wd.rank} stopped waiting after {elapsed:.1f} s (of its {limit:g} s timeout) for "
            f"ranks {missing} to reach {call.describe()}: the coordination service stopped answering ({first}). "
            "Rank 0 hosts it: rank 0 most likely ended first (see its output for why)."
        )
    if missing:
        raise PeerError(
            f"{call.where}: rank {wd.rank} waited {call.deadline - call.start:g} s (the timeout) for ranks {missing} "
            f"to reach {call.describe()}; they did not arrive. Every rank of the group must call the same "
            "collectives in the same order; raise the limit with init_process_group(timeout=...) or SPMD_TIMEOUT.\n"
            + absent_line(missing)
        )
    mine = f"{call.where}({call.signature})"
    differ = {r: s for r, s in got.items() if s != mine}
    if differ:
        listing = "; ".join([f"rank {wd.rank}: {mine}"] + [f"rank {r}: {s}" for r, s in sorted(differ.items())])
        raise ValueError(
            f"{call.where}: the ranks of {call.group} disagree on call #{call.seq}: {listing}. Every rank must call "
            "the same collective with the same op, src/dst, dtype and shape (checked on a group's first call, "
            "and on every call with TORCH_DISTRIBUTED_DEBUG=DETAIL)."
        )
