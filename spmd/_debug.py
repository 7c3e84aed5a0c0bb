"""``CommDebugMode`` (count the collectives run inside it), as ``torch.distributed.tensor.debug``
(its ``visualize_sharding`` is ``spmd/tensor/_debug.py``'s).

Every eager entry point of the project that runs a compiled program
(``spmd.distributed``'s collectives, ``ProcessGroup`` methods, DTensor's
``redistribute`` / ``full_tensor``) reports the program to :func:`record` just
before running it. Inside ``with CommDebugMode() as mode:`` each report is
counted from the program's compiled HLO (:func:`spmd._inspect.hlo_collectives`),
so the counts are what XLA actually runs, bytes included. Outside any mode,
:func:`record` costs one context-variable read.

Keys are HLO kinds, as :func:`spmd.collectives` returns them: ``"all-reduce"``,
``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``,
``"collective-permute"`` (torch keys its counts by functional-collective ops).
A function decorated with ``@spmd`` is a plain jitted function: count its
collectives with ``spmd.collectives(fn, *args)``.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any, Callable

import jax

from spmd._inspect import KINDS, hlo_collectives
from spmd._x64 import x64_for

__all__ = ["CommDebugMode", "record", "run"]

_ACTIVE: contextvars.ContextVar[tuple["CommDebugMode", ...]] = contextvars.ContextVar("spmd_comm_debug", default=())


def record(where: str, fn: Callable, *args: Any) -> None:
    """Report that ``fn(*args)`` (a jitted program) is about to run, on behalf of ``where``."""
    modes = _ACTIVE.get()
    if not modes or any(isinstance(a, jax.core.Tracer) for a in args):
        return  # nothing to count, or inside a trace (the enclosing program runs, not this one)
    for mode in modes:
        mode._record(where, fn, args)


class CommDebugMode:
    """``with CommDebugMode() as mode: ...`` then ``mode.get_total_counts()``,
    ``mode.get_comm_counts()`` (kind -> count), ``mode.get_comm_bytes()`` (kind -> bytes per
    device), ``mode.log`` (one ``(where, kind, count, bytes)`` per collective-running call),
    ``mode.generate_comm_debug_tracing_table()`` (the log as text). Modes nest; each counts
    what runs inside it."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()
        self._bytes: Counter = Counter()
        self.log: list[tuple[str, str, int, int]] = []
        self._hlo: dict = {}  # (fn, input types) -> counts; this mode's own, dropped with it
        self._token = None

    def __enter__(self) -> "CommDebugMode":
        if self._token is not None:
            raise RuntimeError("CommDebugMode: this mode is already active; use a new CommDebugMode() to nest.")
        self._token = _ACTIVE.set(_ACTIVE.get() + (self,))
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)
        self._token = None

    def _record(self, where: str, fn: Callable, args: tuple) -> None:
        key = (fn, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", None)), getattr(a, "sharding", None))
                         for a in args))
        found = self._hlo.get(key)
        if found is None:
            with x64_for(*args):  # a 64-bit program is lowered as it runs
                found = hlo_collectives(fn.lower(*args).compile().as_text())
            self._hlo[key] = found
        for kind in KINDS:
            n, b = found[kind]["count"], found[kind]["bytes"]
            if n:
                self._counts[kind] += n
                self._bytes[kind] += b
                self.log.append((where, kind, n, b))

    def get_total_counts(self) -> int:
        return sum(self._counts.values())

    def get_comm_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def get_comm_bytes(self) -> dict[str, int]:
        return dict(self._bytes)

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The log as a text table (``noise_level`` is torch's knob; every call is listed here)."""
        w = max([len("call")] + [len(w) for w, _, _, _ in self.log])
        lines = [f"{'call':<{w}}  {'collective':<18}  {'count':>5}  {'bytes':>10}"]
        lines += [f"{c:<{w}}  {k:<18}  {n:>5}  {b:>10}" for c, k, n, b in self.log]
        lines.append(f"total: {self.get_total_counts()} collective(s)")
        return "\n".join(lines)


def run(where: str, fn: Callable, *args: Any) -> Any:
    """Run the compiled program ``fn(*args)`` as every eager entry point does: reported to the
    active :class:`CommDebugMode` (if any), in JAX's x64 mode when an argument is 64-bit."""
    record(where, fn, *args)
    with x64_for(*args):
        return fn(*args)
