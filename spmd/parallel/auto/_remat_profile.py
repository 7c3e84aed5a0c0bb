"""The cost of activation checkpointing, for ``auto_layout``: the user's step with its blocks recomputed, on one device.

What checkpointing saves is what XLA's scheduler lets it save, and that differs by backend: XLA:CPU's default
(concurrency-optimized) scheduler hoists the recomputation back beside the forward pass, and a checkpointed
step there holds about what the plain one does (with ``--xla_cpu_enable_concurrency_optimized_scheduler=false``,
or on an accelerator, it holds less). So the saving is not modelled but measured: ``RematProfile`` compiles
the step ``make_train_step`` builds for ``activation_checkpointing(model, units=, policy=)`` on one device and
one micro-batch, and its flops, bytes accessed and operations stand in for the plain step's in the time's
estimate under a measured calibration, recomputation included (its memory is the candidate's own compiled
step's: ``spmd.parallel.auto._compiled``). It is the
same compile the plain ``Profile`` does, once per micro-batch size and policy (or derived from two at other
sizes: ``spmd.parallel.cost._affine``) (its code unoptimized:
``spmd.parallel.cost._memory.READ_ONLY``; nothing read from it depends on LLVM).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd._mesh import DeviceMesh
from spmd.parallel.cost._affine import InBatch
from spmd.parallel.cost._calibrate import program_ops
from spmd.parallel.cost._memory import READ_ONLY, Profile, _cost, _rows
from spmd.parallel.styles._transforms import activation_checkpointing
from spmd.parallel.step._state import init_train_state
from spmd.parallel.step._step import make_train_step

__all__ = ["RematProfile", "remat_profile"]


class RematProfile(Profile):
    """``base``'s loss, parameters and optimizer, with ``model``'s ``units`` under ``policy`` (its residuals and
    optimizer cost are ``base``'s: checkpointing changes neither)."""

    def __init__(self, base: Profile, model: Any, units: tuple[str, ...], policy: str):
        self.__dict__.update(base.__dict__)  # the residuals and the optimizer's cost cached once, on base
        self._grad, self._timed = {}, {}
        self.in_batch = InBatch(base.loss, base.params)  # its own compiles (base's are without the policy)
        self.model, self.units, self.policy, self._base = model, units, policy, base

    def _step(self, batch: Any) -> tuple[float, float, int, int]:
        k = self._key(batch)
        if k not in self._grad and (got := self.in_batch.derived(batch)) is not None:
            self._grad[k] = got  # from two compiles at other rows (spmd.parallel.cost._affine)
        if k not in self._grad:
            self._base._say(f"compiling its one-device step under {self.policy!r} at {_rows(batch)}")
            model = activation_checkpointing(self.model, units=list(self.units), policy=self.policy)
            mesh = DeviceMesh.from_jax(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",)))
            state = jax.eval_shape(lambda: init_train_state(model, self.optimizer, params=self.params, mesh=mesh))
            comp = make_train_step(model, self.step_loss, self.optimizer, mesh=mesh).lower(state, batch).compile(READ_ONLY)
            temp = int(getattr(comp.memory_analysis(), "temp_size_in_bytes", 0) or 0)
            self._grad[k] = (*_cost(comp), temp, program_ops(comp.as_text()))
            self.in_batch.compiled(batch, self._grad[k])
        return self._grad[k]


def remat_profile(base: Profile, model: Any, units: tuple[str, ...], policy: str | None) -> Profile:
    """``base`` itself without a policy; else its ``RematProfile``, one per (units, policy), kept on ``base``."""
    if policy is None:
        return base
    cache = base.__dict__.setdefault("_remat", {})
    if (units, policy) not in cache:
        cache[(units, policy)] = RematProfile(base, model, units, policy)
    return cache[(units, policy)]
