"""``auto_layout``'s arguments checked before anything is traced: each error names the argument, the value and
the fix."""

from __future__ import annotations

from typing import Any, Mapping

import jax

from spmd.parallel.auto._layout import Layout

__all__ = ["check_batch_cut", "check_batch_rows", "check_precisions"]


def check_batch_cut(batch: Any, layout: Layout, where: str) -> None:
    """A weight-stationary layout cuts each micro-batch of a data replica over ``tp`` on the batch."""
    if not layout.weight_stationary:
        return
    b = jax.tree.leaves(batch)[0].shape[0]
    per = layout.dp * layout.fsdp * layout.accum_steps
    if b % per or (b // per) % layout.tp:
        raise ValueError(f"{where}: layout {layout.name!r} cuts each micro-batch of a data replica (batch {b} / "
                         f"(dp x fsdp x accum_steps = {per})) over tp={layout.tp} on the batch, which does not "
                         f"divide it; use a batch that is a multiple of {per * layout.tp}.")


def check_batch_rows(batch: Any, loss_fn: Any, where: str) -> None:
    """The example batch as the candidates read it: every leaf cut on its leading (batch) dim, the same in
    all; without ``loss_fn`` a dict with the default loss's ``inputs`` and ``targets``."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError(f"{where}: example_batch holds no arrays; give a pytree of [batch, ...] arrays.")
    p0, x0 = leaves[0]
    for p, x in leaves:
        if len(x0.shape) == 0 or len(x.shape) == 0 or x.shape[0] != x0.shape[0]:
            raise ValueError(
                f"{where}: example_batch{jax.tree_util.keystr(p)} has shape {tuple(x.shape)} and example_batch"
                f"{jax.tree_util.keystr(p0)} {tuple(x0.shape)}; every layout cuts each batch leaf along its leading "
                "(batch) dim, so each needs one, the same in all: give per-example arrays (broadcast a shared one "
                "inside loss_fn).")
    if loss_fn is None and not (isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch):
        got = sorted(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"{where}: loss_fn=None takes the default loss, next-token cross-entropy of "
                         f"model(batch['inputs']) against batch['targets'], but example_batch has {got!r}; pass "
                         "loss_fn=(params, batch) -> loss (an nnx model: (model, batch) -> loss) for this batch.")


def check_precisions(mixed_precision: Any, where: str) -> tuple[str, ...]:
    """``mixed_precision=``: the compute dtypes weighed beside the parameters' own (a name or a sequence)."""
    got = (mixed_precision,) if isinstance(mixed_precision, str) else mixed_precision
    try:
        got = tuple(got)
        for p in got:
            Layout(fsdp=2, units=("u",), mixed_precision=p)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: mixed_precision={mixed_precision!r} must be a floating dtype's name or a sequence "
                         "of them, e.g. 'bfloat16' (the FSDP layouts are weighed computing in it too) or ().") from None
    return got
