"""The one train step for every layout: ``(state, batch) -> (state, metrics)`` as a ``TrainStep``, its state
and its inverse (``unshard_params``); ``OwnsTrainStep``, the protocol of a layout that brings its own."""

from spmd.parallel.step._protocol import OwnsTrainStep, StepMemory, TrainStep
from spmd.parallel.step._state import TrainState, init_train_state, unshard_params
from spmd.parallel.step._step import make_train_step

__all__ = ["TrainState", "TrainStep", "StepMemory", "OwnsTrainStep", "init_train_state", "make_train_step",
           "unshard_params"]
