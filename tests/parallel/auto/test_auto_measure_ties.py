"""``auto_layout(measure=)``'s pick made stable: measured medians tied within the measurement's noise (the larger
of ``_measure.NOISE`` of the fastest and the standard error of the two medians' difference) go to the simpler layout
(fewer mesh dims over 1, then fewer bytes moved); and the progress names the work before it starts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmd.parallel import Layout
from spmd.parallel.auto import _measure
from spmd.parallel.auto._auto import untraced
from spmd.parallel.auto._budget import _measured
from spmd.parallel.auto._progress import _Lines, now
from spmd.parallel.auto._ranking import AutoLayout


def _cand(layout: Layout, predicted: float, moved: int):
    c = untraced(layout, {"peak": 0}, None)
    total = {"all-gather": {"count": 1, "bytes": moved}}
    return replace(c, predicted_s=predicted, communication={**c.communication, "total": total})


DP = Layout(dp=8)  # 1 mesh dim over 1
FSDP = Layout(fsdp=8, units=("u",))  # 1 mesh dim over 1
TP = Layout(dp=2, fsdp=4, units=("u",))  # 2 mesh dims over 1


def _ranked(times: dict, spreads: dict | None = None) -> list:
    cands = [_cand(TP, 1.0, 100), _cand(FSDP, 1.1, 300), _cand(DP, 1.2, 200)]  # predicted order: TP, FSDP, DP
    spreads = spreads or {}
    return _measured(cands, 3, None, lambda lays: [(times[lay], 10, spreads.get(lay, 0.0)) for lay in lays])


def test_a_tie_within_the_noise_goes_to_the_simpler_layout():
    assert _measure.NOISE == 0.05
    # TP fastest by 4% (< 5%): a tie with both; of the three, DP and FSDP have 1 mesh dim, DP moves fewer bytes
    got = _ranked({TP: 1.00, FSDP: 1.03, DP: 1.04})
    assert [c.layout for c in got] == [DP, FSDP, TP]
    # FSDP 6% over TP (> 5%), DP 3%: TP and DP tie, DP the simpler; FSDP after them
    got = _ranked({TP: 1.00, FSDP: 1.06, DP: 1.03})
    assert [c.layout for c in got] == [DP, TP, FSDP]
    # no tie: the fastest measured first, as before
    got = _ranked({TP: 1.00, FSDP: 1.20, DP: 1.30})
    assert [c.layout for c in got] == [TP, FSDP, DP]
    assert [c.measured_s for c in got] == [1.00, 1.20, 1.30]
    text = AutoLayout(tuple(_ranked({TP: 1.00, FSDP: 1.20, DP: 1.30})), (), None, None).why()
    assert text.startswith(f"{TP.name} wins over {FSDP.name}")


def test_the_medians_error_widens_the_noise():
    # 20% apart: no tie at 5%; medians uncertain by 0.16 s and 0.13 s: their difference's standard error is
    # hypot(0.16, 0.13) = 0.206 s >= 0.20 s, a tie; 0.15 s and 0.12 s: 0.192 s < 0.20 s, none (the sum of the
    # two, 0.27 s, would call it one: a 17% gap between 9%-noisy rounds is not the host's noise)
    times = {TP: 1.00, FSDP: 1.50, DP: 1.20}
    assert [c.layout for c in _ranked(times)] == [TP, DP, FSDP]
    got = _ranked(times, {TP: 0.16, DP: 0.13})
    assert [c.layout for c in got] == [DP, TP, FSDP] and got[0].measured_spread == 0.13
    assert [c.layout for c in _ranked(times, {TP: 0.15, DP: 0.12})] == [TP, DP, FSDP]
    why = AutoLayout(tuple(got), (), None, None).why()
    assert why.startswith(f"dp=8 ties with {TP.name} within the measurement's noise (1200.00 vs 1000.00 ms/step "
                          "measured, within the larger of 5% and the standard error of their medians' difference, "
                          "206.16 ms) and is the simpler: 1 vs 2 mesh dims over 1"), why


def test_measure_layouts_gives_the_standard_error_of_each_median(monkeypatch):
    class Fake:
        def __init__(self, *a, **k):
            self.seconds, self.peak = [], 7

        def round(self, steps):
            self.seconds.append([1.0, 2.0, 3.0, 4.0, 5.0][len(self.seconds) % 5])

    monkeypatch.setattr(_measure, "_Timed", Fake)
    spreads = {}
    got = _measure.measure_layouts(None, None, None, None, None, [], [DP], rounds=5, max_rounds=5, spreads=spreads)
    assert got == [(3.0, 7)]
    # 1..5: sample sd sqrt(2.5); a normal median's standard error sqrt(pi/2) sd / sqrt(n); the rounds' IQR (2.0,
    # the inclusive quartiles 2 and 4) over 1.349 stands for the sd
    assert spreads == {DP: pytest.approx(1.2533141 * 2.0 / 1.349 / 5 ** 0.5, rel=1e-6)}
    assert spreads[DP] == pytest.approx(1.2533141 * 2.5 ** 0.5 / 5 ** 0.5, rel=0.2)  # near the sd-based error


def test_the_progress_names_the_work_before_it_starts(capsys):
    bar = _Lines(3, "auto_layout: hardware=h100")
    now(bar, "compiling fsdp=8")  # counted and shown at once: one line
    now(bar, "compiling dp=8 regather", 0)  # shown, not counted
    err = capsys.readouterr().err.splitlines()
    assert err == ["auto_layout: hardware=h100 [1/3] compiling fsdp=8",
                   "auto_layout: hardware=h100 [1/3] compiling dp=8 regather"]
    tqdm = pytest.importorskip("tqdm")
    import io

    out = io.StringIO()
    bar = tqdm.tqdm(total=3, file=out, mininterval=1e9)  # no refresh by time: only now()'s own
    now(bar, "compiling fsdp=8")
    assert "compiling fsdp=8" in out.getvalue() and "1/3" in out.getvalue()


def test_the_why_of_a_pick_beside_a_faster_uncompiled_estimate_says_it_was_not_compiled():
    # the search's time budget stopped before compiling FSDP, predicted 0.3 s faster than the compiled TP: the pick
    # is TP (its peak compiled and fitting), and the why names the gap the right way round, not "wins by -300 ms"
    tp = replace(_cand(TP, 1.0, 100), measured_peak=2**30)
    fsdp = _cand(FSDP, 0.7, 300)
    text = AutoLayout((tp, fsdp), (), None, None).why()
    assert text.startswith(f"{TP.name} is the fastest compiled candidate that fits; {FSDP.name} is predicted "
                           "300.00 ms/step faster")
    assert "not compiled" in text and "-300" not in text
    # both compiled: the plain comparison, by the positive gap
    text = AutoLayout((replace(fsdp, measured_peak=2**30), tp), (), None, None).why()
    assert text.startswith(f"{FSDP.name} wins over {TP.name} by 300.00 ms/step")
