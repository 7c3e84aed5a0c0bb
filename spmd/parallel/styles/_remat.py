"""Activation checkpointing as a parallel style: ``ActivationCheckpoint`` wraps its module's call in
``jax.checkpoint``, so the backward pass recomputes the module's forward pass instead of keeping its
activations (torch's ``checkpoint_wrapper`` / composable ``checkpoint(module)``; torchtitan's ``apply_ac``).

``activation_checkpointing(model, units=..., policy=...)`` (``spmd.parallel.styles._transforms``) names the
units; the hooks (``spmd.parallel.styles._hooks``) hand each unit's call to this style's ``run_call``, as they
hand a styled module's to its tensor-parallel style. The policies:

- ``"full"``: the backward pass keeps only the unit's inputs and recomputes its forward pass;
- ``"dots"``: it keeps the matmul outputs too (``jax.checkpoint_policies.dots_saveable``: torchtitan's
  selective op AC) and recomputes the rest (norms, activations, softmax).

Both keep the results of the tensor-parallel collectives (``checkpoint_name`` ``TP_COMM``), so the
recomputation repeats no tp collective. On a ``fully_shard`` unit the unit's style applies the policy
(``spmd.parallel.styles._fully_shard``): its gathers are what ``fully_shard`` says, so the step's
communication is the same with or without checkpointing, and so is every number it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

from spmd.parallel.styles._styles import ParallelStyle
from spmd.parallel.styles._tp_calls import TP_COMM, split_arrays

__all__ = ["ActivationCheckpoint", "POLICIES", "checkpoint_policy"]

POLICIES = {
    "full": "keep each unit's inputs, recompute its forward pass in the backward pass",
    "dots": "keep the matmul outputs too (torchtitan's selective op AC), recompute the rest",
}


_FULL = jax.checkpoint_policies.save_only_these_names(TP_COMM)
_DOTS = jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _FULL)


def checkpoint_policy(policy: str) -> Callable:
    """The ``jax.checkpoint`` policy of ``policy``: its residuals and the tp collectives' results. One object
    per policy (``"dots"`` is also what a re-gathering FSDP unit saves): equal layouts trace equal programs."""
    return _FULL if policy == "full" else _DOTS


@dataclass(frozen=True)
class ActivationCheckpoint(ParallelStyle):
    """The style of one activation-checkpointing unit: its call under ``jax.checkpoint`` with ``policy``'s
    residuals (``"full"`` or ``"dots"``); its parameters as they are."""

    policy: str = "full"

    def run_call(self, call) -> Any:
        params = call.params()
        arrays, rebuild = split_arrays((call.args, call.kwargs))

        def apply(vals, arrays):
            a, k = rebuild(list(arrays))
            return call.apply(vals, a, k, remat=True)

        return jax.checkpoint(apply, policy=checkpoint_policy(self.policy))([v for _, v in params], arrays)
