"""Tensor-parallel styles under torch's names, as entries of the parameter placement plan.

torch writes ``parallelize_module(model, mesh["tp"], {"attn.qkv": ColwiseParallel(), ...})``; here
``parallelize_rules({"block_\\d+/attn/qkv": ColwiseParallel(dim=-2), ...})`` gives the plan's
``Rule`` values, which name only the ``tp`` mesh dim, so ``plan_params(params, mesh, rules)`` composes
them with ``fully_shard``'s default on ``fsdp`` (and ``Replicate`` on ``dp``) in one plan:

- ``ColwiseParallel(dim=-1)``: the output features are cut, weight and bias ``Shard(dim)`` (``dim``
  counts from the end, where a flax ``Dense``/``DenseGeneral`` kernel and its bias keep the output
  features; ``dim=-2`` cuts the heads of a ``(D, 3, heads, head_dim)`` kernel); the input is
  ``Replicate`` over ``tp`` (``Shard(1)``, the sequence, under sequence parallelism: all-gathered first),
  the output sharded on the features.
- ``RowwiseParallel(dim=0)``: the input features are cut (``kernel`` or an ``Embed``'s ``embedding``
  table, whose rows are the vocabulary), the bias stays whole; the output is ``Partial(sum)`` over ``tp``,
  reduced once: all-reduced, or reduce-scattered on the sequence under sequence parallelism.
- ``SequenceParallel()``: a norm's ``scale``/``bias`` stay ``Replicate`` while the activations around it
  are ``Shard(1)`` (the sequence) over ``tp``; the norm's gradient is summed over ``tp``.

Where a style's shard meets a dim the tensor cannot be cut evenly on, chunks follow ``torch.chunk`` (the
plan pads each block to the first chunk's size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from placements import Placement, Replicate, Shard
from spmd.parallel._rules import Rule

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel", "parallelize_rules"]


def _check_dim(style: str, dim: object) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{style}: dim={dim!r} must be an int (a tensor dim of the weight, negative from the end).")


@dataclass(frozen=True)
class ColwiseParallel:
    """Cut the output features: ``{module}/kernel`` and ``{module}/bias`` are ``Shard(dim)`` on ``tp``."""

    dim: int = -1
    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)

    def __post_init__(self):
        _check_dim("ColwiseParallel", self.dim)

    def rules(self, module: str, mesh_dim: str = "tp") -> tuple[Rule, ...]:
        return (Rule(f"(?:{module})/(?:kernel|bias)", {mesh_dim: Shard(self.dim)},
                     name=f"ColwiseParallel({module!r}, dim={self.dim})"),)


@dataclass(frozen=True)
class RowwiseParallel:
    """Cut the input features: ``{module}/kernel`` (or an embedding's table) is ``Shard(dim)`` on ``tp``;
    the bias keeps the default (``Replicate`` on ``tp``), added once after the reduction."""

    dim: int = 0
    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()

    def __post_init__(self):
        _check_dim("RowwiseParallel", self.dim)

    def rules(self, module: str, mesh_dim: str = "tp") -> tuple[Rule, ...]:
        return (Rule(f"(?:{module})/(?:kernel|embedding)", {mesh_dim: Shard(self.dim)},
                     name=f"RowwiseParallel({module!r}, dim={self.dim})"),)


@dataclass(frozen=True)
class SequenceParallel:
    """A norm between blocks under sequence parallelism: ``scale``/``bias`` ``Replicate`` on ``tp``,
    the activations ``Shard(seq_dim)``."""

    seq_dim: int = 1

    def __post_init__(self):
        _check_dim("SequenceParallel", self.seq_dim)

    def rules(self, module: str, mesh_dim: str = "tp") -> tuple[Rule, ...]:
        return (Rule(f"(?:{module})/(?:scale|bias)", {mesh_dim: Replicate()},
                     name=f"SequenceParallel({module!r})"),)


_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel)


def parallelize_rules(plan: Mapping[str, object], mesh_dim: str = "tp") -> tuple[Rule, ...]:
    """torch's ``parallelize_module`` plan as plan rules: ``{module path regex: style}`` -> ``Rule``s on
    ``mesh_dim``, in the order given (pass them to ``plan_params``, before any ``fully_shard`` rule)."""
    where = "parallelize_rules"
    if not isinstance(plan, Mapping):
        raise TypeError(f"{where}: plan={plan!r} must map module path regexes to styles, e.g. "
                        "{'block_\\\\d+/fc': ColwiseParallel()}.")
    if not isinstance(mesh_dim, str):
        raise TypeError(f"{where}: mesh_dim={mesh_dim!r} must be a mesh dim name (str), e.g. 'tp'.")
    rules: list[Rule] = []
    for module, style in plan.items():
        if not isinstance(module, str):
            raise TypeError(f"{where}: plan key {module!r} must be a module path regex (str), e.g. 'block_\\\\d+/fc'.")
        if not isinstance(style, _STYLES):
            raise TypeError(f"{where}: plan[{module!r}]={style!r} must be ColwiseParallel(), RowwiseParallel() "
                            "or SequenceParallel().")
        rules.extend(style.rules(module, mesh_dim))
    return tuple(rules)
