"""The state is the model's: a parameter tree checked against the model's own (paths, shapes, dtypes).

The model's tree comes from what knows it: an nnx model's ``nnx.state``, the ``.params`` a Hugging Face
Flax model holds, a linen model's abstract ``init`` on example inputs (or on the inputs its loss gives it,
read off one abstract trace of the loss), or the trees ``init_train_state`` and the step found for this
model object. A linen model's parameter shapes follow from its inputs, so a fresh linen model without
example inputs has none to compare with: the step compares at its first call.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.plan._checks import check_same_tree, describe_tree, linen_abstract_params, traced_model_params
from spmd.parallel.styles._nnx import is_nnx, nnx_params
from spmd.parallel.styles._transforms import ParallelModule

__all__ = ["check_model_params", "held_params", "check_seen", "check_state_params", "check_batch"]


def check_model_params(where: str, arg: str, module: Any, params: Any, example_inputs: tuple = (), fix: str = (
        "Pass the parameters of this model (model.init(rng, x)['params'], or nnx.state(model, nnx.Param)), or "
        "build the state for the model they belong to.")) -> Any:
    """``params`` against the model's own: an nnx model's ``nnx.state``, a linen model's abstract ``init``
    on ``example_inputs`` (none given: nothing to compare with here; the step compares at its first call)."""
    import flax.linen as nn

    if is_nnx(module):
        expected = nnx_params(module)
        source = f"this {type(module).__name__}'s parameters (nnx.state(model, nnx.Param))"
    elif held_params(module) is not None:
        expected = held_params(module)
        source = f"this {type(module).__name__}'s parameters (its .params)"
    elif isinstance(module, nn.Module) and example_inputs:
        expected = linen_abstract_params(module, example_inputs)
        source = f"this {type(module).__name__}'s parameters ({type(module).__name__}.init on the example inputs)"
    else:
        return None
    if expected is not None:
        check_same_tree(where, arg, expected, params, source, fix)
    return expected


def held_params(module: Any) -> Any:
    """The shapes of the parameters a model holds beside its linen module (a Hugging Face Flax model:
    ``.module`` a linen module, ``.params`` its tree), or None (another model, or one built without them)."""
    import flax.linen as nn

    if not isinstance(getattr(module, "module", None), nn.Module):
        return None
    try:
        params = module.params
    except (AttributeError, ValueError):  # built with _do_init=False: it holds none
        return None
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)


def check_seen(where: str, arg: str, model: Any, logical: Any, fix: str) -> None:
    """``logical`` against the parameter trees init_train_state and the step found this model to have (a linen
    model gives its tree only on inputs; none seen yet: nothing to compare with)."""
    seen = getattr(model, "_params_seen", None)
    if seen and describe_tree(logical) not in seen:
        inner = model.module if isinstance(model, ParallelModule) else model
        check_same_tree(where, arg, _as_structs(seen[-1]), logical,
                        f"the parameters of this {type(inner).__name__} (as its init on the inputs gave them)", fix)


def _as_structs(desc: dict) -> dict:
    """``describe_tree``'s ``{path: (shape, dtype)}`` as a flat dict of ``ShapeDtypeStruct``s with those paths."""
    return {p: jax.ShapeDtypeStruct(shape, dtype) for p, (shape, dtype) in desc.items()}


def check_state_params(pm: ParallelModule, loss_fn: Callable, logical: Any, batch: Any) -> dict | None:
    """The state's parameters against the step's model, once per plan: an nnx model's own state, or a linen
    model's abstract ``init`` on the inputs ``loss_fn`` gives it (one abstract trace of the loss, whose
    ``trace_seen`` it returns for ``check_unscanned``)."""
    seen = None
    fix = ("Build the state with init_train_state(model, optimizer, ...) for this step's model (or the step "
           "for the model the state belongs to); init_train_state checks params= at once when it is given the "
           "model's example inputs (init_train_state(model, optimizer, x, params=params)): a linen model's "
           "parameter shapes follow from its inputs.")
    if is_nnx(pm.module):
        expected = nnx_params(pm.module)
        source = f"this step's {type(pm.module).__name__} parameters (nnx.state(model, nnx.Param))"
    else:
        expected, seen = traced_model_params(loss_fn, logical, batch)
        source = ("the parameters of this step's model (its init on the inputs loss_fn gives it: "
                  f"{_model_name(pm.module)})")
    if expected is None:
        return seen
    check_same_tree("train_step", "state.params", expected, logical, source, fix)
    if describe_tree(expected) not in pm._params_seen:
        pm._params_seen.append(describe_tree(expected))
    return seen


def _model_name(module: Any) -> str:
    return type(getattr(module, "module", module)).__name__


def check_batch(batch: Any, n_data: int, accum_steps: int, data: tuple[str, ...], sizes: dict) -> None:
    """``batch``'s leaves share a leading (batch) dim that the data dims x ``accum_steps`` divide."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("train_step: batch holds no arrays.")
    n = np.shape(leaves[0])[0] if np.ndim(leaves[0]) else None
    for x in leaves:
        if not np.ndim(x) or np.shape(x)[0] != n:
            raise ValueError(f"train_step: every batch leaf needs the same leading (batch) dim; got shapes "
                             f"{[np.shape(y) for y in leaves]}.")
    if n % (n_data * accum_steps):
        split = " x ".join(f"{d}={sizes[d]}" for d in data) or "1"
        raise ValueError(
            f"train_step: the batch has {n} examples, not divisible by the data-parallel size {split} = {n_data}"
            + (f" times accum_steps={accum_steps}" if accum_steps > 1 else "")
            + f"; use a batch size that is a multiple of {n_data * accum_steps}.")
