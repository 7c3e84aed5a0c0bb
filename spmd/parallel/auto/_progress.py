"""``auto_layout``'s progress on stderr: a bar on a terminal (tqdm); elsewhere (a CI log, a pipe) one line per
step, the count and what is being traced, timed or compiled, named before it starts. A bar made ``under=`` a
profile (``spmd.parallel.cost._memory.Profile``) also names what that profile compiles or times for the work
the bar shows (``tracing dp=4,cp=2: compiling its one-device step at 32x8 rows``), until the bar is closed."""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["_bar", "now", "measuring"]


def _bar(total: int | None, desc: str, under: Any = None):
    """The search's progress on stderr: a bar on a terminal; elsewhere (a CI log, a pipe) ``_Lines``;
    ``under``: a profile whose compiles and timings it names under its current work (see the module doc)."""
    if not sys.stderr.isatty():
        bar = _Lines(total, desc)
    else:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="layout", leave=False, dynamic_ncols=True)
    if under is not None:
        under.progress = lambda text: None if getattr(bar, "disable", False) else now(
            bar, f"{getattr(bar, 'doing', '')}: {text}", 0)
    return bar


def now(bar, text: str, advance: int = 1) -> None:
    """``bar`` counts ``advance`` more and shows ``text`` at once, before the work it names starts (a postfix set
    with ``refresh=False`` showed only at the next update, after that work): one line off a terminal. Counted
    work (``advance``) is what the bar is doing, which a profile's reports are named under (``_bar(under=)``)."""
    bar.set_postfix_str(text, refresh=False)
    if advance:
        bar.doing = text
        bar.update(advance)
    if not isinstance(bar, _Lines) or not advance:
        bar.refresh()


def measuring(bar, n: int) -> Callable:
    """``measure_layouts``' progress on ``bar``: each of the ``n`` candidates counted as it is compiled, then
    (``None``) the rounds that time them."""
    return lambda lay: now(bar, "compiling " + lay.name) if lay is not None else now(
        bar, f"timing the {n} side by side, in rounds", 0)


class _Lines:
    """A progress bar off a terminal: one line on stderr per step (``update``) or per refreshed postfix, the
    count and what is being traced, timed or compiled: ``auto_layout on 8 devices: layouts [3/52] tracing
    fsdp=8``."""

    def __init__(self, total: int | None, desc: str):
        self.total, self.desc, self.n, self.postfix, self.disable = total, desc, 0, "", False

    def _line(self) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        print(f"{self.desc} [{count}] {self.postfix}".rstrip(), file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self._line()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._line()

    def refresh(self) -> None:
        self._line()

    def close(self) -> None:
        self.disable = True
