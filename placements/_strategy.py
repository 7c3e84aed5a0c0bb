"""Op strategies: which placements an op's inputs must have and which placements its output gets.

Pure placement logic (no JAX), after torch's DTensor op strategies
(``torch/distributed/tensor/_ops``): an op on DTensors runs as the same op on
every rank's local tensor once its inputs are laid out as a strategy asks.

A *single-dim rule* says, for one mesh dim, ``(output, input0, input1, ...)``
placements under which the local op gives the right local output: for an
elementwise op ``S(i)`` everywhere (``R`` for an input broadcast on ``i``); for
a contraction over an index that both inputs shard, ``P(sum)`` out; a few
``Partial`` pass-throughs where the op commutes with the reduction (``exp``
keeps ``P(max)``, ``-`` turns ``P(max)`` into ``P(min)``, ``+`` keeps ``P(sum)``
when both sides are ``P(sum)``). A full strategy picks one rule per mesh dim;
the chosen one is the cheapest, in the redistribute planner's cost model, to
reach from the placements the inputs have (ties: fewer collectives, fewer
redistribute steps, then rule order). Reductions and softmax
follow their input as torch does (no search): a reduction over a sharded dim
gives ``Partial(op)``, and anything the op cannot pass through is replicated first.

Every strategy also lists, per input, the tensor dims whose padding (uneven
``torch.chunk`` shards are stored padded) the executor must fill with the op's
identity before the local op mixes elements along them (reduced and
contracted dims).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Sequence

from placements._plan import ALL_TO_ALL_WEIGHT, LATENCY_BYTES, LINEAR_OPS, Plan, PlanCost, plan
from placements._types import Partial, Placement, Replicate, Shard, format_placements

__all__ = [
    "Operand",
    "OpStrategy",
    "PARTIAL_RULES",
    "broadcast_shape",
    "pointwise_strategy",
    "einsum_strategy",
    "parse_einsum",
    "reduction_strategy",
    "normalize_strategy",
    "softmax_strategy",
    "astype_strategy",
]

R = Replicate()

#: Partial pass-through rules of elementwise ops, as torch 2.13 registers them
#: (``_pointwise_ops.py``): ``(output op, input ops...)``, ``None`` for Replicate.
#: A rule applies when its length is 1 + the number of tensor inputs (a Python
#: scalar is not a tensor input), so ``x + 2`` with ``x`` ``P(sum)`` is reduced
#: first, while ``x * 2`` keeps ``P(sum)``.
_LINEAR_UNARY = (("sum", "sum"), ("avg", "avg"))
_MONOTONE_BINARY = (("max", "max", None), ("max", None, "max"), ("min", "min", None), ("min", None, "min"))
PARTIAL_RULES: dict[str, tuple[tuple[str | None, ...], ...]] = {
    "none": (),
    "linear": _LINEAR_UNARY,
    "neg": _LINEAR_UNARY + (("min", "max"), ("max", "min")),
    "non_decreasing": (("max", "max"), ("min", "min")),
    "add": (
        ("sum", "sum", "sum"), ("avg", "avg", "avg"), ("avg", "avg", None), ("max", "max", None),
        ("min", "min", None), ("avg", None, "avg"),
    ),
    "mul": _LINEAR_UNARY + (("sum", "sum", None), ("avg", "avg", None), ("sum", None, "sum"), ("avg", None, "avg")),
    "div": _LINEAR_UNARY + (("sum", "sum", None), ("avg", "avg", None)),
    "maximum": _MONOTONE_BINARY + (("max", "max", "max"),),
    "minimum": _MONOTONE_BINARY + (("min", "min", "min"),),
    "all_partial": tuple((op, op) for op in ("sum", "avg", "max", "min")),
    "order_partial": (("max", "max"), ("min", "min")),
}


@dataclasses.dataclass(frozen=True)
class Operand:
    """What a strategy needs to know of one tensor input: global shape, item size, placements."""

    shape: tuple[int, ...]
    itemsize: int
    placements: tuple[Placement, ...]


@dataclasses.dataclass(frozen=True)
class OpStrategy:
    """The chosen strategy of one op call.

    ``inputs``: the placements each tensor input is redistributed to (``plans``
    say how); ``output``: the output's placements; ``masks``: per input, the
    tensor dims whose padding the executor fills before the local op;
    ``out_shape``: the output's global shape.
    """

    op: str
    mesh_shape: tuple[int, ...]
    inputs: tuple[tuple[Placement, ...], ...]
    output: tuple[Placement, ...]
    out_shape: tuple[int, ...]
    plans: tuple[Plan, ...]
    masks: tuple[tuple[int, ...], ...] = ()

    def cost(self) -> PlanCost:
        cs = [p.cost() for p in self.plans]
        return PlanCost(sum(c.bytes for c in cs), sum(c.collectives for c in cs), sum(c.traffic for c in cs))

    def __str__(self) -> str:
        srcs = ", ".join(format_placements(p.src) for p in self.plans)
        c = self.cost()
        lines = [f"{self.op}({srcs}) -> {format_placements(self.output)} {self.out_shape}  [{c}]"]
        for i, p in enumerate(self.plans):
            for s in p.steps:
                lines.append(f"    input {i}: {s}")
        return "\n".join(lines)


# --- helpers ------------------------------------------------------------------------------------
def _partial_ok(pl: Sequence[Placement]) -> bool:
    ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
    return len(ops) <= 1 or ops <= LINEAR_OPS


def _score(p: Plan) -> tuple[float, int]:
    w = sum(s.traffic * (ALL_TO_ALL_WEIGHT if s.collective == "all_to_all" else 1.0) for s in p.steps)
    n = p.cost().collectives
    return w + LATENCY_BYTES * n, n


def _try_plan(mesh_shape, x: Operand, dst, op: str) -> Plan | None:
    try:
        p = plan(mesh_shape, x.shape, x.itemsize, x.placements, dst, where=op)
    except ValueError:
        return None  # e.g. P(max) cannot become P(sum)
    if any(isinstance(s.src, Shard) and isinstance(s.dst, Partial) for s in p.steps):
        return None  # local but full-size per rank; torch refuses it, and so do op strategies
    return p


def _shards(pl: Sequence[Placement], mesh_shape, dim: int) -> int:
    return math.prod(s for s, p in zip(mesh_shape, pl) if isinstance(p, Shard) and p.dim == dim)


def _fmt_inputs(xs: Sequence[Operand]) -> str:
    return ", ".join(f"{format_placements(x.placements)} {x.shape}" for x in xs)


@functools.lru_cache(maxsize=4096)
def _search(op: str, mesh_shape: tuple[int, ...], xs: tuple[Operand, ...], rules: tuple, out_shape, masks) -> OpStrategy:
    """The cheapest full-mesh strategy out of ``rules`` (single-dim rules, output first)."""
    best = None
    for idx, combo in enumerate(itertools.product(rules, repeat=len(mesh_shape))):
        out = tuple(r[0] for r in combo)
        ins = tuple(tuple(r[i + 1] for r in combo) for i in range(len(xs)))
        if not _partial_ok(out) or not all(_partial_ok(p) for p in ins):
            continue
        plans = []
        for x, dst in zip(xs, ins):
            p = _try_plan(mesh_shape, x, dst, op)
            if p is None:
                break
            plans.append(p)
        else:
            scores = [_score(p) for p in plans]
            steps = sum(len(p.steps) for p in plans)  # ties: keep what the inputs have
            key = (sum(s for s, _ in scores), sum(n for _, n in scores), steps, idx)
            if best is None or key < best[0]:
                best = (key, ins, out, tuple(plans))
    if best is None:
        raise ValueError(
            f"{op}: no strategy for inputs placed {_fmt_inputs(xs)} on a mesh of shape {mesh_shape}; "
            "redistribute the inputs to Replicate() first."
        )
    _, ins, out, plans = best
    mk = tuple(tuple(d for d in m if any(isinstance(p, Shard) and p.dim == d for p in pl)) for m, pl in zip(masks, ins))
    return OpStrategy(op, mesh_shape, ins, out, tuple(out_shape), plans, mk)


def _partial(op: str | None) -> Placement:
    return R if op is None else Partial(op)


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
    op: str, mesh_shape: Sequence[int], xs: Sequence[Operand], partial_rules: str = "none"
) -> OpStrategy:
    """Elementwise op over broadcast inputs: ``S(i)`` follows the output dim ``i`` into every
    input that has it (``R`` where an input broadcasts), plus ``PARTIAL_RULES[partial_rules]``."""
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
    return _search(op, tuple(mesh_shape), xs, tuple(rules), out_shape, ((),) * len(xs))


def astype_strategy(mesh_shape, x: Operand, *, float_to_float: bool) -> OpStrategy:
    """A dtype cast keeps Shard; keeps ``P(max|min)`` (casts are monotone); keeps ``P(sum|avg)``
    only between floating dtypes (as torch; an integer cast of partial sums would not be exact)."""
    rules = "all_partial" if float_to_float else "order_partial"
    return pointwise_strategy("astype", mesh_shape, (x,), rules)


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
        if not s.isalpha() or len(set(s)) != len(s):
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


def einsum_strategy(op: str, mesh_shape: Sequence[int], equation: str, xs: Sequence[Operand]) -> OpStrategy:
    """torch's einsum rules, per mesh dim: batch index -> ``S`` everywhere; index contracted by
    all inputs -> ``P(sum)`` out with both inputs ``S`` on it; free index of one input -> ``S``
    on it and the output, ``R`` on the others; an index summed inside one input -> ``P(sum)``;
    linearity: one input ``P(sum|avg)``, the others ``R``."""
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
    for op_name in sorted(LINEAR_OPS, reverse=True):
        for k in range(len(xs)):
            rules.append((Partial(op_name),) + tuple(Partial(op_name) if j == k else R for j in range(len(xs))))
    return _search(op, tuple(mesh_shape), xs, tuple(rules), out_shape, tuple(tuple(sorted(m)) for m in masks))


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


def normalize_strategy(op: str, mesh_shape: Sequence[int], x: Operand, axis) -> OpStrategy:
    """torch's layer-norm rules: ``S`` on a dim that is not normalised, else ``R`` (searched)."""
    axes = _axes(axis, len(x.shape), op)
    rules = [(R, R)] + [(Shard(d), Shard(d)) for d in range(len(x.shape)) if d not in axes]
    return _search(op, tuple(mesh_shape), (x,), tuple(rules), tuple(x.shape), ((),))
