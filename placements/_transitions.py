"""The transition table: what one redistribute step from one placement kind to another is.

One :class:`Transition` per legal ``(src, dst)`` pair of placement kinds
(``"S"``, ``"R"``, ``"P(op)"``): the XLA collective it lowers to (None for a
local step), the name of its lowering, how its bytes are counted, and its
traffic. The planner's cost (``placements/_plan.py``), the JAX lowering
(``spmd/tensor/_lower.py``, one function per ``lowering`` name) and the NumPy
simulator (``spmd/testing/_simulate.py``, the same names) all read this table;
a pair absent from it is not a step. Adding a transition is one entry here plus
one lowering function there (and its NumPy mirror).

Bytes per device follow the nccl-tests convention, counted on the padded blocks
(``sb`` before the step, ``sa`` after) over a group of ``k`` devices:

* ``gathered``: all_gather of shards, the gathered result (``sb`` with the
  source dim ``k`` times longer);
* ``stacked``: all_gather of ``k`` whole blocks (a product all-reduce);
* ``split``: all_to_all / reduce_scatter input, the destination dim cut into
  ``k`` chunks of ``sa``;
* ``block``: all_reduce, the block itself.

Traffic (nccl-tests' bus bytes, what a device receives with a ring algorithm)
is ``bytes * (k - 1) / k * ring_passes``: two passes for all_reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from placements._types import Partial, Placement, Replicate, Shard

__all__ = ["Transition", "TRANSITIONS", "LINEAR_OPS", "kind_of", "transition"]

#: Partial ops that commute with each other (torch allows sum and avg together).
LINEAR_OPS = frozenset({"sum", "avg"})


def _gathered(src: Placement, dst: Placement, sb: Sequence[int], sa: Sequence[int], k: int) -> int:
    shape = list(sb)
    shape[src.dim] *= k
    return math.prod(shape)


def _stacked(src: Placement, dst: Placement, sb: Sequence[int], sa: Sequence[int], k: int) -> int:
    return k * math.prod(sb)


def _split(src: Placement, dst: Placement, sb: Sequence[int], sa: Sequence[int], k: int) -> int:
    shape = list(sb)
    shape[dst.dim] = k * sa[dst.dim]
    return math.prod(shape)


def _block(src: Placement, dst: Placement, sb: Sequence[int], sa: Sequence[int], k: int) -> int:
    return math.prod(sb)


@dataclasses.dataclass(frozen=True)
class Transition:
    """One step kind ``src -> dst`` over a group of mesh dims.

    ``collective``: the XLA collective the step lowers to (None: local).
    ``lowering``: the name of its lowering function. ``elements``: the element
    count its collective moves per device (nccl-tests convention), from the
    placements and padded block shapes before and after.
    """

    src: str
    dst: str
    collective: str | None
    lowering: str
    elements: Callable | None = None
    ring_passes: int = 1

    def bytes(self, src: Placement, dst: Placement, sb, sa, k: int, itemsize: int) -> int:
        """Bytes per device (nccl-tests convention); 0 for a local step or a group of one."""
        if self.collective is None or k == 1:
            return 0
        return self.elements(src, dst, sb, sa, k) * itemsize

    def traffic(self, nbytes: int, k: int) -> float:
        """Bus bytes: what a device receives with a ring algorithm."""
        if self.collective is None or k == 1:
            return 0.0
        return nbytes * (k - 1) / k * self.ring_passes


_ENTRIES = (
    Transition("S", "R", "all_gather", "all_gather", _gathered),
    Transition("S", "S", "all_to_all", "all_to_all", _split),
    # S -> P(op): the block at its offset, the op's identity elsewhere (avg goes through R).
    *(Transition("S", f"P({op})", None, "fill_identity") for op in ("sum", "max", "min", "product")),
    Transition("R", "S", None, "slice"),
    # R -> P(op): sum keeps the value on group rank 0, zeros elsewhere; product ones; avg/max/min keep it.
    *(Transition("R", f"P({op})", None, "partition") for op in ("sum", "avg", "max", "min", "product")),
    *(Transition(f"P({op})", "R", "all_reduce", "all_reduce", _block, 2) for op in ("sum", "avg", "max", "min")),
    # No XLA product all-reduce: gather the k blocks and multiply locally.
    Transition("P(product)", "R", "all_gather", "all_reduce", _stacked),
    *(Transition(f"P({op})", "S", "reduce_scatter", "reduce_scatter", _split) for op in ("sum", "avg")),
    # No XLA reduce-scatter for these ops: all_to_all and a local reduction (the same bytes).
    *(Transition(f"P({op})", "S", "all_to_all", "reduce_scatter", _split) for op in ("max", "min", "product")),
)

#: ``(kind_of(src), kind_of(dst)) -> Transition`` for every legal step.
TRANSITIONS: dict[tuple[str, str], Transition] = {(t.src, t.dst): t for t in _ENTRIES}


def kind_of(p: Placement) -> str:
    """The table's name for a placement's kind: ``"S"``, ``"R"`` or ``"P(op)"``."""
    if isinstance(p, Shard):
        return "S"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise TypeError(f"kind_of: {p!r} is not a placement; use Shard(dim), Replicate() or Partial(op).")


def transition(src: Placement, dst: Placement) -> Transition | None:
    """The table's entry for one step ``src -> dst``; None if it is not a step."""
    return TRANSITIONS.get((kind_of(src), kind_of(dst)))
