"""What the step exchanges with the user's code: the batch in (``_as_arrays``: DTensors as global arrays) and
the loss's outputs back (``_split_loss``: ``loss`` or ``(loss, aux)``; ``_split_stats``: ``(out,
new_batch_stats)`` of a loss that takes ``batch_stats``), each checked."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd.parallel.plan._checks import check_loss, describe_tree


def _as_arrays(batch: Any) -> Any:
    from spmd.tensor import DTensor

    def one(x):
        if isinstance(x, DTensor):
            return x.to_jax() if hasattr(x, "to_jax") else x.full_tensor()
        return x

    return jax.tree.map(one, batch, is_leaf=lambda x: isinstance(x, DTensor))


def _split_loss(out: Any, where: str) -> tuple[jax.Array, dict]:
    if isinstance(out, tuple) and len(out) == 2:
        loss, aux = out
    else:
        loss, aux = out, {}
    if not isinstance(aux, dict):
        aux = {"aux": aux}
    if not hasattr(loss, "shape") or np.shape(loss) != ():
        raise ValueError(f"{where}: loss_fn returned {loss!r}; it must return a scalar loss, or (loss, aux) with aux "
                         "a dict of scalar metrics.")
    check_loss(where, loss, aux)
    return loss, aux


def _split_stats(out: Any, stats: Any, where: str) -> tuple[Any, Any]:
    """``(loss output, new batch_stats)`` of a loss that takes ``batch_stats``, its new statistics checked
    against the old (the same tree)."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"{where}: the state holds batch_stats, so loss_fn(params, batch_stats, batch) must return "
                         f"(loss, new_batch_stats) or ((loss, aux), new_batch_stats); got {type(out).__name__}.")
    out, new = out
    if isinstance(new, dict) and set(new) == {"batch_stats"} and "batch_stats" not in stats:
        new = new["batch_stats"]  # the `updates` of model.apply(..., mutable=["batch_stats"]) as they came
    if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(stats):
        raise ValueError(f"{where}: loss_fn returned new batch_stats with other paths than the state's "
                         f"({describe_tree(new)} vs {describe_tree(stats)}); return the model's updated "
                         "'batch_stats' collection (model.apply(..., mutable=['batch_stats'])[1]['batch_stats']).")
    return out, new
