"""How a collective's result reaches the caller: returned, written into the caller's buffer
as torch does, or held by a :class:`Work`.

torch writes a collective's result into its tensor argument. Here every
collective RETURNS the result, and when the caller's argument is a writable
buffer (a NumPy array, or a CPU ``torch.Tensor`` through its NumPy view) the
result is also written into it, so ``dist.all_reduce(t)`` without ``t =`` works
as in torch, ``async_op=True`` included. A JAX array is immutable: there the
returned value is the only result, and a call whose result is dropped on the
floor (``dist.all_reduce(x)`` as a statement, ``x`` a ``jax.Array``) warns once
per line (the caller's next bytecode is ``POP_TOP``; looked up once per call
site).
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import sys
import warnings
from typing import Any, Callable

import jax
import numpy as np

from spmd._torch import is_torch_tensor, torch_numpy
from spmd.distributed._future import Future

__all__ = ["Work", "maybe_async", "buffer_of", "write_into", "deliver", "DiscardedResultWarning"]


class DiscardedResultWarning(UserWarning):
    """A collective's result was discarded while its input was an immutable JAX array."""


@dataclasses.dataclass
class Work:
    """What ``async_op=True``, ``isend``/``irecv`` and ``batch_isend_irecv`` return.

    ``wait()`` runs whatever is still pending and returns True; ``result()`` is
    ``[tensor]`` (the received tensor for a recv, the collective's result for an
    async collective); ``tensor`` is the same tensor.
    """

    tensor: Any = None
    _flush: Callable[[], None] | None = None  # runs the pending point-to-point ops

    def wait(self, timeout: Any = None) -> bool:
        if self._flush is not None:
            self._flush()
        return True

    def is_completed(self) -> bool:
        return self._flush is None

    def result(self) -> list:
        self.wait()
        return [self.tensor]

    def get_future(self):
        """A ``torch.futures.Future``-like handle: ``.wait()`` / ``.value()`` give ``result()``."""
        return Future.of_work(self)


def maybe_async(result: Any, async_op: bool) -> Any:
    return Work(result) if async_op else result


def buffer_of(x: Any) -> np.ndarray | None:
    """The writable NumPy buffer behind ``x`` (a NumPy array, a CPU torch tensor), or None."""
    if isinstance(x, np.ndarray):
        return x if x.flags.writeable else None
    if is_torch_tensor(x):
        try:
            view = torch_numpy(x)  # a CPU tensor's memory (bfloat16 too); raises for a GPU tensor
        except Exception:
            return None
        return view if view.flags.writeable else None
    return None


@functools.lru_cache(maxsize=4096)
def _pops_result(code, lasti: int) -> bool:
    """Whether the instruction after the call at ``lasti`` in ``code`` discards its result
    (``lasti`` may point into the call's inline cache: take the first instruction after it)."""
    for ins in dis.get_instructions(code):
        if ins.offset > lasti:
            return ins.opname == "POP_TOP"
    return False


def write_into(target: Any, result: Any) -> bool:
    """Write ``result`` into ``target`` if it is a writable buffer of the same shape; whether it was."""
    buf = buffer_of(target)
    if buf is None:
        return False
    value = np.asarray(result)
    if buf.shape != value.shape:
        return False
    np.copyto(buf, value, casting="same_kind")
    return True


def deliver(target: Any, result: Any, where: str, arg: str, depth: int = 3) -> Any:
    """Write ``result`` into ``target`` when it is a writable buffer of the same shape and return
    ``target`` (as torch, whose result is the tensor); otherwise return ``result``, warning when
    ``target`` is a JAX array and the caller (``depth`` frames up: past the collective and its
    ``members_only`` wrapper) drops it."""
    if result is target or write_into(target, result):
        return target
    if isinstance(target, jax.Array):
        frame = sys._getframe(depth)
        if _pops_result(frame.f_code, frame.f_lasti):
            warnings.warn(
                f"{where}: the result was discarded, and {arg} is a jax.Array, which cannot change in place "
                f"(JAX arrays are immutable): write `{arg} = dist.{where}(...)`, or pass a NumPy array to be "
                "updated in place as in torch.",
                DiscardedResultWarning,
                stacklevel=depth + 1,
            )
    return result
