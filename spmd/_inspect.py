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
_OP = re.compile(r"=\s*(?P<result>\(?[^=]*?\)?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([0-9,]*)\]")


def _bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_COMMENT = re.compile(r"/\*.*?\*/")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


def _group_size(line: str, default: int) -> int:
    """How many ranks take part in each group of the collective on ``line``."""
    m = _GROUPS_LIST.search(line)
    if m:
        return len([r for r in m[1].split(",") if r])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m[2])
    return default


def hlo_collectives(hlo_text: str, *, scalars: bool = True) -> dict[str, dict[str, int]]:
    """Count collectives in HLO text: ``{kind: {"count": n, "bytes": b, "buffers": k}}`` for every kind.

    ``count`` is the collective ops; ``buffers`` the arrays they move (XLA combines independent
    collectives of a kind into one op over several buffers: one count, several buffers).
    ``scalars=False`` leaves out the rank-0 buffers of all-reduces (losses, metrics, norms).

    ``bytes`` is per device, in the nccl-tests convention: the buffer for
    all-reduce, all-to-all and collective-permute, the gathered result for
    all-gather, the input (result times the group size) for reduce-scatter.
    """
    out = {k: {"count": 0, "bytes": 0, "buffers": 0} for k in KINDS}
    m = _PARTITIONS.search(hlo_text)
    n_devices = int(m[1]) if m else 1
    for line in hlo_text.splitlines():
        line = _COMMENT.sub("", line)  # long tuples carry /*index=5*/ markers
        m = _OP.search(line)
        if m is None:
            continue
        kind = m["kind"]
        size_of = m["result"]
        shapes = _SHAPE.findall(m["result"])
        if not scalars and kind == "all-reduce":  # drop rank-0 buffers (loss, metrics, norms' partial sums)
            shapes = [s for s in shapes if s[1]]
            if not shapes:
                continue
            size_of = " ".join(f"{d}[{s}]" for d, s in shapes)
        buffers = max(len(shapes), 1)  # XLA combines independent collectives into one op of many buffers
        if m["start"] and kind in ("all-gather", "collective-permute", "reduce-scatter"):
            # async start ops return (operand, result[, ...]) tuples: count the result.
            size_of = "%s[%s]" % shapes[-1] if shapes else m["result"]
            buffers = 1
        nbytes = _bytes(size_of)
        if kind == "reduce-scatter":
            # Compiled HLO does not print operand shapes: the input is the result times the group size.
            nbytes *= _group_size(line, n_devices)
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
        out[kind]["buffers"] += buffers
    return out


def collectives(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, dict[str, int]]:
    """What ``fn(*args)`` communicates once compiled: count and bytes per collective kind."""
    if not callable(fn):
        raise TypeError(f"collectives: fn={fn!r} is not callable; pass the function, then its arguments.")
    text = jax.jit(fn).lower(*args, **kwargs).compile().as_text()
    return hlo_collectives(text)
