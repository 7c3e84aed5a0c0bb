"""``auto_layout``'s context- and expert-parallel candidates (``Layout(cp=)``, ``Layout(ep=)``).

- **cp**: the sequence (dim 1 of every batch leaf of rank 2 or more) cut over ``cp`` for every divisor of the
  device count that divides the sequence, the rest of the devices over ``dp`` x ``fsdp`` x ``tp``. The train
  step runs the attention it recognizes (``jax.nn.dot_product_attention``, flax's ``dot_product_attention``)
  as ring attention (or an all-gather of K/V) across the cut; a model calling none (its own einsum attention,
  whose module the step runs on the gathered sequence, or no attention at all) is refused by
  ``evaluate_layout``, and the first refusal of a model's cp candidate (or the step's refusal of its first ep
  candidate) stands for the rest: ``auto_layout`` lists them rejected with the reason.
- **ep**: the experts of a model that has them (a module named ``experts`` whose parameters share a leading
  experts dim: ``models.MoE``'s ``[E, d, f]`` kernels) cut over ``ep`` with ``ExpertParallel`` (the tokens
  exchanged with all-to-alls) for every divisor of the device count that divides the expert count, the
  batch's rows split over ``dp`` x ``fsdp`` x ``ep``, the rest of the devices over ``dp`` x ``fsdp`` x ``tp``.

Each is costed as every other layout is (``evaluate_layout``): the step's own table, whose ``total`` holds the
cp and ep terms (priced over their own dim), the lower bound, and under a budget the compiled step.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from spmd.parallel.auto._layout import Layout, factorizations, tp_plan_for
from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.styles._experts import ExpertParallel
from spmd.parallel.styles._transforms import param_module

__all__ = ["context_expert_layouts", "experts_of", "sequence_of"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def experts_of(params: Any) -> tuple[str, int] | None:
    """``(glob, experts)`` of the model's experts modules (their fqn with each layer index a ``*``, and the
    leading dim their parameters share), or None where it has none."""
    mods: dict[str, set] = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        mod, _ = param_module(path_str(kp))
        if mod.split(".")[-1] == "experts" and len(x.shape) >= 3:
            mods.setdefault(mod, set()).add(x.shape[0])
    if not mods or any(len(e) != 1 for e in mods.values()):
        return None
    counts = {next(iter(e)) for e in mods.values()}
    if len(counts) != 1:
        return None
    globs = {".".join(re.sub(r"^(.*?_?)(\d+)$", r"\1*", c) for c in m.split(".")) for m in mods}
    return (sorted(globs)[0], counts.pop()) if len(globs) == 1 else None


def sequence_of(batch: Any) -> int | None:
    """The batch's sequence length (dim 1 of its leaves of rank 2 or more, all equal), or None."""
    seqs = {x.shape[1] for x in jax.tree.leaves(batch) if len(x.shape) >= 2}
    return seqs.pop() if len(seqs) == 1 else None


def _rest(n: int, plan: Any, units: tuple[str, ...], **dims) -> list[Layout]:
    out = []
    for dp, fsdp, tp in factorizations(n):
        tp_plan = tp_plan_for(plan, False, tp) if tp > 1 else None
        if tp > 1 and tp_plan is None:
            continue
        for raf in (True, False) if fsdp > 1 else (True,):
            out.append(Layout(dp=dp, fsdp=fsdp, tp=tp, reshard_after_forward=raf, units=units if fsdp > 1 else (),
                              tp_plan=tp_plan, **dims))
    return out


def context_expert_layouts(n: int, plan: Any, units: tuple[str, ...], params: Any, batch: Any) -> list[Layout]:
    """The cp and ep layouts ``auto_layout`` weighs on ``n`` devices (see the module doc)."""
    out = []
    seq = sequence_of(batch)
    if seq is not None:
        for cp in _divisors(n):
            if seq % cp == 0:
                out += _rest(n // cp, plan, units, cp=cp)
    got = experts_of(params)
    if got is not None:
        glob, experts = got
        for ep in _divisors(n):
            if experts % ep == 0:
                out += _rest(n // ep, plan, units, ep=ep, ep_plan=((glob, ExpertParallel()),))
    return out
