"""The weight-stationary layout: tensor parallelism whose group is a data axis, the batch cut around each layer.

At a small batch per device, moving weights (FSDP's all-gathers, DDP's all-reduce of every gradient)
costs more than moving activations. The weight-stationary layout keeps every styled weight cut over the
``tp`` devices for the whole step (it never moves) and moves the activations instead: between the layers
the residual stream is cut on the **batch** (``Shard(0)`` over ``tp``: each device holds its own
sequences, as under data parallelism); each column-parallel layer all-gathers its input over the batch,
so the device computes its slice of the output features for every sequence of the group; each
row-parallel layer reduce-scatters its partial sums back onto the batch. It is Megatron's sequence
parallelism with the cut moved from the sequence dim to the batch dim, which is what GSPMD finds at a
few sequences per device (its matmuls ``[tokens of the group, D] x [D, D / tp]``).

So it needs no runtime of its own: ``weight_stationary_plan(plan)`` turns a sequence-parallel
``parallelize_module`` plan into it (every activation layout ``Shard(sequence_dim)`` becomes
``Shard(0)``, ``SequenceParallel(sequence_dim)`` becomes ``SequenceParallel(0)``: each style's
``map_layouts``), and the
``Layout(tp=n, weight_stationary=True, tp_plan=...)`` of ``spmd.parallel`` applies it with
``parallelize_module`` like any plan. Per styled call and step it communicates what sequence parallelism
does (``spmd.parallel.cost._comm``): the input's all-gather forward and reduce-scatter backward, the output's
reduce-scatter forward and all-gather backward, an all-reduce of the norms' (whole) parameter gradients;
and one term of its own: every parameter whole over ``tp`` that no styled module reads (a position table
added to the batch-cut embedding in the model's own code) has its gradient all-reduced over ``tp``
(each device summed its own sequences' part).
"""

from __future__ import annotations

from typing import Any, Mapping

from placements import Shard
from spmd.parallel.styles._styles import ParallelStyle

__all__ = ["weight_stationary_plan", "is_batch_cut", "activation_cut_dim"]


def _moved(layout: Any, sequence_dim: int) -> Any:
    return Shard(0) if isinstance(layout, Shard) and layout.dim == sequence_dim else layout


def _style(style: Any, sequence_dim: int) -> Any:
    return style.map_layouts(lambda x: _moved(x, sequence_dim)) if isinstance(style, ParallelStyle) else style


def _activation_cuts(style: Any) -> list[int]:
    """The dims of the ``Shard`` activation layouts a style names between modules (not the features)."""
    if not isinstance(style, ParallelStyle):
        return []
    return [x.dim for x in style.activation_layouts() if isinstance(x, Shard) and x.dim >= 0]


def weight_stationary_plan(plan: Mapping[str, Any], *, sequence_dim: int = 1) -> dict:
    """The weight-stationary plan of a sequence-parallel ``parallelize_module`` plan (see the module doc):
    each activation layout ``Shard(sequence_dim)`` (torch's ``Shard(1)`` of ``(batch, seq, ...)``)
    becomes ``Shard(0)``; the kernels' cuts are unchanged."""
    where = "weight_stationary_plan"
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"{where}: plan={plan!r} must be a non-empty sequence-parallel parallelize_module plan "
                        "(dict of module fqn glob -> style), e.g. transformer_tp_plan(sequence_parallel=True).")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int) or sequence_dim < 1:
        raise ValueError(f"{where}: sequence_dim={sequence_dim!r} must be an int >= 1, the sequence dim of the "
                         "activations the plan cuts (1 for (batch, seq, features)); dim 0 is the batch.")
    out = {k: _style(s, sequence_dim) for k, s in plan.items()}
    if not is_batch_cut(tuple(out.items())):
        raise ValueError(f"{where}: the plan cuts no activation on dim {sequence_dim} (a plan without sequence "
                         "parallelism: its activations are whole between the layers, nothing to cut on the batch); "
                         "give the sequence-parallel plan (SequenceParallel norms, ColwiseParallel(input_layouts="
                         f"Shard({sequence_dim})), RowwiseParallel(output_layouts=Shard({sequence_dim}))).")
    return out


def activation_cut_dim(tp: Any) -> int | None:
    """The dim on which a ``parallelize_module`` layout (a ``TPSpec``, or None) cuts the activations between
    modules over tp (1: sequence parallel on ``(batch, seq, ...)``, 0: weight-stationary); None where it cuts
    none, or on several dims."""
    dims = {d for _, style in (tp.plan if tp else ()) for d in _activation_cuts(style)}
    return dims.pop() if len(dims) == 1 else None


def is_batch_cut(items: Any) -> bool:
    """Whether a plan's ``(glob, style)`` pairs cut the activations between modules on the batch (dim 0) and
    nowhere else: a weight-stationary plan."""
    cuts = [d for _, s in items for d in _activation_cuts(s)]
    return bool(cuts) and all(d == 0 for d in cuts)
