"""``send_object_list`` / ``recv_object_list`` and ``monitored_barrier``, over JAX's coordination
service (its key-value store), with the object encoding of :mod:`spmd.distributed._objects`.

Point to point: the n-th ``send_object_list`` from rank ``a`` to rank ``b``
meets the n-th ``recv_object_list`` of ``b`` from ``a`` (torch's per-pair order).
A send returns once the objects are in the store; the receiver deletes them.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from spmd.distributed import _objects
from spmd.distributed._groups import group_of, members_only, peer_of
from spmd.distributed._objects import dumps, loads
from spmd.distributed._state import state

__all__ = ["send_object_list", "recv_object_list", "monitored_barrier"]

# Per-pair message numbers of this process: (src, dst) -> count. The n-th send of a pair
# is keyed by n on the sender and read as n on the receiver.
_SENT: dict[tuple[int, int], itertools.count] = {}
_RECEIVED: dict[tuple[int, int], int] = {}
_POLL_S = 0.002


def _key(src: int, dst: int, n: int) -> str:
    return f"spmd/object_p2p/{src}->{dst}/{n}"


def _peer(group: Any, peer: Any, group_peer: Any, where: str, arg: str, *, required: bool):
    """(this rank, the peer's global rank or None for any); None if this rank is not in ``group``."""
    g = group_of(group, where)
    if g is None:
        return None
    me = state(where).rank
    if peer is None and group_peer is None:
        if required:
            raise ValueError(f"{where}: {arg}= is required; name the rank to send to.")
        return me, None
    return me, peer_of(g, peer, group_peer, where, arg)


def send_object_list(object_list: list, dst: int | None = None, group: Any = None, device: Any = None,
                     group_dst: int | None = None, use_batch: bool = False, *, allow_pickle: bool = False) -> None:
    """Send the objects of ``object_list`` to rank ``dst``, which calls :func:`recv_object_list`."""
    where = "send_object_list"
    if not isinstance(object_list, list):
        raise TypeError(f"{where}: object_list={object_list!r} must be a list.")
    peers = _peer(group, dst, group_dst, where, "dst", required=True)
    if peers is None:
        return None  # not a member: warned, nothing to do (as torch)
    me, dst = peers
    payload = dumps(list(object_list), allow_pickle=allow_pickle, where=where)
    n = next(_SENT.setdefault((me, dst), itertools.count()))
    _objects._client().key_value_set_bytes(_key(me, dst, n), payload)


def recv_object_list(object_list: list, src: int | None = None, group: Any = None, device: Any = None,
                     group_src: int | None = None, use_batch: bool = False, *, allow_pickle: bool = False,
                     timeout: Any = None) -> int:
    """Fill ``object_list`` (in place) with the objects rank ``src`` sent (any rank of the group
    if ``src`` is None); returns the sender's rank, as torch."""
    where = "recv_object_list"
    if not isinstance(object_list, list):
        raise TypeError(f"{where}: object_list={object_list!r} must be a list (of the length the sender sends).")
    peers = _peer(group, src, group_src, where, "src", required=False)
    if peers is None:
        return -1  # not a member: warned, nothing received (torch returns -1 too)
    me, src = peers
    timeout_s = _objects._timeout_s(timeout, where)
    peers = [src] if src is not None else [r for r in group_of(group, where, non_member="raise").global_ranks() if r != me]
    if not peers:
        raise ValueError(f"{where}: rank {me} is alone in its group; there is no rank to receive from.")
    client = _objects._client()
    sender, payload = _wait_for_message(client, me, peers, timeout_s)
    if payload is None:
        who = f"rank {src}" if src is not None else f"any of ranks {peers}"
        raise TimeoutError(
            f"{where}: rank {me} waited {timeout_s:g} s for objects from {who}, which sent none; the sender "
            "must call send_object_list (raise the limit with timeout= or init_process_group(timeout=...))."
        )
    values = loads(payload, allow_pickle=allow_pickle, where=where)
    if len(values) != len(object_list):
        raise ValueError(
            f"{where}: rank {sender} sent {len(values)} object(s) but object_list has {len(object_list)} "
            "entries; give it the sender's length."
        )
    object_list[:] = values
    return sender


def _wait_for_message(client, me: int, peers: list[int], timeout_s: float) -> tuple[int, bytes | None]:
    """(sender, payload) of the next message to ``me`` from one of ``peers`` (consumed), or
    (-1, None) after ``timeout_s``. One peer: a blocking read; several: polling, backing off."""
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S
    while True:
        for p in peers:
            key = _key(p, me, _RECEIVED.get((p, me), 0))
            try:
                if len(peers) == 1:
                    payload = client.blocking_key_value_get_bytes(key, max(1, int((deadline - time.monotonic()) * 1000)))
                else:
                    payload = client.key_value_try_get_bytes(key)
            except Exception as e:
                if "NOT_FOUND" in str(e):
                    continue
                if "DEADLINE" in str(e).upper():
                    return -1, None
                raise
            _RECEIVED[(p, me)] = _RECEIVED.get((p, me), 0) + 1
            client.key_value_delete(key)
            return p, payload
        if time.monotonic() >= deadline:
            return -1, None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


@members_only
def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier whose first rank names the ranks that did not arrive within ``timeout``
    (the first one, or all of them with ``wait_all_ranks=True``), as torch's; every rank
    then raises ``RuntimeError`` instead of waiting."""
    where = "monitored_barrier"
    st = state(where)
    timeout_s = _objects._timeout_s(timeout, where)
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"{where}: wait_all_ranks={wait_all_ranks!r} must be a bool.")
    if not st.multiprocess:
        return None
    ranks = group.global_ranks()
    base = _objects._next_id(where, group)
    client = _objects._client()
    if st.rank != ranks[0]:
        client.key_value_set_bytes(f"{base}/arrive/{st.rank}", b"1")
        try:
            verdict = client.blocking_key_value_get_bytes(f"{base}/release", int((timeout_s + 5) * 1000))
        except Exception as e:
            if "DEADLINE" in str(e).upper():
                raise RuntimeError(
                    f"{where}: rank {st.rank} got no answer from rank {ranks[0]} (the group's first rank) within "
                    f"{timeout_s:g} s; it most likely did not reach the barrier."
                ) from None
            raise
        if verdict != b"ok":
            raise RuntimeError(verdict.decode())
        return None
    deadline = time.monotonic() + timeout_s
    want = ranks[1:]
    missing = [r for r in want if not _arrives(client, f"{base}/arrive/{r}", deadline)]
    if not missing:
        client.key_value_set_bytes(f"{base}/release", b"ok")
        for r in want:
            client.key_value_delete(f"{base}/arrive/{r}")
        return None
    named = missing if wait_all_ranks else missing[:1]
    message = (
        f"{where}: rank(s) {named} failed to pass the monitored barrier of {group!r} within {timeout_s:g} s "
        "(they did not reach it: see their output)."
    )
    client.key_value_set_bytes(f"{base}/release", message.encode())
    raise RuntimeError(message)


def _arrives(client, key: str, deadline: float) -> bool:
    """Whether ``key`` is set by ``deadline`` (a blocking read; after the deadline, a look)."""
    try:
        client.blocking_key_value_get_bytes(key, max(1, int((deadline - time.monotonic()) * 1000)))
        return True
    except Exception as e:
        if "DEADLINE" in str(e).upper():
            return False
        raise
