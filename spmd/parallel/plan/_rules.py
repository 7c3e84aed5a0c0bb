"""Plan rules: a parameter path pattern -> placements on named mesh dims.

A rule is data, like torch's ``parallelize_module`` plan entries: ``pattern``
is a regular expression matched in full against the parameter's path
(``"block_0/attn/qkv/kernel"``), ``placements`` gives a placement per mesh dim
*name*. Mesh dims a rule does not name keep the plan's default (``Shard(0)``
on the fsdp dim, ``Replicate`` elsewhere), so a tensor-parallel rule on
``tp`` composes with ``shard_rule`` on ``fsdp``. The first matching rule
wins. Shorthands build rules: ``shard_rule``, ``replicate`` (and, with
tensor parallelism, column/row-wise ones that name the ``tp`` dim).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from placements import Partial, Placement, Replicate, Shard

__all__ = ["Rule", "shard_rule", "replicate"]


@dataclass(frozen=True)
class Rule:
    """``pattern`` (a regex matched in full against ``"a/b/c"`` paths) -> ``placements``.

    ``placements`` maps mesh dim names to a ``Shard`` or ``Replicate`` (a
    parameter is never ``Partial``); it is stored as a sorted tuple of pairs so
    that rules are hashable values. ``name`` labels the rule in tables and
    error messages (default: the pattern).
    """

    pattern: str
    placements: tuple[tuple[str, Placement], ...]
    name: str = ""

    def __init__(self, pattern: str, placements: Mapping[str, Placement], name: str = ""):
        where = "Rule"
        if not isinstance(pattern, str):
            raise TypeError(f"{where}: pattern={pattern!r} must be a str regex over '/'-joined parameter paths, "
                            "e.g. r'block_\\d+/.*'.")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: pattern={pattern!r} is not a valid regular expression ({e}); fix the regex.") from None
        if not isinstance(placements, Mapping):
            raise TypeError(
                f"{where}({pattern!r}): placements={placements!r} must map mesh dim names to placements, "
                "e.g. {'fsdp': Shard(0)}."
            )
        items = []
        for dim, p in placements.items():
            if not isinstance(dim, str):
                raise TypeError(f"{where}({pattern!r}): placements key {dim!r} must be a mesh dim name (str), e.g. 'fsdp'.")
            if isinstance(p, Partial):
                raise ValueError(
                    f"{where}({pattern!r}): placements[{dim!r}]={p!r}; a parameter is one value, never Partial: "
                    "use Shard(d) or Replicate()."
                )
            if not isinstance(p, (Shard, Replicate)):
                raise TypeError(f"{where}({pattern!r}): placements[{dim!r}]={p!r} must be Shard(d) or Replicate().")
            items.append((dim, p))
        if not isinstance(name, str):
            raise TypeError(f"{where}({pattern!r}): name={name!r} must be a str.")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "placements", tuple(sorted(items, key=lambda kv: kv[0])))
        object.__setattr__(self, "name", name or pattern)

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.pattern, path) is not None

    def placement_for(self, mesh_dim: str) -> Placement | None:
        return dict(self.placements).get(mesh_dim)

    def __str__(self) -> str:
        body = ", ".join(f"{d}={p}" for d, p in self.placements)
        return f"{self.name}: {body}" if self.name != self.pattern else f"{self.pattern!r} -> {body}"


def shard_rule(pattern: str = ".*", *, dim: int = 0, mesh_dim: str = "fsdp") -> Rule:
    """The matched parameters are ``Shard(dim)`` on ``mesh_dim`` (a plan rule; the module transform is
    ``spmd.parallel.fully_shard``)."""
    return Rule(pattern, {mesh_dim: Shard(dim)}, name=f"shard_rule({pattern!r}, dim={dim})")


def replicate(pattern: str, *, mesh_dim: str = "fsdp") -> Rule:
    """Keep the matched parameters whole on ``mesh_dim`` (e.g. tiny norms and biases)."""
    return Rule(pattern, {mesh_dim: Replicate()}, name=f"replicate({pattern!r})")
