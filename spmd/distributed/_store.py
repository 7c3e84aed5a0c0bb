"""torch's key-value stores (``Store``, ``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore``)
on JAX's coordination service.

``init_process_group`` starts JAX's coordination service on rank 0 (at
``MASTER_ADDR:MASTER_PORT``); its key-value store is what every store here
reads and writes. A ``TCPStore(host, port)`` / ``FileStore(path)`` is a
namespace in it named by its address / path, so two stores with the same
address share their keys, as torch's clients of one server do; ``HashStore``
lives in this process only. In a world of size 1 (no coordination service) the
process keeps the keys itself.

Differences from torch: a store needs ``init_process_group`` first (the service
is the process group's), so ``init_process_group(store=...)`` is not the way to
join a job here; ``compare_set`` and ``append`` are absent (the service has no
atomic compare-and-swap); a key that does not arrive in time raises
``TimeoutError`` (torch: ``DistStoreError``).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Sequence

from spmd.distributed import _objects

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore"]

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)  # torch's default for stores


class _LocalKV:
    """Keys kept in this process (HashStore; every store in a world of size 1)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def try_get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self._cond:
            self._cond.wait_for(lambda: key in self._data, timeout=timeout_s)
            return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        with self._cond:
            return [k for k in self._data if k.startswith(prefix)]


class _ServiceKV:
    """Keys in JAX's coordination service (every process of the job sees them)."""

    def __init__(self, client) -> None:
        self._client = client

    def set(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value, allow_overwrite=True)

    def try_get(self, key: str) -> bytes | None:
        try:
            return self._client.key_value_try_get_bytes(key)
        except Exception as e:
            if "NOT_FOUND" in str(e):
                return None
            raise

    def get(self, key: str, timeout_s: float) -> bytes | None:
        try:
            return self._client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except Exception as e:
            if "DEADLINE" in str(e).upper():
                return None
            raise

    def add(self, key: str, amount: int) -> int:
        return int(self._client.key_value_increment(key, amount))

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)

    def keys(self, prefix: str) -> list[str]:
        return [k for k, _ in self._client.key_value_dir_get_bytes(prefix)]


_WORLD1_KV = _LocalKV()  # stands in for the coordination service when the world has one process


def _job_kv(where: str):
    st = _objects.state(where)
    return _ServiceKV(_objects._client()) if st.multiprocess else _WORLD1_KV


def _seconds(timeout: Any, where: str) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{where}: timeout={timeout!r} must be a datetime.timedelta or a number of seconds.")
    if not timeout > 0:
        raise ValueError(f"{where}: timeout={timeout!r} must be positive.")
    return float(timeout)


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"{where}: key={key!r} must be a non-empty string.")
    return key


def _value(value: Any, where: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list) and all(isinstance(v, int) and 0 <= v < 256 for v in value):
        return bytes(value)  # torch also takes a list of byte values
    raise TypeError(f"{where}: value={value!r} must be str or bytes.")


class Store:
    """A key-value store shared by the ranks, as ``torch.distributed.Store``.

    ``set(key, value)``, ``get(key)`` (bytes; waits up to the timeout),
    ``add(key, n)`` (an atomic counter; returns the new value), ``wait(keys)``,
    ``check(keys)``, ``delete_key(key)``, ``num_keys()``, ``multi_get``,
    ``multi_set``, ``set_timeout``. Make one with :class:`TCPStore`,
    :class:`FileStore`, :class:`HashStore` or :class:`PrefixStore`.
    """

    def __init__(self, kv, namespace: str, timeout: Any = _DEFAULT_TIMEOUT):
        self._kv = kv
        self._ns = namespace
        self._timeout_s = _seconds(timeout, type(self).__name__)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: Any) -> None:
        self._timeout_s = _seconds(timeout, "Store.set_timeout")

    def _full(self, key: Any, where: str) -> str:
        return self._ns + _key(key, where)

    def set(self, key: str, value: Any) -> None:
        self._kv.set(self._full(key, "Store.set"), _value(value, "Store.set"))

    def get(self, key: str) -> bytes:
        full = self._full(key, "Store.get")
        got = self._kv.get(full, self._timeout_s)
        if got is None:
            raise TimeoutError(
                f"Store.get: key={key!r} was not set within {self._timeout_s:g} s; a rank must set it "
                "(raise the limit with set_timeout or the store's timeout=)."
            )
        return got

    def add(self, key: str, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"Store.add: amount={amount!r} must be an int.")
        full = self._full(key, "Store.add")
        current = self._kv.try_get(full)
        if current is not None and not current.lstrip(b"-").isdigit():
            raise ValueError(f"Store.add: key={key!r} holds {current!r}, not an integer; add to a counter key.")
        return self._kv.add(full, amount)

    def wait(self, keys: Sequence[str], timeout: Any = None) -> None:
        """Wait until every key is set (at most ``timeout``, else the store's timeout)."""
        limit = self._timeout_s if timeout is None else _seconds(timeout, "Store.wait")
        deadline = time.monotonic() + limit
        for key in self._keys(keys, "Store.wait"):
            if self._kv.get(self._full(key, "Store.wait"), max(0.001, deadline - time.monotonic())) is None:
                raise TimeoutError(
                    f"Store.wait: key={key!r} was not set within {limit:g} s; a rank must set it "
                    "(pass a longer timeout=)."
                )

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set now (no wait)."""
        return all(self._kv.try_get(self._full(k, "Store.check")) is not None for k in self._keys(keys, "Store.check"))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""
        full = self._full(key, "Store.delete_key")
        existed = self._kv.try_get(full) is not None
        self._kv.delete(full)
        return existed

    def num_keys(self) -> int:
        return len(self._kv.keys(self._ns))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in self._keys(keys, "Store.multi_get")]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        keys = self._keys(keys, "Store.multi_set")
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise ValueError(f"Store.multi_set: values={values!r} must be a list of {len(keys)} values, one per key.")
        for k, v in zip(keys, values):
            self.set(k, v)

    @staticmethod
    def _keys(keys: Any, where: str) -> list[str]:
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
            raise TypeError(f"{where}: keys={keys!r} must be a list of strings.")
        return [_key(k, where) for k in keys]


class TCPStore(Store):
    """``TCPStore(host_name, port, world_size=None, is_master=False, timeout=...)``: the keys of
    the job's store at ``host_name:port``, held by JAX's coordination service (started by
    ``init_process_group``). Every rank constructing it with the same address shares its keys;
    ``is_master`` and ``wait_for_workers`` change nothing (the service is already up)."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: Any = _DEFAULT_TIMEOUT, wait_for_workers: bool = True, multi_tenant: bool = False,
                 master_listen_fd: Any = None, use_libuv: bool = True):
        where = "TCPStore"
        if not isinstance(host_name, str) or not host_name:
            raise TypeError(f"{where}: host_name={host_name!r} must be a host name such as '127.0.0.1'.")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"{where}: port={port!r} must be an int such as 29500.")
        if not 0 <= port < 65536:
            raise ValueError(f"{where}: port={port!r} must be in 0..65535.")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
            raise TypeError(f"{where}: world_size={world_size!r} must be an int or None.")
        if world_size is not None and world_size < 1:
            raise ValueError(f"{where}: world_size={world_size!r} must be >= 1 (or None).")
        self.host = host_name
        self.port = port
        super().__init__(_job_kv(where), f"spmd/store/tcp/{host_name}:{port}/", timeout)


class FileStore(Store):
    """``FileStore(file_name, world_size=-1)``: a store named by a path (nothing is written to the
    file; the keys live in JAX's coordination service), shared by every rank naming the same path."""

    def __init__(self, file_name: str, world_size: int = -1):
        if not isinstance(file_name, (str, os.PathLike)) or not str(file_name):
            raise TypeError(f"FileStore: file_name={file_name!r} must be a path.")
        self.path = os.path.abspath(os.fspath(file_name))
        super().__init__(_job_kv("FileStore"), f"spmd/store/file/{self.path}/")


class HashStore(Store):
    """An in-process store (threads of this process share it), as ``torch.distributed.HashStore``."""

    def __init__(self):
        super().__init__(_LocalKV(), "")


class PrefixStore(Store):
    """``PrefixStore(prefix, store)``: ``store``'s keys under ``prefix/``."""

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore: prefix={prefix!r} must be a string.")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore: store={store!r} must be a Store (TCPStore, FileStore, HashStore, ...).")
        self.underlying_store = store
        super().__init__(store._kv, f"{store._ns}{prefix}/", store.timeout)
