"""Every collective checked across ranks: a fingerprint of the call travels with it.

Before a tensor collective's data moves, every rank of the group contributes a
fingerprint of its call (16 int32: the collective, the op, the root, the other
options, the dtype, the shape and the group's call number) and gathers the
group's, in the same program (gloo: an all-gather of the fingerprints ahead of
the collective, which runs only where they all agree; mpi: an ``MPI_Allgather``
of 64 bytes per rank before the call). Every rank holds the same fingerprints,
so every rank decides alike: where they differ no data moves and each rank
raises a ValueError naming each rank's call, decoded from its fingerprint.
This catches, at any call and not only a group's first, a different op
(``SUM`` on one rank, ``MAX`` on another), dtype, shape, root or collective,
and a rank that skipped or added a call (its call number differs).

On by default; ``init_process_group(check_collectives=False)`` or
``SPMD_CHECK_COLLECTIVES=0`` turns it off. Every rank must agree (a rank that
checks and one that does not would pair a fingerprint with data): the ranks'
settings are compared once, when they join (:func:`agree_on_setting`).
``benchmarks/multiprocess.py --fingerprint`` measures its cost.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from typing import Any

import numpy as np

__all__ = ["WIDTH", "fingerprint", "set_seq", "check", "mismatch_message", "agree_on_setting"]

WIDTH = 16  # int32 per rank
_MAGIC = 0x5350_4D44  # "SPMD": a row without it is not a fingerprint
_MASK = 0x7FFF_FFFF
_DIMS = WIDTH - 9  # dims stored as they are; more are folded into the last slot
# slots: 0 magic, 1 call number, 2 collective, 3 op, 4 root's name, 5 root, 6 other options, 7 dtype, 8 ndim, 9.. dims
_SEQ = 1

_TEXTS: dict[int, str] = {}  # code -> text: what a peer's codes decode to (known names and what this rank saw)


def _code(text: str) -> int:
    c = zlib.crc32(text.encode()) & _MASK or 1
    _TEXTS.setdefault(c, text)
    return c


@functools.lru_cache(maxsize=1)
def _seed() -> None:
    """The names a peer's fingerprint may hold that this rank never used: collectives, ops, dtypes, roots."""
    from placements import ReduceOp

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "scatter", "gather",
                 "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "src", "dst"):
        _code(name)
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        _code(str(getattr(ReduceOp, op)))
    for dt in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
               "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):
        _code(dt)
    for other in ("axis=0, tiled=False", "axis=0, tiled=True", "scatter_dim=0", "concat_axis=0, split_axis=0"):
        _code(other)


def fingerprint(where: str, opts: tuple, shape: tuple, dtype: Any) -> np.ndarray:
    """The call's fingerprint with call number 0 (:func:`set_seq` sets it), a new array; ``opts`` as
    :class:`spmd.distributed._guard.Call` holds them ((name, value) pairs, sorted)."""
    try:
        return _fingerprint(where, opts, tuple(shape), np.dtype(dtype)).copy()
    except TypeError:  # an option that does not hash
        return _fingerprint.__wrapped__(where, opts, tuple(shape), np.dtype(dtype))


@functools.lru_cache(maxsize=1024)
def _fingerprint(where: str, opts: tuple, shape: tuple, dtype: np.dtype) -> np.ndarray:
    fp = np.zeros(WIDTH, np.int32)
    op = root = None
    rest = []
    for k, v in opts:
        if k == "op":
            op = str(v)
        elif k in ("src", "dst"):
            root = (k, int(v))
        else:
            rest.append(f"{k}={v}")
    shape = tuple(int(d) for d in shape)
    fp[0], fp[2] = _MAGIC, _code(where)
    fp[3] = _code(op) if op is not None else 0
    fp[4], fp[5] = (_code(root[0]), root[1]) if root is not None else (0, -1)
    fp[6] = _code(", ".join(rest)) if rest else 0
    fp[7] = _code(np.dtype(dtype).name)
    fp[8] = len(shape)
    dims = [d & _MASK for d in shape[:_DIMS]]
    if len(shape) > _DIMS:
        dims[-1] = _code(str(shape[_DIMS - 1:]))
    fp[9:9 + len(dims)] = dims
    return fp


def set_seq(fp: np.ndarray, seq: int) -> np.ndarray:
    fp[_SEQ] = seq & _MASK
    return fp


def check(seen: np.ndarray, fp: np.ndarray, n: int, where: str, ranks: tuple, group: str, rank: int) -> None:
    """Raise the mismatch's ValueError unless each of the ``n`` rows of ``seen`` is ``fp``."""
    if seen.tobytes() != fp.tobytes() * n:
        raise ValueError(mismatch_message(seen.reshape(n, WIDTH), fp, where, ranks, group, rank))


def _text(c: int, what: str) -> str:
    return _TEXTS.get(int(c), f"<{what} #{int(c)}>")


def _describe(row: np.ndarray) -> str:
    if int(row[0]) != _MAGIC:
        return "no fingerprint (does this rank run with check_collectives=False, or call something else?)"
    parts = []
    if row[3]:
        parts.append(f"op={_text(row[3], 'op')}")
    if row[4]:
        parts.append(f"{_text(row[4], 'root')}={int(row[5])}")
    if row[6]:
        parts.append(_text(row[6], "options"))
    ndim = int(row[8])
    dims = [str(int(d)) for d in row[9:9 + min(ndim, _DIMS)]]
    if ndim > _DIMS:
        dims[-1] = _text(row[-1], "dims")[1:-1]
    shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
    parts += [f"dtype={_text(row[7], 'dtype')}", f"shape={shape}"]
    return f"{_text(row[2], 'collective')}({', '.join(parts)})"


def mismatch_message(rows: np.ndarray, fp: np.ndarray, where: str, ranks: tuple, group: str, rank: int) -> str:
    """Each rank's call (ranks with the same call together), decoded from the group's fingerprints."""
    _seed()
    seq = int(fp[_SEQ])
    calls: dict[str, list[int]] = {}
    for r, row in zip(ranks, rows):
        text = _describe(row)
        if int(row[0]) == _MAGIC and int(row[_SEQ]) != seq:
            text += f" as its call #{int(row[_SEQ])}"
        calls.setdefault(text, []).append(r)
    listing = "; ".join(
        (f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}") + f" called {text}" for text, rs in calls.items()
    )
    return (
        f"{where}: the ranks of {group} disagree on call #{seq} (seen on rank {rank}): {listing}. Every rank of the "
        "group must call the same collectives in the same order, with the same op, src/dst, dtype and shape; no "
        "data was exchanged. (Every call is checked; init_process_group(check_collectives=False) or "
        "SPMD_CHECK_COLLECTIVES=0 turns the check off.)"
    )


_JOINS = itertools.count()  # this process's joins (every rank joins as often): one key space per join


def agree_on_setting(st: Any, where: str) -> None:
    """Compare the ranks' ``check_collectives`` once, as they join (MPI: an allgather; gloo: JAX's
    coordination service); a ValueError on every rank naming who checks and who does not."""
    if st.backend.name == "mpi":
        from spmd.distributed import _mpi

        flags = dict(enumerate(_mpi.MPI.COMM_WORLD.allgather(bool(st.check_collectives))))
    else:
        from jax._src import distributed as jdist

        client = jdist.global_state.client
        base = f"spmd/check_collectives/{next(_JOINS)}"
        client.key_value_set(f"{base}/{st.rank}", "1" if st.check_collectives else "0")
        flags = {st.rank: bool(st.check_collectives)}
        for r in range(st.world_size):
            if r != st.rank:
                flags[r] = client.blocking_key_value_get(f"{base}/{r}", int(st.timeout_s * 1000)) == "1"
    if len(set(flags.values())) > 1:
        on = [r for r, f in sorted(flags.items()) if f]
        off = [r for r, f in sorted(flags.items()) if not f]
        raise ValueError(
            f"{where}: the ranks disagree on check_collectives: ranks {on} check every collective, ranks {off} do "
            "not (init_process_group(check_collectives=...), else SPMD_CHECK_COLLECTIVES); a rank that checks would "
            "pair its fingerprint with another rank's data. Give every rank the same setting."
        )
