"""How a rank ends on failure, and how ``spmdrun`` tells the cause from its victims.

The protocol, shared by the ranks and the launcher:

* A rank whose failure was caused by another rank (a peer died, did not arrive
  at a collective within the timeout, or called a different collective) raises
  :class:`PeerError`, or is ended by :func:`fail` with ``peer=True``; either
  way its process exits with :data:`PEER_EXIT_CODE`.
* Any other uncaught exception ends the rank with exit code 1, at once
  (:func:`install_excepthook`), skipping JAX's exit barrier, so that the
  others see it die instead of waiting for it.
* A rank that gives up waiting for others at a collective prints
  :func:`absent_line` (naming them) before it ends.
* ``spmdrun`` blames the first rank that did not exit with
  :data:`PEER_EXIT_CODE`; when every failed rank is a victim, it blames the
  ranks the victims named as absent (else the ranks still running), saying
  whether each is stopped, running or dead.
"""

from __future__ import annotations

import os
import sys
import time

from spmd.distributed._state import current

__all__ = [
    "PEER_EXIT_CODE",
    "ABSENT_MARKER",
    "PeerError",
    "absent_line",
    "parse_absent",
    "exit_code_for",
    "fail",
    "install_excepthook",
]

#: Exit code of a rank that ends because of another rank (EX_PROTOCOL in sysexits.h).
PEER_EXIT_CODE = 76
#: Starts the line a rank prints when it gives up on ranks that did not arrive at a collective.
ABSENT_MARKER = "spmd.distributed: ranks that did not arrive:"


def absent_line(ranks: list[int]) -> str:
    """The line naming the ranks that did not arrive (``spmdrun`` blames them)."""
    return f"{ABSENT_MARKER} {' '.join(map(str, ranks))}"


def parse_absent(line: str) -> list[int]:
    """The ranks named by an :func:`absent_line` in ``line`` (possibly prefixed); [] otherwise."""
    _, sep, rest = line.partition(ABSENT_MARKER)
    if not sep:
        return []
    return [int(t) for t in rest.split() if t.isdigit()]


class PeerError(RuntimeError):
    """This rank's collective failed because of another rank: it died, did not arrive
    within the timeout, or called a different collective. The message names the
    collective, the group and the ranks concerned."""


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a rank ended by the uncaught ``exc``."""
    return PEER_EXIT_CODE if isinstance(exc, PeerError) else 1


def fail(message: str, code: int = 1, linger_s: float = 0.0) -> None:
    """Print ``message`` and end this process (after ``linger_s`` seconds), skipping JAX's exit barrier."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    spawn = sys.modules.get("spmd._spawn")
    if spawn is not None:  # the stdout filter's last lines (quiet_rank_output), before the process ends
        try:
            spawn.drain_stdout()
        except Exception:
            pass
    if linger_s > 0:
        time.sleep(linger_s)
    os._exit(code)


def install_excepthook() -> None:
    """An uncaught exception ends the process at once (after printing it), so that
    the other ranks see it die instead of waiting for it at JAX's exit barrier."""
    if getattr(sys.excepthook, "_spmd", False):
        return
    previous = sys.excepthook

    def hook(etype, value, tb):
        previous(etype, value, tb)
        st = current()
        if st is not None and st.multiprocess:
            fail(f"spmd.distributed: rank {st.rank} raised {etype.__name__}; ending this rank now.", exit_code_for(value))

    hook._spmd = True  # type: ignore[attr-defined]
    sys.excepthook = hook
