"""A schedule's tick table as the int32 columns the pipelined step indexes by ``axis_index(pp)``.

Per tick and rank, a forward and a backward *branch code* each: 0 idle, ``1 + i`` the forward of role
``ROLES[i]``, ``1 + len(ROLES) + i`` its backward. A stage's role is where its chunk sits: ``first`` (it
runs the code before the units), ``last`` (the code after them and the loss), ``mid``, or ``only`` (one
stage). Beside the codes: the chunk's index on its rank, the micro-batch, the stash slots read, and the
slots a received activation or gradient is written to (``spmd.parallel.pipelining._schedules`` assigns them).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROLES", "tick_tables", "branch_codes"]

ROLES = ("mid", "first", "last", "only")


def tick_tables(pm) -> list[dict]:
    """Per tick, per rank: the forward's ``fcode, fj, fm, fxr`` and the backward's ``bcode, bj, bm, bxr,
    bgr`` (branch code, chunk on the rank, micro-batch, activation and gradient slot; code 0: idle) and the
    receive slots ``rx, rg``; the send pairs ``fwd, bwd``."""
    s = pm.schedule
    pp, n_st = s.pp, s.num_stages
    xs, gs = dict(s.x_slot), dict(s.g_slot)
    kx, kg = max(s.x_slots), max(s.g_slots)
    fwd, bwd = s.sends("F"), s.sends("B")
    out = []
    for t, (frow, brow) in enumerate(zip(s.actions("F"), s.actions("B"))):
        tb = {k: np.zeros(pp, np.int32) for k in ("fcode", "fj", "fm", "fxr", "bcode", "bj", "bm", "bxr", "bgr")}
        tb.update(rx=np.full(pp, kx, np.int32), rg=np.full(pp, kg, np.int32), fwd=fwd[t], bwd=bwd[t])
        for kind, row in (("F", frow), ("B", brow)):
            k = kind.lower()
            for r, a in enumerate(row):
                if a is None:
                    continue
                role = ("only" if n_st == 1 else "first") if a.chunk == 0 else (
                    "last" if a.chunk == n_st - 1 else "mid")
                tb[k + "code"][r] = 1 + ROLES.index(role) + (0 if kind == "F" else len(ROLES))
                tb[k + "j"][r], tb[k + "m"][r] = a.chunk // pp, a.mb
                tb[k + "xr"][r] = xs.get((r, a.chunk, a.mb), kx)
                if kind == "B":
                    tb["bgr"][r] = gs.get((r, a.chunk, a.mb), kg)
                if kind == "F" and a.chunk < n_st - 1:
                    d = (a.chunk + 1) % pp
                    tb["rx"][d] = xs[(d, a.chunk + 1, a.mb)]
                if kind == "B" and a.chunk > 0:
                    d = (a.chunk - 1) % pp
                    tb["rg"][d] = gs[(d, a.chunk - 1, a.mb)]
        out.append(tb)
    return out


def branch_codes(tables: list[dict]) -> list[list[tuple[int, int]]]:
    """Per tick, per rank: ``(forward code, backward code)`` (``spmd.parallel.pipelining._comm.tp_terms``)."""
    return [list(zip(tb["fcode"].tolist(), tb["bcode"].tolist())) for tb in tables]
