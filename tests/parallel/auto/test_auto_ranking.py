"""An untraced candidate (its memory lower bound over the budget: no time) in ``AutoLayout.table`` and
``to_json``: said to be over the budget with its bound, never printed as ``inf``; the JSON strict (no Infinity)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from spmd.parallel import Layout
from spmd.parallel.auto._auto import untraced
from spmd.parallel.auto._ranking import AutoLayout, Candidate
from spmd.parallel.cost._comm import KINDS

GIB = 2**30


def _traced(layout: Layout, seconds: float) -> Candidate:
    zero = {k: {"count": 0, "bytes": 0} for k in KINDS}
    return Candidate(layout=layout, predicted_s=seconds, compute_s=seconds, comm_s={}, dispatch_s=0.0,
                     communication={"parameters": dict(zero), "activations": dict(zero), "total": dict(zero)},
                     memory={"state": GIB // 2, "peak": GIB // 2, "compiled": False}, flops=1.0)


def _ranking() -> AutoLayout:
    over = untraced(Layout(dp=8), {"state": 3 * GIB, "peak": 3 * GIB, "compiled": False}, budget=2 * GIB)
    return AutoLayout((_traced(Layout(fsdp=8, units=("u",)), 0.01), over), budget=2 * GIB)


def test_an_untraced_candidate_is_over_budget_with_its_bound_in_the_table_not_inf():
    table = _ranking().table()
    assert "inf" not in table
    row = next(line for line in table.splitlines() if line.startswith("2 "))
    assert "over budget (bound 3.00 GiB > 2.00 GiB)" in row
    assert re.search(r"dp=8, which is over budget \(bound 3\.00 GiB > 2\.00 GiB\)", table)


def test_to_json_of_an_untraced_candidate_is_strict_json():
    got = _ranking().to_json()
    text = json.dumps(got, allow_nan=False)  # raises on inf / nan
    row = json.loads(text)["candidates"][1]
    assert row["layout"] == "dp=8"
    assert row["predicted_ms"] is None and row["compute_ms"] is None
    assert row["untraced"] == "over budget (bound 3.00 GiB > 2.00 GiB)"
    assert json.loads(text)["candidates"][0]["predicted_ms"] == 10.0


def test_refined_times_the_updates_of_those_that_can_rank_and_keeps_the_full_top_k():
    """``_refined``: each candidate's optimizer update added lazily; its top k equal those of adding every timed
    update (the reference: all added, sorted), with fewer timed."""
    from spmd.parallel.auto._auto import _refined

    rng = np.random.default_rng(0)
    for trial in range(50):
        n, k = int(rng.integers(2, 12)), int(rng.integers(1, 4))
        lays = [Layout(dp=2 ** (i % 4), fsdp=i + 1, units=("u",)) for i in range(n)]
        partial = rng.uniform(0.01, 0.05, n)
        timed_s, untimed_s = rng.uniform(0.0, 0.02, n), rng.uniform(0.0, 0.02, n)
        full = sorted(range(n), key=lambda i: partial[i] + timed_s[i])
        calls = []
        pending = {lay: (lambda timed, i=i: (calls.append(i) if timed else None) or (timed_s[i] if timed
                                                                                   else untimed_s[i]))
                   for i, lay in enumerate(lays)}
        got = _refined([_traced(lay, p) for lay, p in zip(lays, partial)], k, pending, lambda c: None)
        top = [lays.index(c.layout) for c in got[:k]]
        assert top == full[:k], trial
        for c in got[:k]:
            i = lays.index(c.layout)
            assert c.predicted_s == pytest.approx(partial[i] + timed_s[i])
        assert not pending and len(calls) == len(set(calls)) and len(calls) >= min(k, n)
        rest = {lays.index(c.layout) for c in got[k:]}
        for c in got[k:]:  # the rest priced with the untimed estimate where not timed
            i = lays.index(c.layout)
            assert c.predicted_s == pytest.approx(partial[i] + (timed_s[i] if i in calls else untimed_s[i]))
        assert rest | set(top) == set(range(n))
    # a case where the bound prunes: the partial times far apart
    lays = [Layout(dp=8), Layout(fsdp=8, units=("u",)), Layout(dp=2, fsdp=4, units=("u",))]
    calls = []
    pending = {lay: (lambda timed, i=i: (calls.append(i) if timed else None) or 0.001) for i, lay in enumerate(lays)}
    _refined([_traced(lay, p) for lay, p in zip(lays, (0.01, 0.1, 0.2))], 1, pending, lambda c: None)
    assert calls == [0]
