"""The run folder (``--out``): its lock, what a new run may do with what is already there, and the
outputs written at the end (``metrics.json``, ``loss.png``).

- One run at a time: the lead process holds an ``fcntl`` lock on ``<out>/.lock`` for the whole run; a second
  run is refused at once with the holder's PID. The OS drops the lock when the holder exits, however it exits
  (a crash or SIGKILL included), so no stale lock is ever left to clean up.
- A run is never written over unless told: a folder holding checkpoints, an unfinished save, or the outputs
  of a run is refused without ``--resume`` / ``--overwrite``, and each refusal says which of the two applies
  (``--resume`` needs a finished checkpoint; ``--overwrite`` replaces whatever is there).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from dataclasses import dataclass

from models._checkpoint import CheckpointError, scan
from models.train._config import Config

__all__ = ["RunLockedError", "RunLock", "OutFolder", "write_outputs"]

LOCK_NAME = ".lock"
OUTPUTS = ("metrics.json", "loss.png")


class RunLockedError(RuntimeError):
    """Another live run holds the ``--out`` folder."""


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<out>/.lock`` holding the owner's PID; a context manager."""

    def __init__(self, out: str):
        self.path = os.path.join(os.path.abspath(out), LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(
                f"models.train: --out={os.path.dirname(self.path)!r} is in use by another run (PID {holder}, lock "
                f"{self.path!r}); wait for that run to end (or stop it), or choose another --out."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(frozen=True)
class OutFolder:
    """What ``--out`` holds: finished checkpoint steps, unfinished saves, the outputs of a run."""

    out: str
    steps: tuple[int, ...]
    unfinished: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def read(cls, out: str) -> "OutFolder":
        out = os.path.abspath(out)
        steps, unfinished = scan(os.path.join(out, "checkpoints"))
        return cls(out, tuple(steps), tuple(unfinished),
                   tuple(f for f in OUTPUTS if os.path.exists(os.path.join(out, f))))

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.out, "checkpoints")

    def _holds(self) -> str:
        parts = []
        saves = [n for n in self.unfinished if not n.isdigit()]
        deletions = [n for n in self.unfinished if n.isdigit()]  # _checkpoint.interrupted_deletions
        if saves:
            parts.append(f"an unfinished checkpoint save ({', '.join(saves)}: the run stopped while saving)")
        if deletions:
            parts.append(f"a half-deleted checkpoint (step {', '.join(deletions)}: the run stopped while deleting it)")
        if self.outputs:
            parts.append("the outputs of a run (" + ", ".join(self.outputs) + ")")
        return " and ".join(parts)

    def check(self, cfg: Config) -> None:
        """Refuse what would lose a run or cannot work; the advice never points back at the refused choice."""
        if cfg.overwrite:
            return
        if cfg.resume:
            if self.steps:
                return
            if self.unfinished or self.outputs:
                raise CheckpointError(
                    f"models.train: --resume found no checkpoint under {self.checkpoints!r}, only {self._holds()}; "
                    "there is nothing to resume: pass --overwrite instead of --resume to start that run again from "
                    "step 0 (this deletes what is there), or choose another --out."
                )
            raise CheckpointError(
                f"models.train: --resume found no checkpoint under {self.checkpoints!r}; start the run without "
                "--resume, or point --out at the folder of the run to resume."
            )
        if self.steps:
            raise ValueError(
                f"models.train: --out={cfg.out!r} already holds checkpoints ({self.checkpoints}, steps "
                f"{list(self.steps)}); pass --resume to continue that run, --overwrite to replace it, or choose "
                "another --out."
            )
        if self.unfinished or self.outputs:
            raise ValueError(
                f"models.train: --out={cfg.out!r} already holds {self._holds()} but no finished checkpoint; pass "
                "--overwrite to replace it (there is nothing to --resume), or choose another --out."
            )

    def clear(self) -> None:
        """Remove the checkpoints and outputs of the run there (``--overwrite``); the lock file stays."""
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        for f in OUTPUTS:
            path = os.path.join(self.out, f)
            if os.path.exists(path):
                os.remove(path)


def _plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(steps, [h["loss"] for h in history], lw=1)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("train loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [h["accuracy"] for h in history], lw=1, color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train accuracy (target tokens)")
    ax2.set_ylim(0, 1.02)
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: str, summary: dict, title: str) -> None:
    """``metrics.json`` (the summary) and ``loss.png`` (the curves of its history)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if summary["history"]:
        _plot(summary["history"], os.path.join(out, "loss.png"), title)
