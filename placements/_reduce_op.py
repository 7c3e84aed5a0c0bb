"""Reduction operators, named as ``torch.distributed.ReduceOp`` names them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["ReduceOp", "as_reduce_op"]

_NAMES = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_BITWISE = frozenset({"band", "bor", "bxor"})


@dataclasses.dataclass(frozen=True)
class ReduceOp:
    """A reduction operator: ``ReduceOp.SUM``, ``ReduceOp.AVG``, ... as in torch.

    ``ReduceOp.PREMUL_SUM(factor)`` multiplies each rank's input by ``factor``
    before summing (torch's ``_make_nccl_premul_sum``). Anywhere an op is
    accepted, its lower-case name (``"sum"``, ``"max"``, ...) works as well.
    """

    name: str
    factor: float | None = None

    # Class-level constants are filled in below the class body.
    SUM = None  # type: ignore[assignment]
    AVG = None  # type: ignore[assignment]
    PRODUCT = None  # type: ignore[assignment]
    MIN = None  # type: ignore[assignment]
    MAX = None  # type: ignore[assignment]
    BAND = None  # type: ignore[assignment]
    BOR = None  # type: ignore[assignment]
    BXOR = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.name not in _NAMES:
            raise ValueError(
                f"ReduceOp: unknown op name {self.name!r}; use one of {', '.join(_NAMES)}."
            )
        if (self.name == "premul_sum") != (self.factor is not None):
            raise ValueError(
                "ReduceOp: a factor goes with 'premul_sum' and only with it; "
                "write ReduceOp.PREMUL_SUM(factor)."
            )
        if self.factor is not None and not math.isfinite(self.factor):  # and nan would break __eq__ / __hash__
            raise ValueError(
                f"ReduceOp: factor={self.factor!r} is not a finite number; write ReduceOp.PREMUL_SUM(f) with a "
                "finite f, e.g. ReduceOp.PREMUL_SUM(0.5)."
            )

    @staticmethod
    def PREMUL_SUM(factor: float) -> "ReduceOp":  # noqa: N802 - torch's name
        """Sum of ``factor * x`` over ranks."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"ReduceOp.PREMUL_SUM: factor must be a Python number, got {factor!r}; "
                "pass e.g. ReduceOp.PREMUL_SUM(0.5)."
            )
        if not math.isfinite(factor):  # nan or inf: every rank's product is nan (or inf * 0), the sum too
            raise ValueError(
                f"ReduceOp.PREMUL_SUM: factor={factor!r} is not a finite number; the factor multiplies every "
                "rank's input, so pass a finite one, e.g. ReduceOp.PREMUL_SUM(0.5)."
            )
        return ReduceOp("premul_sum", float(factor))

    @property
    def is_bitwise(self) -> bool:
        return self.name in _BITWISE

    def __repr__(self) -> str:
        if self.name == "premul_sum":
            return f"ReduceOp.PREMUL_SUM({self.factor!r})"
        return f"ReduceOp.{self.name.upper()}"

    def __str__(self) -> str:
        return self.name if self.factor is None else f"premul_sum({self.factor:g})"


for _n in _NAMES[:-1]:
    setattr(ReduceOp, _n.upper(), ReduceOp(_n))
del _n


def as_reduce_op(op: Any, *, where: str = "op") -> ReduceOp:
    """Normalise ``op`` (a :class:`ReduceOp` or its name) to a :class:`ReduceOp`."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op.lower()
        if name == "premul_sum":
            raise ValueError(
                f"{where}={op!r} needs a factor; pass ReduceOp.PREMUL_SUM(factor)."
            )
        if name in _NAMES:
            return ReduceOp(name)
        raise ValueError(
            f"{where}={op!r} is not a reduce op; use one of "
            f"{', '.join(repr(n) for n in _NAMES[:-1])} or a ReduceOp."
        )
    raise TypeError(
        f"{where}={op!r} is not a reduce op; pass a ReduceOp (e.g. ReduceOp.SUM) "
        "or its name as a string (e.g. 'sum')."
    )
