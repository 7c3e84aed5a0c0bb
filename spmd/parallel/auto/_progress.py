"""``auto_layout``'s progress on stderr: a bar on a terminal (tqdm); elsewhere (a CI log, a pipe) one line per
step, the count and what is being traced, timed or compiled."""

from __future__ import annotations

import sys

__all__ = ["_bar", "now"]


def _bar(total: int | None, desc: str):
    """The search's progress on stderr: a bar on a terminal; elsewhere (a CI log, a pipe) ``_Lines``."""
    if not sys.stderr.isatty():
        return _Lines(total, desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="layout", leave=False, dynamic_ncols=True)


def now(bar, text: str, advance: int = 1) -> None:
    """``bar`` counts ``advance`` more and shows ``text`` at once, before the work it names starts (a postfix set
    with ``refresh=False`` showed only at the next update, after that work): one line off a terminal."""
    bar.set_postfix_str(text, refresh=False)
    if advance:
        bar.update(advance)
    if not isinstance(bar, _Lines) or not advance:
        bar.refresh()


class _Lines:
    """A progress bar off a terminal: one line on stderr per step (``update``) or per refreshed postfix, the
    count and what is being traced, timed or compiled: ``auto_layout on 8 devices: layouts [3/52] tracing
    fsdp=8``."""

    def __init__(self, total: int | None, desc: str):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""

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
        pass
