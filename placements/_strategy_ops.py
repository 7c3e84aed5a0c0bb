"""The op strategies of ``placements._strategy``: elementwise, contractions, reductions and norms.

Each builds its candidate rules and hands them to ``_strategy._search`` (torch's choice or the
cheapest, as ``strategy`` says); see ``placements/_strategy.py`` for the rule and the cost model.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from placements._plan import LINEAR_OPS, plan
from placements._strategy import (PARTIAL_RULES, R, OpStrategy, Operand, _fmt_inputs, _partial, _search, _shards,
                                  check_strategy)
from placements._types import Partial, Shard, format_placements

__all__ = ["broadcast_shape", "pointwise_strategy", "astype_strategy", "parse_einsum", "einsum_strategy",
           "reduction_strategy", "softmax_strategy", "normalize_strategy"]


# --- elementwise ----------------------------------------------------------------------------------
def broadcast_shape(shapes: Sequence[Sequence[int]], op: str, placements: Sequence = ()) -> tuple[int, ...]:
    """NumPy broadcasting of ``shapes``; a ValueError naming ``op`` and the operands if they do not broadcast."""
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        sizes = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0}
        big = sizes - {1}
        if len(big) > 1:
            ops = ", ".join(
                f"{tuple(s)}" + (f" placed {format_placements(p)}" if p else "")
                for s, p in itertools.zip_longest(shapes, placements, fillvalue=None)
            )
            raise ValueError(
                f"{op}: shapes {ops} do not broadcast (dim {i - nd} has sizes {sorted(sizes)}); make the sizes "
                "equal or 1 (reshape or index an operand)."
            )
        out.append(big.pop() if big else 1)
    return tuple(out)


def pointwise_strategy(
    op: str, mesh_shape: Sequence[int], xs: Sequence[Operand], partial_rules: str = "none", *, strategy: str = "torch"
) -> OpStrategy:
    """Elementwise op over broadcast inputs: ``S(i)`` follows the output dim ``i`` into every
    input that has it (``R`` where an input broadcasts), plus ``PARTIAL_RULES[partial_rules]``;
    chosen as ``strategy`` (``STRATEGIES``) says."""
    xs = tuple(xs)
    out_shape = broadcast_shape([x.shape for x in xs], op, [x.placements for x in xs])
    n = len(out_shape)
    rules = [(R,) * (len(xs) + 1)]
    for i in range(n):
        rule = [Shard(i)]
        for x in xs:
            d = i - (n - len(x.shape))
            rule.append(Shard(d) if d >= 0 and x.shape[d] == out_shape[i] else R)
        rules.append(tuple(rule))
    for pr in PARTIAL_RULES[partial_rules]:
        if len(pr) == len(xs) + 1:
            rules.append(tuple(_partial(o) for o in pr))
    return _search(op, tuple(mesh_shape), xs, tuple(rules), out_shape, ((),) * len(xs), check_strategy(strategy, op))


def astype_strategy(mesh_shape, x: Operand, *, float_to_float: bool, strategy: str = "torch") -> OpStrategy:
    """A dtype cast keeps Shard; keeps ``P(max|min)`` (casts are monotone); keeps ``P(sum|avg)``
    only between floating dtypes (as torch; an integer cast of partial sums would not be exact)."""
    rules = "all_partial" if float_to_float else "order_partial"
    return pointwise_strategy("astype", mesh_shape, (x,), rules, strategy=strategy)


# --- contractions ---------------------------------------------------------------------------------
def parse_einsum(equation: str, ndims: Sequence[int]) -> tuple[tuple[str, ...], str]:
    """``"mk,kn->mn"`` -> ``(("mk", "kn"), "mn")``, checked against the operands' ranks."""
    where = "einsum"
    if not isinstance(equation, str) or "->" not in equation:
        raise ValueError(
            f"{where}: equation={equation!r} needs an explicit output, e.g. 'mk,kn->mn' (ellipsis '...' is not supported)."
        )
    lhs, out = equation.replace(" ", "").split("->")
    ins = tuple(lhs.split(","))
    if len(ins) != len(ndims):
        raise ValueError(f"{where}: equation={equation!r} names {len(ins)} operand(s) but {len(ndims)} were given.")
    for k, (s, nd) in enumerate(zip(ins + (out,), tuple(ndims) + (None,))):
        if not (s.isalpha() or (s == "" and nd is None)) or len(set(s)) != len(s):  # "k,k->": a scalar
            raise ValueError(
                f"{where}: equation={equation!r}: {s!r} must be distinct letters per operand (no '...', no repeated "
                "index such as a trace)."
            )
        if nd is not None and len(s) != nd:
            raise ValueError(f"{where}: equation={equation!r}: operand {k} has rank {nd}, not {len(s)} ({s!r}).")
    missing = set(out) - set("".join(ins))
    if missing:
        raise ValueError(f"{where}: equation={equation!r}: output index {sorted(missing)} is in no operand.")
    return ins, out


def einsum_strategy(
    op: str, mesh_shape: Sequence[int], equation: str, xs: Sequence[Operand], *, strategy: str = "torch",
    linear: Sequence[str] = ("sum", "avg"), fixed: bool = False,
) -> OpStrategy:
    """torch's einsum rules, per mesh dim: batch index -> ``S`` everywhere; index contracted by
    all inputs -> ``P(sum)`` out with both inputs ``S`` on it; free index of one input -> ``S``
    on it and the output, ``R`` on the others; an index summed inside one input -> ``P(sum)``;
    linearity: one input ``P(sum|avg)``, the others ``R`` (all inputs when every index is a batch
    index); chosen as ``strategy`` (``STRATEGIES``) says. ``linear``: the Partial ops of the
    linearity rules (torch's ``mv`` has only ``sum``, its ``dot`` none); ``fixed``: torch's rules
    hold whatever the inputs' placements (``dot``, an op torch registers without placeholders)."""
    xs = tuple(xs)
    ins, out = parse_einsum(equation, [len(x.shape) for x in xs])
    sizes: dict[str, int] = {}
    for s, x in zip(ins, xs):
        for c, n in zip(s, x.shape):
            if sizes.setdefault(c, n) != n:
                raise ValueError(
                    f"{op}: index {c!r} of {equation!r} has size {sizes[c]} in one operand and {n} in another "
                    f"(operands {_fmt_inputs(xs)}); the sizes must agree."
                )
    out_shape = tuple(sizes[c] for c in out)
    rules = [(R,) * (len(xs) + 1)]
    masks: list[set] = [set() for _ in xs]
    for c in dict.fromkeys("".join(ins) + out):
        holders = [k for k, s in enumerate(ins) if c in s]
        o = Shard(out.index(c)) if c in out else Partial("sum")
        if c not in out:
            for k in holders:
                masks[k].add(ins[k].index(c))
        if c in out or len(holders) == len(xs) or len(holders) == 1:
            rules.append((o,) + tuple(Shard(ins[k].index(c)) if k in holders else R for k in range(len(xs))))
    for op_name in sorted(set(linear) & LINEAR_OPS, reverse=True):
        for k in range(len(xs)):
            rules.append((Partial(op_name),) + tuple(Partial(op_name) if j == k else R for j in range(len(xs))))
    if all(all(c in s for s in ins) and c in out for c in "".join(ins)):
        for op_name in sorted(set(linear) & LINEAR_OPS, reverse=True):
            rules.append((Partial(op_name),) * (len(xs) + 1))
    return _search(op, tuple(mesh_shape), xs, tuple(rules), out_shape, tuple(tuple(sorted(m)) for m in masks),
                   check_strategy(strategy, op), False, fixed)


# --- reductions and normalisations -----------------------------------------------------------------
def _axes(axis, ndim: int, op: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    ax = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in ax:
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"{op}: axis={axis!r} must be an int, a tuple of ints or None.")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis={a!r} is out of range for a tensor of rank {ndim}; use an axis in [{-ndim}, {ndim - 1}].")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: axis={axis!r} repeats an axis; give each axis once.")
    return tuple(sorted(out))


def reduction_strategy(
    op: str, reduce_op: str, mesh_shape: Sequence[int], x: Operand, axis=None, keepdims: bool = False
) -> OpStrategy:
    """torch's ``common_reduction_strategy``: follow the input. A ``Shard`` of a reduced dim
    becomes ``Partial(reduce_op)``; a ``Partial`` of the same op is kept; anything else
    (another Partial op, ``avg`` over an uneven shard) is replicated first."""
    mesh_shape = tuple(mesh_shape)
    nd = len(x.shape)
    axes = _axes(axis, nd, op)
    pl = x.placements
    linear = all(not isinstance(p, Partial) or p.reduce_op == reduce_op for p in pl)
    if reduce_op == "avg" and any(x.shape[d] % _shards(pl, mesh_shape, d) for d in axes):
        linear = False  # the mean of uneven shards is not the mean of their means
    if not linear:
        pl = tuple(R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in axes) else p for p in pl)
    newdim = {d: (d if keepdims else d - sum(a < d for a in axes)) for d in range(nd) if keepdims or d not in axes}
    out = tuple(
        Partial(reduce_op) if isinstance(p, Shard) and p.dim in axes else Shard(newdim[p.dim]) if isinstance(p, Shard) else p
        for p in pl
    )
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape)) if keepdims else tuple(
        s for d, s in enumerate(x.shape) if d not in axes
    )
    p = plan(mesh_shape, x.shape, x.itemsize, x.placements, pl, where=op)
    mask = tuple(d for d in axes if any(isinstance(q, Shard) and q.dim == d for q in pl))
    return OpStrategy(op, mesh_shape, (pl,), out, out_shape, (p,), (mask,))


def softmax_strategy(op: str, mesh_shape: Sequence[int], x: Operand, axis: int) -> OpStrategy:
    """torch's softmax strategy: follow the input with the softmax dim and any Partial replicated."""
    mesh_shape = tuple(mesh_shape)
    (a,) = _axes(axis, len(x.shape), op)
    pl = tuple(R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == a) else p for p in x.placements)
    p = plan(mesh_shape, x.shape, x.itemsize, x.placements, pl, where=op)
    return OpStrategy(op, mesh_shape, (pl,), pl, tuple(x.shape), (p,), ((),))


def normalize_strategy(op: str, mesh_shape: Sequence[int], x: Operand, axis, *, strategy: str = "torch") -> OpStrategy:
    """torch's layer-norm rules: ``S`` on a dim that is not normalised, else ``R``, chosen as
    ``strategy`` says (under ``"cheapest"`` a sharded normalised dim may move to another dim by
    all-to-all where torch gathers it)."""
    mesh_shape = tuple(mesh_shape)
    axes = _axes(axis, len(x.shape), op)
    rules = [(R, R)] + [(Shard(d), Shard(d)) for d in range(len(x.shape)) if d not in axes]
    return _search(op, mesh_shape, (x,), tuple(rules), tuple(x.shape), ((),), check_strategy(strategy, op))
