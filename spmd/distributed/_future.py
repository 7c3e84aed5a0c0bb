"""``Work.get_future()``: a ``torch.futures.Future``-like handle on a collective's result."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Future"]

_UNSET = object()


class Future:
    """``wait()`` / ``value()`` give the result (for a collective: ``[tensor]``, as torch's
    ``work.get_future()``); ``done()`` says whether it is there; ``then(fn)`` is a Future of
    ``fn(self)``. Collectives here complete when called (or at ``wait()``: queued
    sends/receives, MPI's requests), so the result is computed on first ask, never in the background."""

    def __init__(self, resolve: Callable[[], Any], is_done: Callable[[], bool] = lambda: False):
        self._resolve = resolve
        self._is_done = is_done
        self._value: Any = _UNSET

    @classmethod
    def of_work(cls, work: Any) -> "Future":
        return cls(work.result, work.is_completed)

    def wait(self) -> Any:
        if self._value is _UNSET:
            self._value = self._resolve()
        return self._value

    def value(self) -> Any:
        return self.wait()

    def done(self) -> bool:
        return self._value is not _UNSET or self._is_done()

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        if not callable(callback):
            raise TypeError(f"Future.then: callback={callback!r} must be callable (it gets this Future).")
        return Future(lambda: callback(self), self.done)

    def __repr__(self) -> str:
        return f"Future(done={self.done()})"
