"""Object collectives and barrier over JAX's coordination service (its key-value store).

Objects travel as JSON with tags for what JSON lacks (tuples, bytes, bytearrays,
non-string dict keys, sets, Counter / OrderedDict / defaultdict / deque, NumPy /
JAX arrays and scalars, complex numbers), each arriving with its exact type, so a
peer's bytes are never unpickled. Any other type, subclasses of the above
included (a namedtuple, an IntEnum, a dict subclass), is refused with the
``allow_pickle=True`` hint rather than sent as its base type. ``allow_pickle=True`` (on the sender, to send an object
JSON cannot hold, and on the receiver, to accept it) opts in to pickle.
"""

from __future__ import annotations

import base64
import collections
import itertools
import json
import pickle
from typing import Any

import numpy as np

from spmd.distributed import _mpi
from spmd.distributed._env import seconds
from spmd.distributed._groups import Group, members_only, peer_rank
from spmd.distributed._state import state

__all__ = [
    "dumps",
    "loads",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
]

_MAGIC_JSON = b"J"
_MAGIC_PICKLE = b"P"


class _NotJSON(Exception):
    pass


# defaultdict factories that travel by name (any other factory is code: refused without pickle).
_FACTORIES = {f.__name__: f for f in (int, float, complex, str, bytes, list, dict, set, tuple, bool)}


def _enc_items(obj: dict) -> list:
    return [[_enc(k), _enc(v)] for k, v in obj.items()]


def _enc(obj: Any) -> Any:
    """Exact types only: a subclass (Counter, OrderedDict, a namedtuple, an IntEnum...) is
    either one of the containers tagged below or refused, never sent as its base type."""
    t = type(obj)
    if isinstance(obj, np.generic):  # first: np.float64, np.str_, ... subclass Python's types
        return {"__npscalar__": _enc_array(np.asarray(obj))}
    if obj is None or t in (bool, str, int):
        return obj
    if t is float:
        return obj if np.isfinite(obj) else {"__float__": repr(obj)}
    if t is complex:
        return {"__complex__": [obj.real, obj.imag]}
    if t is list:
        return [_enc(v) for v in obj]
    if t is tuple:
        return {"__tuple__": [_enc(v) for v in obj]}
    if t in (bytes, bytearray):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode(), "mutable": t is bytearray}
    if t is dict:
        if all(type(k) is str for k in obj) and not any(k.startswith("__") and k.endswith("__") for k in obj):
            return {k: _enc(v) for k, v in obj.items()}
        return {"__dict__": _enc_items(obj)}
    if t is collections.Counter:
        return {"__counter__": _enc_items(obj)}
    if t is collections.OrderedDict:
        return {"__odict__": _enc_items(obj)}
    if t is collections.defaultdict:
        factory = obj.default_factory
        if factory is not None and _FACTORIES.get(getattr(factory, "__name__", None)) is not factory:
            raise _NotJSON(f"defaultdict whose default_factory is {factory!r}")
        return {"__defaultdict__": _enc_items(obj), "factory": None if factory is None else factory.__name__}
    if t is collections.deque:
        return {"__deque__": [_enc(v) for v in obj], "maxlen": obj.maxlen}
    if t in (set, frozenset):
        return {"__set__": [_enc(v) for v in obj], "frozen": t is frozenset}
    if isinstance(obj, np.ndarray) or t.__module__.startswith(("jax", "jaxlib")):
        if isinstance(obj, np.ndarray) and t is not np.ndarray:
            raise _NotJSON(f"{t.__name__} (an ndarray subclass)")
        try:
            arr = np.asarray(obj)
        except Exception:
            raise _NotJSON(t.__name__) from None
        return {"__ndarray__": _enc_array(arr)}
    raise _NotJSON(t.__name__)


def _enc_array(arr: np.ndarray) -> dict:
    if arr.dtype.hasobject:
        raise _NotJSON("object array")
    # tobytes() is C order whatever the layout (np.ascontiguousarray would make a 0-d array 1-d).
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}


def _dec_array(d: dict) -> np.ndarray:
    dtype = np.dtype(d["dtype"])
    if dtype.hasobject:
        raise ValueError("refusing an object array from a peer")
    return np.frombuffer(base64.b64decode(d["data"]), dtype=dtype).reshape(d["shape"]).copy()


def _dec(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_dec(v) for v in obj]
    if isinstance(obj, dict):
        if "__tuple__" in obj:
            return tuple(_dec(v) for v in obj["__tuple__"])
        if "__bytes__" in obj:
            raw = base64.b64decode(obj["__bytes__"])
            return bytearray(raw) if obj.get("mutable") else raw
        if "__dict__" in obj:
            return {_dec(k): _dec(v) for k, v in obj["__dict__"]}
        if "__counter__" in obj:
            return collections.Counter({_dec(k): _dec(v) for k, v in obj["__counter__"]})
        if "__odict__" in obj:
            return collections.OrderedDict((_dec(k), _dec(v)) for k, v in obj["__odict__"])
        if "__defaultdict__" in obj:
            name = obj["factory"]
            if name is not None and name not in _FACTORIES:
                raise ValueError(f"refusing a defaultdict factory {name!r} from a peer")
            items = ((_dec(k), _dec(v)) for k, v in obj["__defaultdict__"])
            return collections.defaultdict(None if name is None else _FACTORIES[name], items)
        if "__deque__" in obj:
            return collections.deque((_dec(v) for v in obj["__deque__"]), obj["maxlen"])
        if "__set__" in obj:
            items = [_dec(v) for v in obj["__set__"]]
            return frozenset(items) if obj.get("frozen") else set(items)
        if "__ndarray__" in obj:
            return _dec_array(obj["__ndarray__"])
        if "__npscalar__" in obj:
            return _dec_array(obj["__npscalar__"])[()]
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__complex__" in obj:
            re, im = obj["__complex__"]
            return complex(re, im)
        return {k: _dec(v) for k, v in obj.items()}
    return obj


def dumps(obj: Any, *, allow_pickle: bool = False, where: str = "dumps") -> bytes:
    """Serialise ``obj`` safely (tagged JSON); pickle only if ``allow_pickle`` and JSON cannot hold it."""
    try:
        return _MAGIC_JSON + json.dumps(_enc(obj), separators=(",", ":")).encode()
    except _NotJSON as e:
        if allow_pickle:
            return _MAGIC_PICKLE + pickle.dumps(obj)
        raise TypeError(
            f"{where}: cannot send an object holding a {e} safely: objects travel as JSON (with NumPy/JAX "
            "arrays, tuples, bytes, sets, Counter, OrderedDict, deque) and arrive with their exact type; "
            "convert it (e.g. to a dict), or pass allow_pickle=True on every rank if you trust all of them."
        ) from None


def loads(data: bytes, *, allow_pickle: bool = False, where: str = "loads") -> Any:
    """Inverse of :func:`dumps`; refuses a pickled payload unless ``allow_pickle``."""
    kind, body = data[:1], data[1:]
    if kind == _MAGIC_JSON:
        return _dec(json.loads(body.decode()))
    if kind == _MAGIC_PICKLE:
        if not allow_pickle:
            raise ValueError(
                f"{where}: a peer sent a pickled object and this rank did not pass allow_pickle=True; "
                "unpickling a peer's bytes can run arbitrary code. Pass allow_pickle=True on every rank "
                "only if you trust all of them."
            )
        return pickle.loads(body)  # noqa: S301 - the caller opted in
    raise ValueError(f"{where}: received a payload in an unknown format {kind!r}.")


# --- key-value transport ----------------------------------------------------------------------
_COUNTERS: dict[tuple, itertools.count] = {}


def _next_id(kind: str, g: Group) -> str:
    ranks = g.global_ranks()
    c = _COUNTERS.setdefault((kind, ranks), itertools.count())
    return f"spmd/{kind}/{'-'.join(map(str, ranks))}/{next(c)}"


def _client():
    from jax._src import distributed as jdist

    return jdist.global_state.client


def _get(client, key: str, timeout_s: float, where: str, peer: int) -> bytes:
    try:
        return client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
    except Exception as e:
        if "DEADLINE" in str(e).upper():
            raise TimeoutError(
                f"{where}: rank {state(where).rank} waited {timeout_s:g} s for rank {peer}, which did not "
                "take part; every rank of the group must call it (raise the limit with "
                "init_process_group(timeout=...) or SPMD_TIMEOUT)."
            ) from None
        raise


def _timeout_s(timeout: Any, where: str) -> float:
    return state(where).timeout_s if timeout is None else seconds(timeout, where, "timeout")


def _exchange(
    g: Group, payload: bytes | None, senders: tuple[int, ...], where: str, timeout: Any, read: bool = True
) -> dict[int, bytes]:
    """Ranks in ``senders`` publish ``payload``; a caller that ``read``s gets {rank: payload}."""
    st = state(where)
    timeout_s = _timeout_s(timeout, where)
    if not st.multiprocess:
        return {st.rank: payload} if st.rank in senders else {}
    if st.backend.name == "mpi":  # MPI_Iallgatherv / MPI_Ibcast of the bytes, on the group's communicator
        return _mpi.exchange(g.global_ranks(), payload, senders, st.rank, timeout_s, where)
    client = _client()
    base = _next_id(where, g)
    if st.rank in senders:
        client.key_value_set_bytes(f"{base}/{st.rank}", payload)
    if not read:
        return {}
    return {r: (payload if r == st.rank else _get(client, f"{base}/{r}", timeout_s, where, r)) for r in senders}


# --- public -------------------------------------------------------------------------------------
@members_only
def all_gather_object(object_list: Any, obj: Any, group: Any = None, *, allow_pickle: bool = False, timeout: Any = None) -> list:
    """Every rank gets every rank's ``obj``, by group rank; fills ``object_list`` (a list of the
    group's size) and returns it. Objects travel as tagged JSON (see the module notes)."""
    where = "all_gather_object"
    ranks = group.global_ranks()
    if object_list is not None and (not isinstance(object_list, list) or len(object_list) != len(ranks)):
        raise ValueError(f"{where}: object_list must be a list of {len(ranks)} entries (one per rank) or None.")
    got = _exchange(group, dumps(obj, allow_pickle=allow_pickle, where=where), ranks, where, timeout)
    values = [loads(got[r], allow_pickle=allow_pickle, where=where) for r in ranks]
    if object_list is None:
        return values
    object_list[:] = values
    return object_list


@members_only
def broadcast_object_list(object_list: list, src: int | None = None, group: Any = None, device: Any = None, *, group_src: int | None = None, allow_pickle: bool = False, timeout: Any = None) -> list:
    """Every rank's ``object_list`` becomes rank ``src``'s (in place, and returned)."""
    where = "broadcast_object_list"
    if not isinstance(object_list, list):
        raise TypeError(f"{where}: object_list={object_list!r} must be a list (its length is the same on every rank).")
    ranks = group.global_ranks()
    src = ranks[peer_rank(group, 0 if src is None and group_src is None else src, group_src, where, "src")]
    me = state(where).rank
    payload = dumps(list(object_list), allow_pickle=allow_pickle, where=where) if me == src else None
    got = _exchange(group, payload, (src,), where, timeout)
    values = loads(got[src], allow_pickle=allow_pickle, where=where)
    if len(values) != len(object_list):
        raise ValueError(
            f"{where}: rank {src} sent {len(values)} object(s) but this rank's object_list has "
            f"{len(object_list)} entries; give it the same length on every rank."
        )
    object_list[:] = values
    return object_list


@members_only
def gather_object(obj: Any, object_gather_list: Any = None, dst: int = 0, group: Any = None, *, allow_pickle: bool = False, timeout: Any = None):
    """Rank ``dst`` gets every rank's ``obj`` (a list by group rank); the others get None."""
    where = "gather_object"
    ranks = group.global_ranks()
    dst = ranks[peer_rank(group, dst, None, where, "dst")]
    me = state(where).rank
    # Every rank publishes; only the destination reads.
    got = _exchange(group, dumps(obj, allow_pickle=allow_pickle, where=where), ranks, where, timeout, read=me == dst)
    if me != dst:
        return None
    values = [loads(got[r], allow_pickle=allow_pickle, where=where) for r in ranks]
    if isinstance(object_gather_list, list) and len(object_gather_list) == len(ranks):
        object_gather_list[:] = values
        return object_gather_list
    return values


@members_only
def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Any = None, src: int = 0, group: Any = None, *, allow_pickle: bool = False, timeout: Any = None):
    """Rank ``i`` gets ``scatter_object_input_list[i]`` of rank ``src`` in ``scatter_object_output_list[0]``."""
    where = "scatter_object_list"
    ranks = group.global_ranks()
    src = ranks[peer_rank(group, src, None, where, "src")]
    me = state(where).rank
    payload = None
    if me == src:
        if not isinstance(scatter_object_input_list, list) or len(scatter_object_input_list) != len(ranks):
            raise ValueError(f"{where}: scatter_object_input_list must be a list of {len(ranks)} objects on src.")
        payload = dumps(scatter_object_input_list, allow_pickle=allow_pickle, where=where)
    got = _exchange(group, payload, (src,), where, timeout)
    value = loads(got[src], allow_pickle=allow_pickle, where=where)[ranks.index(me)]
    if isinstance(scatter_object_output_list, list) and scatter_object_output_list:
        scatter_object_output_list[0] = value
    return value


@members_only
def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None) -> None:
    """Wait until every rank of the group gets here (JAX's coordination-service barrier),
    at most the timeout; a :class:`TimeoutError` names the limit."""
    where = "barrier"
    st = state(where)
    timeout_s = _timeout_s(timeout, where)
    if not st.multiprocess:
        return None
    ranks = group.global_ranks()
    if st.backend.name == "mpi":  # MPI_Ibarrier of the group's communicator, waited for at most the timeout
        try:
            _mpi.barrier(ranks, timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{where}: rank {st.rank} waited {timeout_s:g} s at a barrier of {group!r} and not every rank came; "
                "raise the limit with barrier(timeout=...) or init_process_group(timeout=...)."
            ) from None
        return None
    bid = _next_id(where, group).replace("/", "_")
    try:
        _client().wait_at_barrier(bid, int(timeout_s * 1000), None if group.ranks is None else list(ranks))
    except Exception as e:
        if "DEADLINE" in str(e).upper() or "timed out" in str(e).lower():
            raise TimeoutError(
                f"{where}: rank {st.rank} waited {timeout_s:g} s at a barrier of {group!r} and not every rank came; "
                "raise the limit with barrier(timeout=...) or init_process_group(timeout=...)."
            ) from None
        raise
    return None
