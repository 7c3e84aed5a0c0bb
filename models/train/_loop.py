"""The training loop: steps, metric reads, checkpoints and Ctrl-C, with the metric state in one object.

Metrics stay on the devices until ``MetricLog.flush`` reads a group of them at once (every ``--log-every``
steps, before a save and at the end), so the loop does not wait on the devices at each step.
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import sys
import threading
import time
from typing import Any, Callable

import jax

from models._checkpoint import Checkpointer

__all__ = ["MetricLog", "train_loop", "progress_bar", "LineProgress", "NonFiniteError"]


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was not finite: the run stopped there, saving nothing after it."""

    def __init__(self, message: str, *, step: int, loss: float, grad_norm: float):
        super().__init__(message)
        self.step, self.loss, self.grad_norm = step, loss, grad_norm


class LineProgress:
    """The progress bar where stderr is not a terminal (a pipe, a log file, ``spmdrun``): whole lines, about
    ``lines`` of them over the run, instead of a bar redrawn with ``\\r`` that other lines would be glued to.
    Takes the calls the loop makes on a tqdm bar (``update``, ``set_postfix``, ``close``)."""

    def __init__(self, *, total: int, initial: int = 0, stream: Any = None, lines: int = 10):
        self.total, self.n, self.stream = total, initial, stream
        self._every = max(1, -(-(total - initial) // lines))
        self._first = initial
        self._postfix: dict = {}

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self._postfix = values

    def due(self, n: int) -> bool:
        """Whether the update to step ``n`` prints a line (the loop reads that step's metrics first)."""
        return (n - self._first) % self._every == 0 or n >= self.total

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.due(self.n):
            shown = " ".join(f"{k}={v}" for k, v in self._postfix.items())
            print(f"models.train: step {self.n}/{self.total} {shown}".rstrip(), file=self.stream or sys.stderr,
                  flush=True)

    def close(self) -> None:
        pass


def progress_bar(*, total: int, initial: int, desc: str, stream: Any = None) -> Any:
    """A tqdm bar on a terminal, else a ``LineProgress``."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, unit="step", desc=desc, dynamic_ncols=True, file=stream)
    return LineProgress(total=total, initial=initial, stream=stream)


class MetricLog:
    """The loop's metric state: per-step history, metrics not read yet, throughput, the progress bar.

    Throughput counts whole windows between reads and leaves out the first step of the run (it compiles) and
    the time between a read and the next step that is no step's (a checkpoint's save, the ``on_step`` hook).
    """

    def __init__(self, *, start: int, batch_size: int, history: list[dict], bar: Any = None,
                 stop_nonfinite: bool = False):
        self.start = start
        self.stop_nonfinite = stop_nonfinite  # flush raises NonFiniteError at a non-finite loss or grad norm
        self.batch_size = batch_size
        self.history = history
        self.bar = bar
        self._pending: list[tuple[int, dict]] = []
        self._t_window = time.perf_counter()
        self._n_window = 0
        self._timed_steps = 0
        self._timed_time = 0.0
        self._window_step_s: list[float] = []  # seconds per step of each timed window
        self.last_samples_per_s = float("nan")

    def add(self, step: int, metrics: dict) -> None:
        """Record the (device) metrics of ``step``; nothing is read from the devices here."""
        self._pending.append((step, metrics))
        self._n_window += 1

    def flush(self) -> None:
        """Read the pending metrics into the history and update the throughput and the bar."""
        if not self._pending:
            return
        got = jax.device_get([m for _, m in self._pending])
        for (s, _), m in zip(self._pending, got):
            self.history.append({"step": s, **{k: float(v) for k, v in m.items()}})
            h = self.history[-1]
            if self.stop_nonfinite and not all(math.isfinite(h.get(k, 0.0)) for k in ("loss", "grad_norm")):
                self._pending.clear()
                raise NonFiniteError(f"models.train: step {s} has a non-finite loss ({h['loss']}) or gradient norm "
                                     f"({h.get('grad_norm')})", step=s, loss=h["loss"],
                                     grad_norm=h.get("grad_norm", math.nan))
        now = time.perf_counter()
        if self._n_window and self._pending[0][0] > self.start + 1:  # the first step compiles: not counted
            self.last_samples_per_s = self._n_window * self.batch_size / (now - self._t_window)
            self._timed_steps += self._n_window
            self._timed_time += now - self._t_window
            self._window_step_s.append((now - self._t_window) / self._n_window)
        self._t_window, self._n_window = now, 0
        self._pending.clear()
        if self.bar is not None:
            last = self.history[-1]
            rate = {} if math.isnan(self.last_samples_per_s) else {"samples_s": f"{self.last_samples_per_s:,.0f}"}
            self.bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['accuracy']:.3f}", **rate, refresh=False)

    def restart_window(self) -> None:
        """Start the window's clock again after time that is no step's (a save, the ``on_step`` hook), when
        nothing is pending (the last flush waited for the steps): the next window times steps alone."""
        if not self._pending:
            self._t_window = time.perf_counter()

    @property
    def samples_per_s(self) -> float | None:
        """Mean throughput over the timed windows (None if none was timed)."""
        return self._timed_steps * self.batch_size / self._timed_time if self._timed_time else None

    @property
    def step_s(self) -> float | None:
        """The median over the timed windows of their seconds per step (None if none was timed)."""
        return statistics.median(self._window_step_s) if self._window_step_s else None

    @property
    def timed_windows(self) -> int:
        return len(self._window_step_s)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_loop(state: Any, *, start: int, steps: int, log_every: int, train_step: Callable,
               next_batch: Callable[[int], Any], log: MetricLog, checkpointer: Checkpointer,
               meta: Callable[[], dict], on_step: Callable | None, interrupted: Callable[[int], None],
               checkpoint: Callable[[Any], Any] = lambda state: state) -> Any:
    """Run steps ``start + 1 .. steps``; returns the final state (``checkpoint(state)``: what a save writes).

    ``next_batch(step)`` gives the placed batch of ``step`` (0-based). Saves every ``save_every`` steps
    and at the end; on ``KeyboardInterrupt`` (Ctrl-C, or raised by ``on_step``) saves the last finished
    step, calls ``interrupted(step)`` and re-raises (a Ctrl-C during a step: once the step has returned its
    state, since the step deletes the state it is passed). The metrics are read before each save: with
    ``log.stop_nonfinite``, a non-finite loss or gradient norm raises ``NonFiniteError`` there, nothing saved
    after that step (the saves before it finished first).
    """
    step = start
    try:
        while step < steps:
            batch = next_batch(step)
            with _ctrl_c_held():  # the step deletes the state passed in (donated): hold Ctrl-C till the new one
                state, metrics = train_step(state, batch)
                step += 1
                log.add(step, metrics)
            due = getattr(log.bar, "due", None)  # a progress line at this step: it shows this step's metrics
            if step == start + 1 or step % log_every == 0 or step == steps or (due is not None and due(step)):
                log.flush()
            if log.bar is not None:
                log.bar.update(1)
            if step % checkpointer.save_every == 0 or step == steps:
                log.flush()
                checkpointer.save(step, checkpoint(state), meta(), force=step == steps)
            if on_step is not None:
                on_step(step, state)
            log.restart_window()
    except NonFiniteError:
        checkpointer.wait()
        log.close()
        raise
    except KeyboardInterrupt:
        log.flush()
        checkpointer.save(step, checkpoint(state), meta(), force=True)
        checkpointer.wait()
        log.close()
        interrupted(step)
        raise
    log.flush()
    log.close()
    return state


@contextlib.contextmanager
def _ctrl_c_held():
    """Ctrl-C (SIGINT) held while a step runs and its new state is taken, then raised: the job's step donates
    the state it is passed (its buffers deleted), so an interrupt between the call and the assignment would
    leave no state to save. Only where Python's own handler is installed, in the main thread (a handler of the
    caller's is left as it is)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got: list = []
    previous = signal.signal(signal.SIGINT, lambda *_: got.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt


def report(message: str, lead: bool) -> None:
    """A line on stderr from the lead process."""
    if lead:
        print(message, file=sys.stderr)
