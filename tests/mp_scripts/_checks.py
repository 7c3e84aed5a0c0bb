"""The bookkeeping of the multi-process check scripts: each rank records named checks and writes
them to ``OUT_DIR/rank{r}.json``, which the tests read back (``test_launcher.rank_results``)."""

import json
import os
import time
import traceback


class Checks:
    """``check(name, fn)``: ``fn()`` gives ``(got, want)``, compared by ``same(got, want)``; a
    failure or an exception is recorded with ``show(got)`` / the traceback, and the script goes on."""

    def __init__(self, same, show=repr):
        self.same, self.show, self.results = same, show, []

    def __call__(self, name, fn):
        t0 = time.perf_counter()
        try:
            got, want = fn()
            ok = bool(self.same(got, want))
            detail = "" if ok else f"got {self.show(got)} want {self.show(want)}"
        except Exception as e:  # noqa: BLE001 - report, keep going
            ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        self.results.append({"name": name, "ok": ok, "detail": detail, "s": round(time.perf_counter() - t0, 3)})

    def write(self, out_dir, rank):
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(self.results, f)
        print(f"checks done: {sum(r['ok'] for r in self.results)}/{len(self.results)} ok")


def raises(fn, exc, says):
    """A check's ``(got, want)`` for "``fn()`` raises ``exc`` whose message holds ``says``"."""
    try:
        fn()
    except exc as e:
        return says in str(e), True
    return "no error", True
