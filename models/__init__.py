"""Flax models, the data-parallel train step and the training job.

``python -m models.train`` (or ``spmd-train``) runs the job. Importing this
package does not import JAX (its names load on first use), so the job can set
``XLA_FLAGS`` for 8 CPU fake devices before JAX starts.
"""

from __future__ import annotations

from models._lazy import lazy_names

__all__ = [
    "MLP",
    "Transformer",
    "DigitTask",
    "TextTask",
    "TrainState",
    "init_train_state",
    "make_train_step",
    "batch_placements",
    "make_fsdp_train_step",
    "shard_train_state",
    "Checkpointer",
    "CheckpointError",
]

_WHERE = {
    "MLP": "models._mlp",
    "Transformer": "models._transformer",
    "DigitTask": "models._data",
    "TextTask": "models._data",
    "TrainState": "models._ddp",
    "init_train_state": "models._ddp",
    "make_train_step": "models._ddp",
    "batch_placements": "models._ddp",
    "make_fsdp_train_step": "models._fsdp",
    "shard_train_state": "models._fsdp",
    "Checkpointer": "models._checkpoint",
    "CheckpointError": "models._checkpoint",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
