"""Flax models, the data-parallel train step and the training job.

``python -m models.train`` (or ``spmd-train``) runs the job. Importing this
package does not import JAX (its names load on first use), so the job can set
``XLA_FLAGS`` for 8 CPU fake devices before JAX starts.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
