"""An untraced candidate (its memory lower bound over the budget: no time) in ``AutoLayout.table`` and
``to_json``: said to be over the budget with its bound, never printed as ``inf``; the JSON strict (no Infinity)."""

from __future__ import annotations

import json
import re

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
