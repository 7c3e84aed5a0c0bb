"""The work buffers of a tensor-parallel layout, measured on its own tensor-parallel group, for ``auto_layout``.

A ``tp``-cut program holds neither the one-device step's activations divided by ``tp`` nor its whole: the
cut parts (heads, the MLP's hidden features; with sequence parallelism the sequence) shrink, the rest
does not, and XLA's buffer assignment changes with the sizes (no share of the one-device step's temp
bytes predicts it: docs/benchmarks.md). So ``tp_temp_bytes`` compiles the layout's tensor-parallel part
alone, ``dp=1`` over the first ``tp`` devices on one data replica's rows (its accumulation and
checkpointing policy too), through the contract like any candidate, and takes its temp bytes
(``memory_analysis``): every layout of the same cut and rows shares it (``dp`` and ``fsdp`` change the
data dims, not the cut program; FSDP's gathers are ``spmd.parallel.cost._memory``'s terms). One compile
per (cut, rows, accumulation, policy), cached on the ``Profile``. The part is compiled to be read, never
run: with LLVM's code generation unoptimized (``READ_ONLY``), as XLA assigns the buffers before it
generates code (the same temp bytes, compiled faster).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from spmd.parallel.auto._layout import Layout, apply_layout
from spmd.parallel.cost._memory import READ_ONLY
from spmd.parallel.step._step import init_train_state, make_train_step

__all__ = ["tp_temp_bytes"]


def tp_temp_bytes(profile: Any, model: Any, devices: list, layout: Layout, replica_batch: Any,
                  loss_of: Callable, example_inputs: tuple = ()) -> int:
    """XLA's temp bytes of ``layout``'s tensor-parallel part on one data replica's rows ``replica_batch``
    (shape structs): ``dp=1``, no FSDP, over ``devices[:layout.tp]`` (see the module doc). ``loss_of(laid)``:
    the loss of a laid-out model; ``example_inputs``: what a linen model is applied to (its ``nn.scan`` blocks'
    stacked axis, which the plan must know)."""
    part = Layout(tp=layout.tp, tp_plan=layout.tp_plan, sequence_parallel=layout.sequence_parallel,
                  weight_stationary=layout.weight_stationary, accum_steps=layout.accum_steps,
                  activation_checkpointing=layout.activation_checkpointing,
                  units=layout.units if layout.activation_checkpointing else ())
    key = (part, profile._key(replica_batch), tuple(d.id for d in devices[:layout.tp]))
    cache = profile.__dict__.setdefault("_tp_temp", {})
    if key not in cache:
        laid, mesh = apply_layout(model, devices[:layout.tp], part)
        opt = profile.optimizer
        state = jax.eval_shape(lambda: init_train_state(laid, opt, *example_inputs, params=profile.params, mesh=mesh))
        step = make_train_step(laid, loss_of(laid), opt, accum_steps=part.accum_steps, mesh=mesh)
        m = step.lower(state, replica_batch).compile(READ_ONLY).memory_analysis()
        cache[key] = int(getattr(m, "temp_size_in_bytes", 0) or 0)
    return cache[key]
