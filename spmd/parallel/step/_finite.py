"""``check_finite``: a step whose loss or gradient norm is not finite keeps the state it was given
(``_keep_finite``, a select inside the jitted step) and, with ``True``, raises after it (``_raise_nonfinite``);
``_FiniteChecked`` adds both to the step of a layout that owns its step (a pipeline)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmd.parallel.step._protocol import TrainStep
from spmd.parallel.step._state import TrainState


def _keep_finite(old: TrainState, new: TrainState, metrics: dict) -> tuple[TrainState, dict]:
    """``new`` where the step's loss and gradient norm are finite, else ``old``'s params, opt_state and
    batch_stats (its ``step`` advanced); ``metrics["nonfinite"]``: 1.0 where the update was skipped."""
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    params, opt_state, stats = jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                            (new.params, new.opt_state, new.batch_stats),
                                            (old.params, old.opt_state, old.batch_stats))
    return (new.replace(params=params, opt_state=opt_state, batch_stats=stats),
            {**metrics, "nonfinite": (~finite).astype(jnp.float32)})


def _raise_nonfinite(state: TrainState, metrics: dict) -> None:
    """``check_finite=True``: a ``FloatingPointError`` where the step's ``metrics["nonfinite"]`` is set."""
    if bool(metrics["nonfinite"]):
        n = int(jax.device_get(state.step)) + 1
        loss, norm = (float(metrics[k]) for k in ("loss", "grad_norm"))
        raise FloatingPointError(
            f"train_step: step {n} (from state.step={n - 1}) has a non-finite loss ({loss}) or gradient norm "
            f"({norm}); its update was not applied and the state passed in is intact. Look at that step's batch "
            "and the learning rate (or clip the gradients), or use make_train_step(..., check_finite='skip') "
            "to skip such steps' updates and go on.")


class _FiniteChecked(TrainStep):
    """An ``OwnsTrainStep`` layout's step with ``check_finite``: its update kept only where the loss and gradient
    norm are finite (``_keep_finite``, jitted after the step), and with ``True`` a ``FloatingPointError`` on a
    non-finite step; everything else is the step's own (its ``lower``, ``table``, ``schedule``, ...)."""

    def __init__(self, step: TrainStep, check_finite: bool | str):
        self._step, self._check_finite, self._keep = step, check_finite, jax.jit(_keep_finite)

    def __getattr__(self, name: str) -> Any:  # only for names not found on the class or the instance
        if name.startswith("__") or name == "_step":
            raise AttributeError(name)
        return getattr(self._step, name)

    def __repr__(self) -> str:
        return f"{self._step!r} (check_finite={self._check_finite!r})"

    def __call__(self, state: TrainState, batch: Any):
        new, metrics = self._keep(state, *self._step(state, batch))
        if self._check_finite is True:
            _raise_nonfinite(state, metrics)
        return new, metrics

    def lower(self, state, batch):
        return self._step.lower(state, batch)

    def compiled(self, state, batch):
        return self._step.compiled(state, batch)

    def communication(self, state, batch) -> dict:
        return self._step.communication(state, batch)

    def table(self, state, batch) -> str:
        return self._step.table(state, batch)
