"""The train step's declared protocols: ``TrainStep`` (what ``make_train_step`` returns) and ``OwnsTrainStep``
(a layout that brings its own state and step, as ``PipelineModule`` does), and ``StepMemory``, the one reader of
a compiled step's ``memory_analysis()``.

This module imports nothing of the library: the transforms (``spmd.parallel.styles``) refuse a layout that
owns its step by this protocol, below the step's own package.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

__all__ = ["StepMemory", "TrainStep", "OwnsTrainStep"]


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of a compiled step, as XLA's ``compiled.memory_analysis()`` counts them.

    ``argument`` (the state and batch it takes), ``output`` (the state and metrics it returns), ``temp`` (its
    temporaries: activations, gathered parameters, gradients), ``alias`` (outputs written into an argument's
    buffer); ``peak = argument + output + temp - alias``, the most the step holds at once.
    """

    argument: int
    output: int
    temp: int
    alias: int

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @classmethod
    def from_compiled(cls, compiled: Any) -> "StepMemory":
        """The figures of ``compiled`` (a ``jax.stages.Compiled``)."""
        m = compiled.memory_analysis()
        if m is None:  # JAX: "None if unavailable, e.g. based on backend, compiler, or runtime"
            raise ValueError(f"StepMemory.from_compiled: compiled={type(compiled).__name__}.memory_analysis() is None: "
                             "this backend or compiler gives no memory analysis; read the memory on a backend "
                             "that does (CPU, GPU, TPU under XLA).")
        return cls(*(int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")))

    def as_dict(self) -> dict:
        """``{"argument", "output", "temp", "alias", "peak"}``: bytes per device."""
        return {**dataclasses.asdict(self), "peak": self.peak}


class TrainStep(abc.ABC):
    """A train step ``(state, batch) -> (state, metrics)``: what ``make_train_step`` returns, for every layout.

    Everything about the step can be read for a ``(state, batch)`` before it runs:

    - ``lower(state, batch)``: the jitted step lowered (``.as_text()``: its StableHLO; ``.compile()``);
    - ``compiled(state, batch)``: the step compiled (``.as_text()``: the HLO XLA runs, its collectives);
    - ``memory(state, batch)``: the compiled step's bytes per device (a ``StepMemory``);
    - ``communication(state, batch)``: what one step communicates per device, analytically, nothing compiled;
    - ``table(state, batch)``: the parameter plan and that communication, printable.

    A layout that owns its step (``OwnsTrainStep``) returns a subclass: it implements the call, ``lower``,
    ``communication`` and ``table``; ``compiled`` and ``memory`` follow from ``lower``.
    """

    @abc.abstractmethod
    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One step: the new state and the step's metrics (``loss``, ``grad_norm``, the loss's aux)."""

    @abc.abstractmethod
    def lower(self, state: Any, batch: Any) -> Any:
        """The jitted step lowered for ``(state, batch)`` (a ``jax.stages.Lowered``)."""

    @abc.abstractmethod
    def communication(self, state: Any, batch: Any) -> dict:
        """What one step communicates per device, by collective kind, read from the layout (nothing compiled)."""

    @abc.abstractmethod
    def table(self, state: Any, batch: Any) -> str:
        """The plan and the step's communication, printable before anything runs."""

    def compiled(self, state: Any, batch: Any) -> Any:
        """The step compiled for ``(state, batch)`` (a ``jax.stages.Compiled``)."""
        return self.lower(state, batch).compile()

    def memory(self, state: Any, batch: Any) -> StepMemory:
        """The compiled step's bytes per device (``compiled(state, batch).memory_analysis()``)."""
        return StepMemory.from_compiled(self.compiled(state, batch))


class OwnsTrainStep(abc.ABC):
    """A layout that brings its own train state and step; ``PipelineModule`` is one.

    ``init_train_state(model, ...)``, ``make_train_step(model, ...)`` and ``unshard_params(model, ...)`` hand a
    model that is an instance of this class to its methods of the same names (after checking the arguments
    they share), instead of laying it out themselves; ``parallelize_module`` and ``fully_shard`` refuse it
    (apply them to the model before such a layout wraps it). Subclass it, or ``OwnsTrainStep.register(cls)``.
    """

    @abc.abstractmethod
    def init_train_state(self, optimizer: Any, *init_args: Any, params: Any = None, mesh: Any = None) -> Any:
        """Step 0 (a ``TrainState``), as ``spmd.parallel.init_train_state`` documents its arguments."""

    @abc.abstractmethod
    def make_train_step(self, loss_fn: Callable, optimizer: Any, *, accum_steps: int = 1,
                        mesh: Any = None, check_finite: bool | str = False) -> TrainStep:
        """The layout's ``TrainStep``, as ``spmd.parallel.make_train_step`` documents its arguments.

        ``check_finite`` (False, ``"skip"`` or True) is passed only when set; a layout whose ``make_train_step``
        takes no ``check_finite`` gets its step wrapped instead (the keep-or-drop then runs as a second jitted
        program after the step, holding both states at once)."""

    @abc.abstractmethod
    def unshard_params(self, params: Any) -> Any:
        """The model's own (logical, replicated) parameters from a state's ``params`` (or the ``TrainState``)."""
