"""Expert parallelism as a style: ``ExpertParallel`` (torchtitan's), applied with ``parallelize_module`` on ``ep``.

``parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})`` cuts an experts module
whose parameters carry a leading experts dim (``[E, d, f]``) over ``ep`` (each rank holds ``E / ep`` experts)
and runs it on its experts' tokens. ``ep`` is a data dim of the train step (the batch's rows are cut over it,
the other parameters whole over it, their gradients averaged over it as over ``dp``), so the module's input,
the dispatch buffers the model's router filled (``[groups, E, capacity, d]``, the model's own capacity and
drops), arrives cut on its groups: the style's layouts say ``Shard(0)`` arriving, ``Shard(1)`` (the experts
dim) needed, and ``Shard(1) -> Shard(0)`` back, each change one ``all_to_all`` over ``ep`` (the lowering
table's ``Shard(i) -> Shard(j)``): dispatch and combine. Any style on the ``ep`` dim is run the same way, its
layouts read through the ``ParallelStyle`` protocol.

The experts module runs unchanged on its local experts' parameters (``[E / ep, d, f]``); each rank's expert
gradients sum every rank's tokens (the all-to-alls' transposes) and are divided by ``ep``.

``ExpertTensorParallel`` (torchtitan's), in the tp plan of the same module, cuts each expert's hidden ``f`` over
``tp`` too: between the dispatch and the combine the module runs on its ``[E / ep, d, f / tp]`` blocks in a region
manual over tp (``run_on_ep`` hands the call to the tp layouts), its partial output all-reduced over tp.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
from jax import lax

from placements import Partial, Placement, Replicate, Shard
from spmd.parallel.styles._styles import ParallelStyle

__all__ = ["ExpertParallel", "ExpertTensorParallel", "apply_stored", "CPU_DROPLESS", "run_on_ep", "expert_terms", "with_experts"]

CPU_DROPLESS = "ragged_all_to_all does not run on CPU; use a capacity factor"


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """torchtitan's ``ExpertParallel``: an experts module cut over ``ep`` on its parameters' leading experts dim,
    its tokens dispatched to their experts' ranks with one ``all_to_all`` and combined back with another.

    ``token_dim``: the input's dim the batch's groups are on (cut over ep as the batch is); ``experts_dim``:
    its experts dim (cut over ep for the computation). ``dropless=True`` (no capacity: tokens sent with
    ``ragged_all_to_all``) is refused: not on CPU, where it cannot run, and not written for other backends.
    """

    token_dim: int = 0
    experts_dim: int = 1
    dropless: bool = False

    def __post_init__(self):
        for arg in ("token_dim", "experts_dim"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"ExpertParallel: {arg}={v!r} must be an int >= 0 (a dim of the module's input).")
        if self.token_dim == self.experts_dim:
            raise ValueError(f"ExpertParallel: token_dim and experts_dim are both {self.token_dim}; they name two "
                             "dims of the input (groups and experts).")
        if self.dropless:
            if jax.default_backend() == "cpu":
                raise NotImplementedError(f"ExpertParallel: dropless=True needs lax.ragged_all_to_all, and "
                                          f"{CPU_DROPLESS} (the model's capacity_factor = num_experts / top_k drops "
                                          "nothing, with padding).")
            raise NotImplementedError("ExpertParallel: dropless=True (ragged_all_to_all) is not implemented; use the "
                                      "model's capacity factor (num_experts / top_k drops nothing, with padding).")

    def param_placements(self, module_path: str, params: Mapping[str, tuple[int, ...]],
                         module_type: str | None = None) -> dict[str, Placement]:
        lead = {name: shape[0] for name, shape in params.items() if len(shape) >= 1}
        if len(set(lead.values())) > 1 or len(lead) != len(params):
            raise ValueError(f"ExpertParallel: module {module_path!r} has parameters "
                             f"{ {n: tuple(s) for n, s in params.items()} }; an experts module's parameters all carry "
                             "the leading experts dim ([E, d, f], [E, f, d]). Style the module that holds the stacked "
                             "experts (e.g. 'layers_*.mlp.experts').")
        return {name: Shard(0) for name in params}

    def input_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        return Shard(self.token_dim), Shard(self.experts_dim)

    def run_call(self, call) -> Any:
        """The module's call with its tokens dispatched to their experts' ranks and combined back (``run_on_ep``)."""
        return run_on_ep(self, call)

    def output_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        return Shard(self.experts_dim), Shard(self.token_dim)


@dataclass(frozen=True)
class ExpertTensorParallel(ParallelStyle):
    """torchtitan's ``ExpertTensorParallel``, as a tensor-parallel style: each expert's hidden dim ``f`` cut over
    ``tp`` (Megatron's MLP inside every expert), applied with ``parallelize_module`` on ``mesh["tp"]`` to the
    module ``ExpertParallel`` cuts over ``mesh["ep"]`` (or alone, the experts whole over ep).

    The in-projections (``[E, d, f]``: gate, up) are cut column-parallel on ``f`` (``Shard(2)``), the
    out-projection (``[E, f, d]``: down) row-parallel on ``f`` (``Shard(1)``): each tp rank of an expert computes
    its ``f`` slice on the whole dispatched tokens and the partial outputs are all-reduced over tp (one all-reduce
    forward per call; the tokens' gradient one all-reduce backward, Megatron's ``f`` and ``g``), inside the ep
    exchange (dispatch all_to_all, the experts' tp block, combine all_to_all).

    ``model_dim``: the tokens' width ``d``, which tells ``[E, d, f]`` from ``[E, f, d]``; None: read from the
    parameters' shapes when they tell it (a gated expert: two projections into ``f``, one out of it), else a
    ``ValueError`` asks for it. The module's input's last dim is checked against it at its first call.
    """

    model_dim: int | None = None

    def __post_init__(self):
        v = self.model_dim
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise TypeError(f"ExpertTensorParallel: model_dim={v!r} must be None or an int >= 1 (the experts' input "
                            "width d).")

    def dims(self, module_path: str, params: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        """``(d, f)`` of the experts module's parameters (each ``[E, d, f]`` or ``[E, f, d]``)."""
        shapes = {n: tuple(int(d) for d in s) for n, s in params.items()}
        where = f"ExpertTensorParallel on {module_path!r}"
        pairs = [s[1:] for s in shapes.values() if len(s) == 3]
        if len(pairs) != len(shapes) or len({s[0] for s in shapes.values()}) != 1 or len(set(map(frozenset, pairs))) != 1:
            stack = (" Under nn.scan ([L, E, d, f]) they are read past the layer axis once the plan knows it: give "
                     "init_train_state the example inputs the model is called on."
                     if shapes and all(len(s) == 4 for s in shapes.values()) else "")
            raise ValueError(f"{where}: the module's parameters {shapes} must all be [E, d, f] or [E, f, d] (one "
                             "experts dim E, one width d, one hidden f): style the module holding the stacked "
                             f"experts' projections (e.g. 'layers_*.mlp.experts').{stack}")
        sizes = set(pairs[0])
        if self.model_dim is not None:
            if self.model_dim not in sizes:
                raise ValueError(f"{where}: model_dim={self.model_dim} is not a dim of the parameters {shapes}; give "
                                 f"the experts' input width, one of {sorted(sizes)}.")
            d = self.model_dim
            f = next(iter(sizes - {d}), d)
        else:
            count = {p: pairs.count(p) for p in set(pairs)}
            if len(sizes) == 1 or len(count) != 2 or len(set(count.values())) != 2:
                raise ValueError(f"{where}: the parameters {shapes} do not tell the width d from the hidden f (d == f, "
                                 "or as many projections into f as out of it); give ExpertTensorParallel(model_dim=d).")
            d = max(count, key=count.get)[0]  # the in-projections [E, d, f] outnumber the out-projection [E, f, d]
            f = next(iter(sizes - {d}))
        if d == f:
            raise ValueError(f"{where}: the parameters {shapes} have d == f == {d}: [E, d, f] and [E, f, d] look the "
                             "same, so the hidden dim to cut is not known from the shapes; ExpertTensorParallel "
                             "needs d != f.")
        return d, f

    def param_placements(self, module_path: str, params: Mapping[str, tuple[int, ...]],
                         module_type: str | None = None) -> dict[str, Placement]:
        _, f = self.dims(module_path, params)
        return {n: Shard(2) if int(s[2]) == f else Shard(1) for n, s in params.items()}

    def input_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        return Replicate(), Replicate()

    def output_layouts_for(self, module_type: str | None) -> tuple[Any, Any]:
        return Partial(), Replicate()

    def check_input(self, module_path: str, params: Mapping[str, tuple[int, ...]], x: Any) -> None:
        """The module's input ``x`` has the experts' width ``d`` last (else the cut dim is not their hidden one)."""
        d, f = self.dims(module_path, params)
        if not np.ndim(x) or np.shape(x)[-1] != d:
            raise ValueError(f"parallelize_module: ExpertTensorParallel on {module_path!r}: the module's input has "
                             f"shape {tuple(np.shape(x))}, whose last dim is not the experts' width d={d} read from "
                             f"its parameters (hidden f={f}); give ExpertTensorParallel(model_dim=<the input's width>).")


class _StoredParamsScope:
    """Mixed into one bound linen scope's class (``stored_params``): ``param`` returns the stored value without
    comparing its shape to the initializer's, so the module reads its local experts (``[E / ep, ...]``) where
    its code declares ``E``. Built once per flax ``Scope`` class (``_STORED_SCOPE``)."""

    def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
        if self.has_variable("params", name):
            from flax.core import meta

            self.reserve(name, "params")
            value = self.get_variable("params", name)
            return meta.unbox(value) if unbox else value
        return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)


_STORED_SCOPE: dict[type, type] = {}  # flax scope class -> its _StoredParamsScope subclass (classes only)


@contextlib.contextmanager
def stored_params(scope: Any):
    """Inside, the bound linen ``scope`` (one module's, in this trace) returns its stored parameters as they are
    (``_StoredParamsScope``): the instance's class is swapped and restored, nothing global is changed."""
    cls = type(scope)
    if issubclass(cls, _StoredParamsScope):  # already inside
        yield
        return
    if cls not in _STORED_SCOPE:
        _STORED_SCOPE[cls] = type(cls.__name__, (_StoredParamsScope, cls), {"__module__": cls.__module__})
    scope.__class__ = _STORED_SCOPE[cls]
    try:
        yield
    finally:
        scope.__class__ = cls


def apply_stored(module: Any, params: Any, args: tuple, kwargs: dict) -> Any:
    """``module.apply({"params": params}, *args, **kwargs)`` with its root scope reading the parameters as given
    (``stored_params``): a module declaring ``[E, d, f]`` run on its blocks (``ExpertTensorParallel``'s)."""
    import flax.linen as nn

    def local(next_fun, a, k, context):
        scope = getattr(context.module, "scope", None)
        if scope is not None and not scope.path:
            with stored_params(scope):
                return next_fun(*a, **k)
        return next_fun(*a, **k)

    with nn.intercept_methods(local):
        return module.apply({"params": params}, *args, **kwargs)


def _change(x, axis: str, given: Any, desired: Any, where: str):
    """``x`` from layout ``given`` to ``desired`` over the manual dim ``axis``: ``Shard(a) -> Shard(b)`` is one
    all_to_all; equal layouts, nothing."""
    if given == desired or given is None or desired is None:
        return x
    if not (isinstance(given, Shard) and isinstance(desired, Shard)):
        raise ValueError(f"{where}: the layouts {given!r} -> {desired!r} on the ep dim are not offered; a style on ep "
                         "changes an activation Shard(a) -> Shard(b) (one all_to_all).")
    return lax.all_to_all(x, axis, split_axis=desired.dim % x.ndim, concat_axis=given.dim % x.ndim, tiled=True)


def _check_experts_dims(where: str, style: Any, call, x, given: Any, desired: Any) -> bool:
    """The routing the style relies on, checked on the call's first input ``x``: its ``desired`` dim (the experts
    dim, cut over ep for the computation) holds one slot per expert of the module, ``ep`` times the leading dim
    of its local parameters (expert ``e`` on rank ``e // (E / ep)``, as ``Shard(0)`` holds them), and its ``given``
    dim (the tokens' groups, cut over ep as the batch is) is another dim. Anything else would all_to_all a dim
    that is not the experts' (a module on the tokens themselves, ``[tokens, d]``; buffers in another order).
    False (nothing checked): a style whose plan cuts none of the module's parameters on their leading dim."""
    if not (isinstance(given, Shard) and isinstance(desired, Shard)):
        return False
    hooks, plan = call.hooks, call.hooks.plan
    ei = plan.mesh_dim_names.index(hooks.model.ep.mesh_dim)
    ep = plan.mesh_shape[ei]
    lead = set()  # the local experts of the parameters the plan cuts on their leading dim over ep
    for path, v in call.params():
        p = hooks.entry_for(path, v).placements[ei]
        if np.ndim(v) and isinstance(p, Shard) and p.dim % np.ndim(v) == 0:
            lead.add(int(np.shape(v)[0]))
    if not lead:  # a style on ep that does not cut its parameters' leading dim: no experts dim to check
        return False
    shape = tuple(np.shape(x))
    e_dim, t_dim = desired.dim % max(len(shape), 1), given.dim % max(len(shape), 1)
    if len(lead) != 1 or len(shape) < 2 or e_dim == t_dim or shape[e_dim] != ep * next(iter(lead)):
        n = ep * next(iter(lead)) if len(lead) == 1 else sorted(ep * e for e in lead)
        raise ValueError(
            f"{where}: the module's input has shape {shape} on this device, and its experts dim {e_dim} "
            f"(experts_dim={desired.dim}) must hold one slot per expert, {n} (the module's parameters' leading dim "
            f"over ep={ep}); its groups dim is {t_dim} (token_dim={given.dim}). ExpertParallel exchanges the "
            "dispatched tokens of capacity-routed experts, [groups, E, capacity, d] (experts_dim=1) or "
            "[E, groups, capacity, d] (experts_dim=0, token_dim=1): give the dims the module's input has, or route "
            "the tokens into such buffers before the experts module (a module called on [tokens, d] or on gathered "
            "tokens is not expert-parallel as it is).")
    return True


def _check_tied(where: str, call, moved, desired: Any) -> None:
    """The module's code ties its input's experts dim to its parameters' experts dim: called abstractly (nothing
    runs) on its local input it must run, and on an input one slot longer there it must fail. A module that runs
    anyway does not read that dim as its experts (``experts_dim`` names another dim of equal size, such as the
    groups), and the all_to_alls would send its tokens to the wrong ranks. Not probed with one local expert (a
    size-1 dim may broadcast), nor where flax refuses an abstract call (a module writing a collection)."""
    import flax.errors

    if not isinstance(desired, Shard):
        return
    d = desired.dim % moved.ndim
    fix = ("Give ExpertParallel the dims of the module's input: experts_dim (the one its einsums share with the "
           "parameters' leading dim) and token_dim (the groups), e.g. ExpertParallel(token_dim=1, experts_dim=0) "
           "for [E, groups, capacity, d] buffers.")

    def probe(shape):
        call.abstract((jax.ShapeDtypeStruct(shape, moved.dtype), *call.args[1:]), call.kwargs)

    try:
        probe(tuple(moved.shape))
    except flax.errors.FlaxError:
        return
    except Exception as err:
        raise ValueError(f"{where}: the module does not run on its local experts' tokens, shape "
                         f"{tuple(moved.shape)} on this device (dim {d}, experts_dim={desired.dim}, exchanged over "
                         f"ep): {type(err).__name__}: {str(err).rstrip('.')}. {fix}") from None
    if moved.shape[d] < 2:
        return
    try:
        probe(moved.shape[:d] + (moved.shape[d] + 1,) + moved.shape[d + 1:])
    except Exception:  # the experts dim is the parameters'
        return
    raise ValueError(
        f"{where}: the module runs on an input whose dim {d} (experts_dim={desired.dim}) is {moved.shape[d] + 1} "
        f"long while it holds {moved.shape[d]} local experts: its code does not pair that dim with its "
        f"parameters' experts dim, so it is not the experts dim (shape {tuple(moved.shape)} on this device). {fix}")


def run_on_ep(style: ParallelStyle, call) -> Any:
    """``call`` (a ``spmd.parallel.styles._hooks.ModuleCall`` of a module styled on the ep dim, manual in the
    step's region) under ``style``: its first input changed to the style's computing layout (its experts dim
    checked first: ``_check_experts_dims``), the module run on its local parameters (``call.local_params()``: a
    linen module's stored values as they are), its output changed back; the hooks' ``ep_records`` get the call's
    activation bytes (the table's all-to-all rows)."""
    axis, fqn, typ = call.hooks.model.ep.mesh_dim, call.fqn, call.typ
    where = f"parallelize_module: {style!r} on {fqn!r}"
    given, desired = style.input_layouts_for(typ)
    out_given, out_desired = style.output_layouts_for(typ)
    x = call.args[0] if call.args else None
    if x is None or not hasattr(x, "shape"):
        raise ValueError(f"{where}: the module is called without an array as its first argument ({call.args!r}); "
                         "a style on ep exchanges the module's first input (the dispatched tokens).")
    checked = _check_experts_dims(where, style, call, x, given, desired)
    # inside a module run on the sequence gathered over cp (the router's: spmd.parallel.context), each device of
    # cp dispatches its part of the buffers (cut over cp on the groups), the experts' gradients summed over cp
    ctx = getattr(call.hooks.around, "__self__", None)
    cut = ctx.experts_dim(x, (given.dim,)) if hasattr(ctx, "experts_dim") and isinstance(given, Shard) else None
    n_cp = ctx.n if cut is not None else 1
    if cut is not None:
        x = ctx.experts_cut(fqn, x, cut, [p for p, _ in call.params()])
    def change(v, a, b):  # cut over cp: each device of cp exchanges its block
        return _change(v, axis, a, b, where) if cut is None or a == b else ctx.on_cut(lambda u: _change(u, axis, a, b, where), v,
                                                                            cut)

    moved = change(x, given, desired)
    if checked:
        _check_tied(where, call, moved, desired)
    tp = call.hooks.model.tp
    tp_hit = tp.style_for(call.tp_key) if tp and call.tp_key else None
    with call.local_params():
        if tp_hit is None:
            y = call.next((moved, *call.args[1:]), call.kwargs)
        else:  # the experts' own tp (ExpertTensorParallel): their blocks over tp on their tokens, in a region
            # manual over tp (its input's gradient and its partial output all-reduced over tp)
            on_tp = copy.copy(call)
            on_tp.args, on_tp.layer = (moved, *call.args[1:]), "tp"
            y = on_tp.with_layouts(tp_hit[1])
    if not hasattr(y, "shape") or np.ndim(y) != moved.ndim or any(
            np.shape(y)[i] != np.shape(moved)[i] for i in (given.dim % moved.ndim, desired.dim % moved.ndim)
            if isinstance(given, Shard) and isinstance(desired, Shard)):
        raise ValueError(f"{where}: the module returned {getattr(y, 'shape', type(y).__name__)!r} on its input of "
                         f"shape {tuple(np.shape(moved))} (its local experts' tokens); ExpertParallel sends the "
                         "output back on the input's groups and experts dims, so the module must keep them "
                         "(experts' outputs in the slots of their tokens, [groups, E, capacity, d] -> "
                         "[groups, E, capacity, d']).")
    out = change(y, out_given, out_desired)
    # a module inside an nn.scan runs (and exchanges) once per layer; flax traces the scan's body twice (its
    # broadcast check, then the scan), so its record replaces the one of the earlier trace
    from spmd.parallel.plan._scan import scan_of

    calls = scan_of(fqn.replace(".", "/"), dict(call.hooks.plan.scans))
    records = call.hooks.ep_records
    if calls > 1:
        records[:] = [r for r in records if r["module"] != fqn]
    records.append({"module": fqn, "style": type(style).__name__,
                    "in": 0 if moved is x else int(np.prod(x.shape)) * x.dtype.itemsize // n_cp,
                    "out": 0 if out is y else int(np.prod(y.shape)) * y.dtype.itemsize // n_cp,
                    "after_tp": len(call.hooks.records), "calls": calls})  # after_tp: the tp calls traced before
    if cut is not None:
        out = ctx.experts_gathered(out, cut)
    return out


def expert_terms(records: list, accum_steps: int = 1) -> dict:
    """``{"all-to-all": {count, bytes}}`` per device of one step's ep calls: each layout change an all-to-all of
    its buffer forward and one backward (its transpose)."""
    out = {"count": 0, "bytes": 0}
    for r in records:
        n = 2 * accum_steps * r.get("calls", 1)  # under nn.scan: once per layer
        for nbytes in (r["in"], r["out"]):
            if nbytes:
                out["count"] += n
                out["bytes"] += n * nbytes
    return out


def with_experts(comm: dict, records: list, accum_steps: int) -> dict:
    """The table with the ep calls' all-to-alls (``expert_terms``) in its ``experts (ep)`` part and its total."""
    terms = expert_terms(records, accum_steps)
    total = {k: dict(v) for k, v in comm["total"].items()}
    t = total.setdefault("all-to-all", {"count": 0, "bytes": 0})
    t["count"] += terms["count"]
    t["bytes"] += terms["bytes"]
    return {**comm, "total": total, "experts": {"all-to-all": terms}, "expert_calls": list(records)}
