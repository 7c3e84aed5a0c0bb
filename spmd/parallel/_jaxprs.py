"""Reading a traced program: the sub-jaxprs an equation holds (a ``jit``'s, a ``scan``'s body, a ``cond``'s
branches, a ``shard_map``'s, a checkpoint's, a ``custom_vjp``'s), found one way for every reader of a step's
jaxpr (the cost model, the planner, the heads and sequence checks)."""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["sub_jaxprs", "all_eqns"]


def sub_jaxprs(eqn: Any, called: bool = False) -> list:
    """The ``Jaxpr``s among ``eqn``'s parameters (a ``ClosedJaxpr``'s own, each of a tuple of them), in order;
    ``called``: only those taking the equation's operands one for one (a call's: ``jit``, ``custom_vjp``,
    ``checkpoint``)."""
    out = []
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns") and hasattr(inner, "invars") and (
                    not called or len(inner.invars) == len(eqn.invars)):
                out.append(inner)
    return out


def all_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first, each where it stands."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in sub_jaxprs(eqn):
            yield from all_eqns(inner)
