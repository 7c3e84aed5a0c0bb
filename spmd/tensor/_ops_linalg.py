"""Contractions on DTensors: ``matmul`` and two-operand ``einsum``."""

from __future__ import annotations

import jax.numpy as jnp

from placements import format_placements
from placements._strategy_ops import einsum_strategy
from spmd.tensor._ops_exec import check_operands, current_strategy, is_dtensor, operand, run

__all__ = ["matmul", "einsum"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _einsum(*args):
    *xs, eq = args
    return jnp.einsum(eq, *xs)


def _check(op: str, xs) -> None:
    for i, x in enumerate(xs):
        if not is_dtensor(x):
            raise TypeError(
                f"{op}: operand {i} is {type(x).__name__}, not a DTensor; lay it out first with "
                "distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)."
            )
    check_operands(op, list(xs))


def einsum(equation: str, *operands):
    """``jnp.einsum`` with an explicit output (``"bmk,kn->bmn"``) over DTensors.

    Output placements follow torch's einsum strategy (``placement_strategy`` chooses among its
    rules); a contraction over an index both operands keep sharded gives ``Partial(sum)``.
    """
    _check("einsum", operands)
    strat = einsum_strategy(
        "einsum", operands[0].device_mesh.shape, equation, [operand(x) for x in operands], strategy=current_strategy()
    )
    return run(strat, _einsum, list(operands), params=(equation.replace(" ", ""),), fill="sum")


def _matmul_equation(a: int, b: int, shapes) -> str:
    if a == 0 or b == 0:
        raise ValueError(
            f"matmul: operands of shapes {shapes[0]} and {shapes[1]} include a 0-d tensor; use * (multiply) for a scalar."
        )
    if b == 1:
        lhs = _LETTERS[: a - 1] + "k"
        return f"{lhs},k->{lhs[:-1]}"
    if a == 1:
        rhs = _LETTERS[: b - 2] + "kn"
        return f"k,{rhs}->{rhs[:-2]}n"
    if b == 2:
        lhs = _LETTERS[: a - 2] + "mk"
        return f"{lhs},kn->{lhs[:-1]}n"
    if a != b:
        raise ValueError(
            f"matmul: batched operands of shapes {shapes[0]} and {shapes[1]} have different ranks; broadcasting "
            "batch dims is not supported: reshape them to the same rank (or use einsum)."
        )
    batch = _LETTERS[: a - 2]
    return f"{batch}mk,{batch}kn->{batch}mn"


def matmul(x, y):
    """``x @ y`` (``jnp.matmul`` ranks: 1-D vectors, ``(..., m, k) @ (k, n)``, equal-rank batches)."""
    _check("matmul", (x, y))
    eq = _matmul_equation(x.ndim, y.ndim, (x.shape, y.shape))
    k = x.shape[-1]
    kk = y.shape[0] if y.ndim == 1 else y.shape[-2]
    if k != kk:
        raise ValueError(
            f"matmul: x of shape {x.shape} (placed {format_placements(x.placements)}) and y of shape {y.shape} "
            f"(placed {format_placements(y.placements)}) do not contract: {k} != {kk}; transpose or reshape one."
        )
    batch = [(i, x.shape[i], y.shape[i]) for i in range(x.ndim - 2) if y.ndim == x.ndim and x.shape[i] != y.shape[i]]
    if batch:
        raise ValueError(f"matmul: batch dims of shapes {x.shape} and {y.shape} differ at {batch}; make them equal.")
    # torch's rules per case: dot (1-D @ 1-D) has concrete rules and no Partial input; mv (n-D @ 1-D)
    # passes only P(sum) through; the rest are mm / bmm (placeholders, P(sum) and P(avg)).
    linear = () if x.ndim == y.ndim == 1 else ("sum",) if y.ndim == 1 else ("sum", "avg")
    strat = einsum_strategy("matmul", x.device_mesh.shape, eq, [operand(x), operand(y)], strategy=current_strategy(),
                            linear=linear, fixed=x.ndim == y.ndim == 1)
    return run(strat, _einsum, [x, y], params=(eq,), fill="sum")
