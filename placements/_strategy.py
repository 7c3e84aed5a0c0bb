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
the chosen one is the cheapest to reach from the placements the inputs have, in one of
two cost models. Two ways to choose, named by ``STRATEGIES``:

* ``"torch"`` (the default): torch 2.13's choice, so a ported program sees the placements (and
  ``to_local()`` shapes) it saw under torch. torch's rules (a ``Shard`` rule only when some input
  is sharded; ``R`` first), its cost model (``_collective_utils.py``: latency plus ring bandwidth
  of a CPU mesh, an all-to-all priced as an all-gather plus a penalty) and its search
  (``expand_to_full_mesh_op_strategy`` then ``_select_min_cost_strategy``: every combination of
  rules, the inputs kept as they are if that costs nothing, else the first of least cost).
* ``"cheapest"``: the strategy with the fewest communicated bytes in spmd's redistribute planner
  (ties: fewer collectives, fewer redistribute steps, then rule order); e.g. a nonlinear op on
  ``P(sum)`` reduce-scatters to ``S(0)`` where torch all-reduces to ``R``.

Under ``"torch"`` a strategy also carries the cheapest one as ``alternative`` when it differs, so
that ``explain`` can show both costs. Reductions and softmax
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

from placements._plan import ALL_TO_ALL_WEIGHT, LATENCY_BYTES, LINEAR_OPS, Plan, PlanCost, plan, torch_greedy_steps
from placements._types import Partial, Placement, Replicate, Shard, format_placements

__all__ = [
    "STRATEGIES",
    "check_strategy",
    "format_cost",
    "Operand",
    "OpStrategy",
    "PARTIAL_RULES",
]  # the op strategies themselves: placements._strategy_ops

R = Replicate()

#: The ways an op can choose its strategy (see the module docstring); the first is the default.
STRATEGIES = ("torch", "cheapest")


def check_strategy(strategy, where: str = "placement_strategy") -> str:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{where}: strategy={strategy!r} is not one of {STRATEGIES!r}; use 'torch' (torch 2.13's output "
            "placements, the default) or 'cheapest' (fewest communicated bytes)."
        )
    return strategy

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
    #: The cheapest strategy (``"cheapest"``) where it differs from this one (torch's), else None.
    alternative: "OpStrategy | None" = dataclasses.field(default=None, compare=False, repr=False)

    def cost(self) -> PlanCost:
        cs = [p.cost() for p in self.plans]
        return PlanCost(sum(c.bytes for c in cs), sum(c.collectives for c in cs), sum(c.traffic for c in cs))

    def __str__(self) -> str:
        srcs = ", ".join(format_placements(p.src) for p in self.plans)
        c = self.cost()
        lines = [f"{self.op}({srcs}) -> {format_placements(self.output)} {self.out_shape}  [{format_cost(c)}]"]
        for i, p in enumerate(self.plans):
            for s in p.steps:
                lines.append(f"    input {i}: {s}")
        a = self.alternative
        if a is not None:
            lines.append(
                f"    cheapest: -> {format_placements(a.output)}  [{format_cost(a.cost())}]  (placement_strategy('cheapest'))"
            )
            for i, p in enumerate(a.plans):
                for s in p.steps:
                    lines.append(f"        input {i}: {s}")
        return "\n".join(lines)


def format_cost(c: PlanCost) -> str:
    """``PlanCost`` with its ring traffic (what the cheapest strategy minimises: an all_reduce
    moves twice a reduce_scatter's bytes over the same buffer)."""
    return f"{c}, {c.traffic:.0f} B traffic"


# --- helpers ------------------------------------------------------------------------------------
def _partial_ok(pl: Sequence[Placement]) -> bool:
    ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
    return len(ops) <= 1 or ops <= LINEAR_OPS


def _score(p: Plan) -> tuple[float, int]:
    w = sum(s.traffic * (ALL_TO_ALL_WEIGHT if s.collective == "all_to_all" else 1.0) for s in p.steps)
    n = p.cost().collectives
    return w + LATENCY_BYTES * n, n


def _try_plan(mesh_shape, x: Operand, dst, op: str, *, via_partial: bool = False) -> Plan | None:
    """The planner's plan from ``x`` to ``dst``, or None. A plan with a ``Shard -> Partial`` step
    (local, but a full-size block per rank) is refused as a strategy's target, as torch refuses
    it; ``via_partial``: accepted as a route to a target torch chose (e.g. ``RS(1) -> P(sum)S(0)``,
    which the planner routes through a reduce-scatter)."""
    try:
        p = plan(mesh_shape, x.shape, x.itemsize, x.placements, dst, where=op)
    except ValueError:
        return None  # e.g. P(max) cannot become P(sum)
    if not via_partial and any(isinstance(s.src, Shard) and isinstance(s.dst, Partial) for s in p.steps):
        return None
    return p


def _shards(pl: Sequence[Placement], mesh_shape, dim: int) -> int:
    return math.prod(s for s, p in zip(mesh_shape, pl) if isinstance(p, Shard) and p.dim == dim)


def _fmt_inputs(xs: Sequence[Operand]) -> str:
    return ", ".join(f"{format_placements(x.placements)} {x.shape}" for x in xs)


def _cheapest(op: str, mesh_shape, xs, rules, out_shape, masks) -> OpStrategy | None:
    """The cheapest full-mesh strategy out of ``rules`` in spmd's planner, or None if none applies."""
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
        return None
    _, ins, out, plans = best
    return _strategy(op, mesh_shape, ins, out, out_shape, plans, masks)


def _strategy(op, mesh_shape, ins, out, out_shape, plans, masks, alternative=None) -> OpStrategy:
    mk = tuple(tuple(d for d in m if any(isinstance(p, Shard) and p.dim == d for p in pl)) for m, pl in zip(masks, ins))
    return OpStrategy(op, mesh_shape, ins, out, tuple(out_shape), tuple(plans), mk, alternative)


# --- torch 2.13's choice -------------------------------------------------------------------------
# torch's cost model (``torch/distributed/tensor/_collective_utils.py``), in microseconds: a ring
# collective's base latency plus per-hop latency plus bytes over bandwidth. On a CPU mesh torch
# counts one device per host, so every mesh dim spanning more than one device uses its inter-host
# numbers (87.7 GB/s * 0.22, 2.7 us per hop).
_TORCH_BASE_US = 6.6
_TORCH_BW_GBS = (87.7, 87.7 * 0.22)  # intra-host, inter-host
_TORCH_HOP_US = (0.6, 2.7)


def _torch_topology(mesh_shape) -> list[tuple[float, float]]:
    topo, total = [], 1
    for n in reversed(mesh_shape):
        total *= n
        inter = int(total > 1)
        topo.append((_TORCH_BW_GBS[inter], _TORCH_HOP_US[inter]))
    return topo[::-1]


def _torch_step_cost(cur: Placement, dst: Placement, k: int, topo, gb: float) -> tuple[float, float]:
    """torch's ``_compute_placement_transition_cost``: (cost, bytes in GB after the step)."""
    if cur == dst:
        return 0.0, gb
    bw, hop = topo

    def ring(g, hops):
        return _TORCH_BASE_US + hops * hop + (g * hops / k) / bw * 1e6

    if isinstance(cur, Shard) and isinstance(dst, Replicate):
        return ring(gb * k, k - 1), gb * k
    if isinstance(cur, Shard) and isinstance(dst, Shard):
        return ring(gb, k - 1) + 1.0, gb  # torch prices an all-to-all as an all-gather plus 1
    if isinstance(cur, Partial) and isinstance(dst, Replicate):
        return ring(gb, 2 * (k - 1)), gb
    if isinstance(cur, Partial) and isinstance(dst, Shard):
        return ring(gb, k - 1), gb / k
    if isinstance(dst, Partial) and not isinstance(cur, Replicate):
        return math.inf, gb  # Shard -> Partial and Partial -> another Partial: banned
    if isinstance(cur, Replicate) and isinstance(dst, Shard):
        return 0.0, gb / k
    return 0.0, gb


def _shardable(shape, mesh_shape, pl) -> bool:
    """torch's ``is_tensor_shardable``: every sharded dim has at least as many elements as shards."""
    n = [1] * len(shape)
    for k, p in zip(mesh_shape, pl):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            n[p.dim] *= k
            if shape[p.dim] < n[p.dim]:
                return False
    return True


def _torch_cost(mesh_shape, topo, x: Operand, dst) -> float:
    """torch's ``redistribute_cost``: its greedy plan's steps (``torch_greedy_steps``), each priced by
    ``_compute_placement_transition_cost``; nothing for a replicated input (torch's short cut)."""
    if all(isinstance(p, Replicate) for p in x.placements) or tuple(dst) == x.placements:
        return 0.0
    n = math.prod(k for k, p in zip(mesh_shape, x.placements) if isinstance(p, Shard))
    gb = x.itemsize * math.prod(x.shape) / n / 1024 / 1024 / 1024  # in torch's order: ties are decided by the last bit
    cost = 0.0
    for m, c, t, _ in torch_greedy_steps(x.placements, dst):
        step, gb = _torch_step_cost(c, t, mesh_shape[m], topo[m], gb)
        if step == math.inf:
            return math.inf
        cost += step
    return cost


def _torch_choice(mesh_shape, xs, rules, uneven_ok: bool, fixed: bool = False):
    """torch 2.13's strategy out of ``rules``: ``(input placements, output placements)`` or None.

    As torch's ``expand_to_full_mesh_op_strategy`` and ``_select_min_cost_strategy``: a ``Shard``
    rule exists only if some input placement is a ``Shard`` (torch fills its placeholders with the
    inputs' shard types); every combination of rules over the mesh dims, in order, minus mixed
    Partial ops and inputs with fewer elements than shards on a dim (unless kept as they are, where
    ``uneven_ok``); then the last combination that keeps every input as it is at no cost, else the
    first of no cost, else the first of least cost. ``fixed``: rules of an op torch registers with
    concrete ``Shard`` rules (``dot``), kept whatever the inputs' placements."""
    has_shard = fixed or any(isinstance(p, Shard) for x in xs for p in x.placements)
    rules = [r for r in rules if has_shard or not any(isinstance(p, Shard) for p in r)]
    topo = _torch_topology(mesh_shape)
    initial = tuple(x.placements for x in xs)
    keep = zero = best = None
    for combo in itertools.product(rules, repeat=len(mesh_shape)):
        out = tuple(r[0] for r in combo)
        ins = tuple(tuple(r[i + 1] for r in combo) for i in range(len(xs)))
        if not _partial_ok(out) or not all(_partial_ok(p) for p in ins):
            continue
        if not all(_shardable(x.shape, mesh_shape, pl) or (uneven_ok and pl == x.placements) for x, pl in zip(xs, ins)):
            continue
        cost = sum(_torch_cost(mesh_shape, topo, x, pl) for x, pl in zip(xs, ins))
        if cost == 0 and ins == initial:
            keep = (ins, out)
        elif cost == 0 and zero is None:
            zero = (ins, out)
        if best is None or cost < best[0]:
            best = (cost, ins, out)
    if keep is not None or zero is not None:
        return keep or zero
    return None if best is None or best[0] == math.inf else best[1:]


@functools.lru_cache(maxsize=4096)
def _search(
    op: str, mesh_shape: tuple[int, ...], xs: tuple[Operand, ...], rules: tuple, out_shape, masks,
    strategy: str = "torch", uneven_ok: bool = True, fixed: bool = False,
) -> OpStrategy:
    """The full-mesh strategy out of ``rules`` (single-dim rules, output first) that ``strategy``
    picks; ``uneven_ok``: torch keeps an input's placements as they are even where a dim has fewer
    elements than shards (elementwise ops do, contractions do not)."""
    cheap = _cheapest(op, mesh_shape, xs, rules, out_shape, masks)
    if strategy == "torch":
        found = _torch_choice(mesh_shape, xs, rules, uneven_ok, fixed)
        if found is not None and _partial_ok(found[1]):
            ins, out = found
            plans = [_try_plan(mesh_shape, x, dst, op, via_partial=True) for x, dst in zip(xs, ins)]
            if all(p is not None for p in plans):
                same = cheap is not None and (cheap.inputs, cheap.output) == (ins, out)
                return _strategy(op, mesh_shape, ins, out, out_shape, plans, masks, None if same else cheap)
    if cheap is None:
        raise ValueError(
            f"{op}: no strategy for inputs placed {_fmt_inputs(xs)} on a mesh of shape {mesh_shape}; "
            "redistribute the inputs to Replicate() first."
        )
    return cheap


def _partial(op: str | None) -> Placement:
    return R if op is None else Partial(op)
