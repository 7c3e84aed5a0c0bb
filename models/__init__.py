"""Flax models (plain: the job lays them out with ``spmd.parallel``), tasks and the training job.

``Llama`` / ``LlamaConfig``: a Llama-style decoder written as model code is written outside this project (no
sharding in it), the model of the README's and the docs' "bring your own model" examples.

``MoE`` / ``MoEConfig``: the same decoder with a Mixtral-style mixture of experts (top-2 of 8, capacity
routing) in every other block; ``MoEMLP`` is one block's router and experts.

``python -m models.train`` (or ``spmd-train``) runs the job. Importing this
package does not import JAX (its names load on first use), so the job can set
``XLA_FLAGS`` for 8 CPU fake devices before JAX starts.
"""

from __future__ import annotations

from models._lazy import lazy_names

__all__ = [
    "MLP",
    "Transformer",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "MoEMLP",
    "DigitTask",
    "TextTask",
    "TrainState",
    "batch_placements",
    "transformer_tp_plan",
    "shard_units",
    "layout_model",
    "Checkpointer",
    "CheckpointError",
]

_WHERE = {
    "MLP": "models._mlp",
    "Transformer": "models._transformer",
    "Llama": "models._llama",
    "LlamaConfig": "models._llama",
    "MoE": "models._moe",
    "MoEConfig": "models._moe",
    "MoEMLP": "models._moe",
    "DigitTask": "models._data",
    "TextTask": "models._data",
    "TrainState": "models._ddp",
    "batch_placements": "models._ddp",
    "transformer_tp_plan": "models._plans",
    "shard_units": "models._plans",
    "layout_model": "models._plans",
    "Checkpointer": "models._checkpoint",
    "CheckpointError": "models._checkpoint",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
