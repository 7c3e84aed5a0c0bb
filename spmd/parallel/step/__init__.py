"""The one train step for every layout: ``(state, batch) -> (state, metrics)``, its state and its inverse
(``unshard_params``)."""

from spmd.parallel.step._step import TrainState, init_train_state, make_train_step, unshard_params

__all__ = ["TrainState", "init_train_state", "make_train_step", "unshard_params"]
