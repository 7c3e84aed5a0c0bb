"""Placement types: how a tensor is laid out over one mesh dim.

Frozen, hashable values with a machine ``repr`` (``Shard(dim=0)``) and a short
``str`` (``S(0)``, ``R``, ``P(sum)``), as in ``torch.distributed.tensor``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from placements._reduce_op import ReduceOp, as_reduce_op

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "PARTIAL_OPS",
    "format_placements",
    "check_placements",
]

#: The reduce ops a ``Partial`` placement may carry.
PARTIAL_OPS = ("sum", "avg", "max", "min", "product")


class Placement:
    """Base class of ``Shard``, ``Replicate`` and ``Partial``."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, op: str | ReduceOp | None = None) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` is cut into chunks over the mesh dim, as ``torch.chunk`` cuts."""

    dim: int

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard: dim must be an int, got {self.dim!r}; e.g. Shard(0).")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True, init=False)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor."""

    def __init__(self, *args: Any, **kwargs: Any):
        if args or kwargs:
            given = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
            raise TypeError(
                f"Replicate: takes no arguments, got Replicate({given}); write Replicate() (to cut a tensor "
                "dim over the mesh dim, use Shard(dim))."
            )

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a full-shape value; the logical tensor is their reduction."""

    reduce_op: str = "sum"

    def __post_init__(self):
        op = as_reduce_op(self.reduce_op, where="Partial: reduce_op")
        if op.name not in PARTIAL_OPS:
            raise ValueError(
                f"Partial: reduce_op={self.reduce_op!r} cannot be a partial placement; "
                f"use one of {', '.join(repr(o) for o in PARTIAL_OPS)}."
            )
        object.__setattr__(self, "reduce_op", op.name)

    def is_partial(self, op: str | ReduceOp | None = None) -> bool:
        return op is None or as_reduce_op(op).name == self.reduce_op

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


def format_placements(placements: Sequence[Placement]) -> str:
    """``(Shard(0), Replicate())`` -> ``"S(0)R"``."""
    return "".join(str(p) for p in placements)


def check_placements(
    placements: Any, *, mesh_ndim: int, tensor_ndim: int | None, where: str
) -> tuple[Placement, ...]:
    """Validate a placement list and return it as a tuple with non-negative Shard dims.

    A single placement stands for a list of one on a 1-D mesh.
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    if not isinstance(placements, (tuple, list)):
        example = "[Shard(0)]" + (f" + [Replicate()] * {mesh_ndim - 1}" if mesh_ndim > 1 else "")
        raise TypeError(
            f"{where}={placements!r} is not a placement list; pass a list of "
            f"{mesh_ndim} placement(s) such as {example}."
        )
    if len(placements) != mesh_ndim:
        shown = (
            format_placements(placements)
            if placements and all(isinstance(p, Placement) for p in placements)
            else repr(placements)
        )
        raise ValueError(
            f"{where}={shown} "
            f"has {len(placements)} placement(s) but the mesh has {mesh_ndim} dim(s); "
            "give exactly one placement per mesh dim."
        )
    out = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                f"{where}[{i}]={p!r} is not a placement; use Shard(dim), Replicate() or Partial(op)."
            )
        if isinstance(p, Shard) and tensor_ndim is not None:
            if not -tensor_ndim <= p.dim < tensor_ndim:
                lo, hi = -tensor_ndim, tensor_ndim - 1
                fix = f"use a dim in [{lo}, {hi}]" if tensor_ndim else "a 0-d tensor cannot be sharded; use Replicate()"
                raise ValueError(
                    f"{where}[{i}]={p!r} is out of range for a tensor of rank {tensor_ndim}; {fix}."
                )
            p = Shard(p.dim % tensor_ndim)
        out.append(p)
    return tuple(out)
