"""Blocks under ``nn.scan``: parameters stacked along a layer axis, found by tracing the model once.

``nn.scan(Block, variable_axes={"params": 0}, length=L)`` stores each of the block's parameters with one
more axis (the layer) than the block's code sees: the scan hands iteration ``i`` its slice. The plan must
know that axis: FSDP never cuts it (each iteration slices the stored blocks along it, then gathers its
layer: one all-gather per layer and buffer, inside the loop), and a unit called inside the scan gathers
its parameters as the block sees them (``unstacked``). A tensor-parallel style styles a module inside the
scan as the block sees it, and its stored cut is one dim past the layer axis where it falls at or after it
(``build_plan``); the module's call runs on one layer's blocks, once per iteration. The axis is found by tracing the model abstractly
(nothing runs) and comparing the shapes each module sees with the stored ones (``find_stacked``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import numpy as np

from placements import Shard
from spmd.parallel.plan._param_plan import PlanEntry, path_str

__all__ = ["trace_seen", "find_stacked", "unstacked", "scan_of"]


def trace_seen(run: Callable, *args: Any, on_call: Callable | None = None) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """``jax.eval_shape(run, *args)`` and the shapes the linen module calls saw of the parameters:
    ``{param path: {module path: shape}}`` (read before and after each call, so an ``init`` is seen too).
    ``on_call(module, method name, args, kwargs)``: told of each module call first."""
    import flax.linen as nn

    seen: dict[str, dict[str, tuple[int, ...]]] = {}

    def look(mod) -> None:
        base = "/".join(str(p) for p in mod.scope.path)
        for kp, x in jax.tree_util.tree_flatten_with_path(mod.variables.get("params", {}))[0]:
            seen.setdefault((base + "/" if base else "") + path_str(kp), {}).setdefault(base, tuple(np.shape(x)))

    def record(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name == "setup" or getattr(mod, "scope", None) is None:
            return next_fun(*args, **kwargs)
        if on_call is not None:
            on_call(mod, context.method_name, args, kwargs)
        look(mod)
        out = next_fun(*args, **kwargs)
        look(mod)
        return out

    with nn.intercept_methods(record):
        out = jax.eval_shape(run, *args)
    return out, seen


def find_stacked(seen: Mapping[str, Mapping[str, tuple[int, ...]]], params: Any) -> dict[str, tuple[str, int]]:
    """``{param path: (scanned module path, stacked axis)}`` of every parameter of ``params`` (as stored)
    that some module call saw with one dim fewer (``trace_seen``); the scanned module is the outermost one
    that saw it so (the scan's body)."""
    found: dict[str, tuple[str, int]] = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path, have = path_str(kp), tuple(np.shape(x))
        fewer = sorted((len(m), m, got) for m, got in seen.get(path, {}).items() if len(got) != len(have))
        if not fewer:
            continue
        _, module, got = fewer[0]
        axes = [a for a in range(len(have)) if have[:a] + have[a + 1:] == got]
        if len(have) != len(got) + 1 or not axes:
            raise ValueError(
                f"init_train_state: parameter {path!r} is stored with shape {have} but module {module!r} sees "
                f"{got}: only one nn.scan level (one stacked axis) is supported; scan the blocks once, or leave "
                "them out of fully_shard's units.")
        found[path] = (module, axes[0])
    return found


def unstacked(e: PlanEntry) -> PlanEntry:
    """``e`` as the scanned block sees it: without its stacked axis (the shard dims after it shift down)."""
    a = e.stacked[1]
    drop = lambda t: t[:a] + t[a + 1:]  # noqa: E731
    places = tuple(Shard(p.dim - (p.dim > a)) if isinstance(p, Shard) else p for p in e.placements)
    return dataclasses.replace(e, shape=drop(e.shape), local_shape=drop(e.local_shape), placements=places,
                               stacked=None)


def scan_of(unit: str, scans: Mapping[str, int]) -> int:
    """How many times a unit is called per forward pass: the length of the scan it runs in (1 if none)."""
    for path, length in scans.items():
        if unit == path or unit.startswith(path + "/"):
            return length
    return 1


def stacked_in(plan: Any) -> dict[str, tuple[str, int]]:
    """The ``stacked`` map a plan was built with (``build_plan``'s argument)."""
    return {e.path: e.stacked for e in plan.entries if e.stacked is not None}


def check_unscanned(plan: Any, run: Callable, *args: Any, seen: Mapping | None = None, nnx: bool = False) -> None:
    """A plan built without example inputs (no stacked axes known) against a trace of ``run(*args)`` (the
    user's loss on the logical parameters; ``seen``: that trace's ``trace_seen``, if already made): a model
    whose blocks turn out to run under ``nn.scan`` is an error naming the fix, before the step slices a cut
    layer axis."""
    if plan.scans:
        return
    if seen is None:
        _, seen = trace_seen(run, *args)
    logical = jax.tree_util.tree_unflatten(plan.treedef, [jax.ShapeDtypeStruct(e.shape, e.dtype)
                                                          for e in plan.entries])
    found = find_stacked(seen, logical)
    if found:
        path, (module, axis) = next(iter(found.items()))
        if nnx:
            raise ValueError(
                f"train_step: module {module!r} runs under nnx.scan (parameter {path!r} is stacked along axis "
                f"{axis}), but the state was laid out without knowing it; pass example inputs the model is called "
                "on when you build it: init_train_state(model, optimizer, *example_inputs).")
        raise ValueError(
            f"train_step: module {module!r} runs under nn.scan (parameter {path!r} is stacked along axis {axis}), "
            "but the state was laid out without knowing it; pass example inputs when you build it: "
            "init_train_state(model, optimizer, *example_inputs, params=params) (or rng, *example_inputs).")
