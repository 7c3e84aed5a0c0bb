"""Built-in training data, deterministic from ``(seed, step)``.

The data order is part of the training state: batch ``step`` of a run with
``seed`` is always the same array, so a run resumed from a checkpoint at step
``k`` sees exactly the batches an uninterrupted run would have seen.

Every batch is a dict of NumPy arrays with a leading batch dim:
``inputs`` (int32 tokens), ``targets`` (int32) and ``mask`` (float32, 1 where a
target counts). Two layouts:

- ``"lm"`` (the transformer): next-token prediction, ``inputs`` and ``targets``
  of shape ``(B, T)``.
- ``"window"`` (the MLP): a fixed window in, ``targets`` of shape ``(B, T_out)``.

Every example carries the same number of counted targets, so the mean loss of
a batch is the mean of its examples' losses (what data parallelism averages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["DigitTask", "TextTask", "LAYOUTS"]

LAYOUTS = ("lm", "window")
_TRAIN, _EVAL = 0, 1


def _check_layout(layout: str, where: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout={layout!r} is unknown; use one of {LAYOUTS}.")


def _check_batch(batch_size, where: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"{where}: batch_size={batch_size!r} must be an int.")
    if batch_size < 1:
        raise ValueError(f"{where}: batch_size={batch_size!r} must be >= 1.")
    return int(batch_size)


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(stream), int(step)])


@dataclass(frozen=True)
class DigitTask:
    """Sort (``op="sort"``) or reverse (``op="reverse"``) ``length`` random digits.

    Language-model layout: the sequence ``d_1 .. d_L SEP a_1 .. a_L`` (``SEP`` is
    token 10, ``a`` the answer); the model reads it left to right and is scored
    on the ``L`` answer digits. Window layout: ``d_1 .. d_L`` in, ``a_1 .. a_L`` out.
    """

    op: str = "sort"
    length: int = 8

    SEP = 10
    VOCAB = 11
    OPS = ("sort", "reverse")

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise ValueError(f"DigitTask: op={self.op!r} is unknown; use one of {self.OPS}.")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"DigitTask: length={self.length!r} must be an int >= 1.")

    @property
    def name(self) -> str:
        return f"{self.op} {self.length} digits"

    @property
    def vocab_size(self) -> int:
        return self.VOCAB

    def seq_len(self, layout: str) -> int:
        """Input positions the model sees."""
        _check_layout(layout, "DigitTask.seq_len")
        return 2 * self.length if layout == "lm" else self.length

    def out_len(self, layout: str) -> int:
        """Target positions per example."""
        _check_layout(layout, "DigitTask.out_len")
        return 2 * self.length if layout == "lm" else self.length

    def digits(self, seed: int, step: int, batch_size: int, *, stream: int = _TRAIN) -> np.ndarray:
        b = _check_batch(batch_size, "DigitTask.digits")
        return _rng(seed, step, stream).integers(0, 10, size=(b, self.length), dtype=np.int32)

    def answer(self, digits: np.ndarray) -> np.ndarray:
        return np.sort(digits, axis=1) if self.op == "sort" else np.ascontiguousarray(digits[:, ::-1])

    def batch(self, seed: int, step: int, batch_size: int, layout: str = "lm", *, stream: int = _TRAIN) -> dict:
        """Batch number ``step`` of the run seeded ``seed`` (``stream=1`` gives held-out data)."""
        _check_layout(layout, "DigitTask.batch")
        d = self.digits(seed, step, batch_size, stream=stream)
        ans = self.answer(d)
        b, n = d.shape
        if layout == "window":
            return {"inputs": d, "targets": ans, "mask": np.ones((b, n), np.float32)}
        seq = np.concatenate([d, np.full((b, 1), self.SEP, np.int32), ans], axis=1)
        mask = np.zeros((b, 2 * n), np.float32)
        mask[:, n:] = 1.0
        return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "mask": mask}


@dataclass(frozen=True)
class TextTask:
    """Byte-level language modelling on a text file: random windows of ``context`` bytes.

    The last tenth of the file is held out for evaluation (``stream=1``).
    """

    path: str
    context: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"TextTask: path={self.path!r} must be a path to a text file.")
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"TextTask: path={os.fspath(self.path)!r} does not exist or is not a file; give an existing text "
                "file (e.g. --text README.md)."
            )
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"TextTask: context={self.context!r} must be an int >= 1.")
        size = os.path.getsize(self.path)
        if size < 10 * (self.context + 1):
            raise ValueError(
                f"TextTask: {os.fspath(self.path)!r} has {size} bytes, too few for windows of context="
                f"{self.context} (needs at least {10 * (self.context + 1)}); use a larger file or a smaller context."
            )

    @property
    def name(self) -> str:
        return f"text {os.path.basename(os.fspath(self.path))}"

    @property
    def vocab_size(self) -> int:
        return 256

    def seq_len(self, layout: str) -> int:
        _check_layout(layout, "TextTask.seq_len")
        return self.context

    def out_len(self, layout: str) -> int:
        _check_layout(layout, "TextTask.out_len")
        return self.context if layout == "lm" else 1

    def _bytes(self) -> np.ndarray:
        data = self.__dict__.get("_data")
        if data is None:
            with open(self.path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int32)
            object.__setattr__(self, "_data", data)
        return data

    def batch(self, seed: int, step: int, batch_size: int, layout: str = "lm", *, stream: int = _TRAIN) -> dict:
        _check_layout(layout, "TextTask.batch")
        b = _check_batch(batch_size, "TextTask.batch")
        data = self._bytes()
        split = len(data) * 9 // 10
        lo, hi = (0, split) if stream == _TRAIN else (split, len(data))
        hi = max(hi - self.context - 1, lo + 1)
        starts = _rng(seed, step, stream).integers(lo, hi, size=b)
        w = data[starts[:, None] + np.arange(self.context + 1)]
        if layout == "window":
            return {"inputs": w[:, :-1], "targets": w[:, -1:], "mask": np.ones((b, 1), np.float32)}
        return {"inputs": w[:, :-1], "targets": w[:, 1:], "mask": np.ones((b, self.context), np.float32)}
