"""What a compiled program communicates, read from its HLO."""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import numpy as np

__all__ = ["collectives", "hlo_collectives"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_OP = re.compile(r"=\s*(?P<result>\(?[^=]*?\)?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<operands>[^)]*)\)")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([0-9,]*)\]")


def _bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def hlo_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Count collectives in HLO text: ``{kind: {"count": n, "bytes": b}}`` for every kind.

    ``bytes`` is per device, in the nccl-tests convention: the buffer for
    all-reduce, all-to-all and collective-permute, the gathered result for
    all-gather, the input for reduce-scatter.
    """
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    # Long tuples carry "/*index=5*/" comments whose "=" would cut the result shape short.
    hlo_text = _INDEX_COMMENT.sub("", hlo_text)
    for m in _OP.finditer(hlo_text):
        kind = m["kind"]
        size_of = m["operands"] if kind == "reduce-scatter" else m["result"]
        if m["start"] and kind in ("all-gather", "collective-permute"):
            # async start ops return (operand, result[, ...]) tuples: count the result.
            shapes = _SHAPE.findall(m["result"])
            size_of = "%s[%s]" % shapes[-1] if shapes else m["result"]
        out[kind]["count"] += 1
        out[kind]["bytes"] += _bytes(size_of)
    return out


def collectives(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, dict[str, int]]:
    """What ``fn(*args)`` communicates once compiled: count and bytes per collective kind."""
    text = jax.jit(fn).lower(*args, **kwargs).compile().as_text()
    return hlo_collectives(text)
