"""How a pipeline stage runs the model's own code: the unit calls intercepted, for linen, Hugging Face and nnx.

A stage never splits the user's ``loss_fn`` by hand. The model's unit calls are intercepted, with linen's
``nn.intercept_methods`` (a linen module, or a Hugging Face Flax model: a wrapper around one) or, for a
``flax.nnx`` model, by running ``loss_fn(m, batch)`` on a merged copy whose unit submodules' classes are
swapped for ones that route their calls here (the user's model object is never touched):

- ``record``: one abstract trace. The units' call order, that they chain, the activation, and the rest of
  each unit call. A unit's first positional argument is the activation; its other arguments (``side``: an
  attention mask, position ids, ``deterministic=True``) must be the same in every unit call (the same
  arrays, equal settings) and must not depend on the parameters, since each stage computes them again from
  its micro-batch (the pre-unit code, whose dead part XLA removes); or an array of one shape that differs
  per unit but is a constant (depends on neither the batch, the parameters nor the activation: Hugging
  Face's BERT hands each layer its row of a head mask built from ``head_mask=None``), computed once
  (``unit_consts``), each stage picking its units' rows. A unit returns the next activation, or a
  pytree holding it as its one array (Hugging Face's ``(hidden_states,)``); the model must pass it on.
- ``pre``: ``loss_fn`` run up to the first unit call: its activation and side arrays;
- ``post``: ``loss_fn`` with every unit call returning its recorded output around the injected activation
  (the last unit's: ``h``; the code before it is dead and compiled away);
- ``apply_unit``: one unit as a module of its own on a stage's parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.pipelining._sown import check_sown_read, sown_names
from spmd.parallel.styles._nnx import hook_submodules, installed_hooks

__all__ = ["UnitCalls", "model_kind"]


class _Stop(Exception):
    def __init__(self, x, side):
        super().__init__("first pipeline unit reached")
        self.x, self.side = x, side


def model_kind(model: Any) -> str | None:
    """``"linen"``, ``"hf"`` (a Hugging Face Flax model: ``.module`` a linen module, ``.params``), ``"nnx"``,
    or None (not a model ``pipeline`` takes)."""
    import flax.linen as nn

    from spmd.parallel.styles._nnx import is_nnx

    if isinstance(model, nn.Module):
        return "linen"
    if isinstance(getattr(model, "module", None), nn.Module) and hasattr(model, "params"):
        return "hf"
    return "nnx" if is_nnx(model) else None


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


_ROUTED: dict[type, type] = {}  # nnx unit class -> its subclass routing __call__ to the pipeline (classes only)
_BASE: dict[type, type] = {}
# The routing a unit's copy carries, ``(on_unit, fqn)``: set on the merged copy ``UnitCalls.run`` traces (never
# on the user's module), read by the ``_routed`` subclass, and taken off while ``nnx.split`` reads the unit (it
# is no state of the model). An attribute, as ``spmd.parallel.styles._nnx.HOOK_ATTR`` and for its reason.
UNIT_ATTR = "_spmd_unit"


def _routed(cls: type) -> type:
    if cls not in _ROUTED:
        def __call__(self, *args, **kwargs):
            on_unit, fqn = object.__getattribute__(self, UNIT_ATTR)
            return on_unit(fqn, self, lambda *a, **k: cls.__call__(self, *a, **k), args, kwargs)

        _ROUTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        _BASE[_ROUTED[cls]] = cls
    return _ROUTED[cls]


class _Slot:
    """Where a side array goes in the recorded arguments of a unit call."""


class _UnitSlot:
    """Where a unit's own constant goes in its call's arguments (``UnitCalls.unit_consts[k]``, by unit)."""

    def __init__(self, k: int):
        self.k = k


def _depends(jaxpr, flags: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs flagged (an equation's outputs all depend on any input)."""
    from jax.extend.core import Literal

    dep = {v: f for v, f in zip(jaxpr.invars, flags)}
    for e in jaxpr.eqns:
        d = any(dep.get(v, False) for v in e.invars if not isinstance(v, Literal))
        for v in e.outvars:
            dep[v] = d
    return [not isinstance(v, Literal) and dep.get(v, False) for v in jaxpr.outvars]


class UnitCalls:
    """The unit calls of one layout's model (``StageLayout.calls``): filled by ``record``."""

    def __init__(self, lay, model: Any):
        self.lay, self.model, self.kind = lay, model, model_kind(model)
        self.act = None  # the activation's ShapeDtypeStruct
        self.side_tree = None  # (args[1:], kwargs) of a unit call, its array leaves _Slot
        self.side_shapes: list = []  # the side arrays' ShapeDtypeStructs
        self.side_pos: list[int] = []  # their positions in a unit call's flattened (args[1:], kwargs)
        self.unit_consts: dict = {}  # position -> [L, ...]: an argument that is a constant of its own per unit
        self.out = None  # (treedef, leaves, index of the activation) of a unit's output
        self.unit = None  # linen: the first unit's module (unbound); nnx: (graphdef, param treedef)
        self.units_of: list = []  # each unit's (as ``unit``), in call order
        self.kinds: list[int] = [0]  # a representative unit per kind (units computing one program)
        self.kind_of: list[int] = []  # each unit's kind
        self.remat: list = []  # a scanned stack: the (policy, prevent_cse) its layer runs under (_layer_remat)
        # while a stage collects them (``_Stages.chunk``): what the unit being applied sowed, ``{name: value}``
        self.sown: dict | None = None

    # --- running the model's code with the unit calls routed to ``on_unit(path, mod, call, args, kwargs)``
    def run(self, loss_fn: Callable, params: Any, mb: Any, on_unit: Callable):
        if self.kind == "nnx":
            return self._run_nnx(loss_fn, params, mb, on_unit)
        import flax.linen as nn

        found = set(self.lay.found)

        def icpt(next_fun, args, kwargs, context):
            mod = context.module
            if context.method_name != "__call__" or getattr(mod, "scope", None) is None:
                return next_fun(*args, **kwargs)
            path = "/".join(str(p) for p in mod.scope.path)
            return on_unit(path, mod, next_fun, args, kwargs) if path in found else next_fun(*args, **kwargs)

        with nn.intercept_methods(icpt):
            return loss_fn(params, mb)

    def _run_nnx(self, loss_fn, params, mb, on_unit):
        from flax import nnx

        graphdef, _, rest = nnx.split(self.model, nnx.Param, ...)
        m = nnx.merge(graphdef, params, rest)
        found = set(self.lay.found)
        hooks = installed_hooks()
        if hooks is not None:  # tp: the styled calls outside the units (an embedding, a head) through the hooks
            hook_submodules(m, hooks, skip=tuple(tuple(f.split("/")) for f in found))
        for path, sub in list(nnx.iter_modules(m)):
            fqn = "/".join(str(p) for p in path)
            if fqn in found:
                object.__setattr__(sub, UNIT_ATTR, (on_unit, fqn))
                sub.__class__ = _routed(type(sub))
        return loss_fn(m, mb)

    # --- the trace ----------------------------------------------------------------------------------------
    def record(self, loss_fn: Callable, params: Any, mb: Any) -> None:
        """Trace ``loss_fn`` once (shapes only): the units' call order, that they chain, the activation, the
        side arguments and the output's structure."""
        if self.lay.scanned:
            return self._record_scan(loss_fn, params, mb)
        calls: list = []
        sown: dict = {}  # {unit: [names]}: what each unit sowed where loss_fn can read it (check_sown_read)

        def on_unit(path, mod, call, args, kwargs):
            if not args or not _is_array(args[0]):
                raise ValueError(f"pipeline: unit {path!r} is called without an activation as its first positional "
                                 "argument; a stage passes one activation between units (x = block(x, ...)).")
            side = (tuple(args[1:]), dict(kwargs))
            leaves, tree = jax.tree_util.tree_flatten(side)
            if calls:
                p0, side0 = calls[0][0], calls[0][4]
                if tree != side0[1] or any(
                        (not _is_array(b) or (a.shape, a.dtype) != (b.shape, b.dtype)) if _is_array(a) else (a != b)
                        for a, b in zip(leaves, side0[0])):
                    raise ValueError(f"pipeline: unit {path!r} is called with other arguments than {p0!r} (besides the "
                                     "activation); every unit must get the same ones (one attention mask, one "
                                     "deterministic flag), which each stage computes again from its micro-batch, or "
                                     "constants of one shape (a head mask's row per unit).")
                if calls[-1][2] is not args[0]:
                    raise ValueError(f"pipeline: unit {path!r} does not take the output of {calls[-1][0]!r}; the units "
                                     "must chain (x = block(x) for each block, in order).")
            out = call(*args, **kwargs)
            sown[path] = sown_names(self.kind, mod)
            o_leaves, o_tree = jax.tree_util.tree_flatten(out)
            arrays = [i for i, y in enumerate(o_leaves) if _is_array(y)]
            x = args[0]
            if len(arrays) != 1 or o_leaves[arrays[0]].shape != x.shape or o_leaves[arrays[0]].dtype != x.dtype:
                raise ValueError(f"pipeline: unit {path!r} maps {x.shape} to {jax.tree.map(_shape, out)!r}; a unit "
                                 "must return one activation of its input's shape and dtype (alone or as the one "
                                 "array of a tuple).")
            calls.append((path, self._unit_of(path, mod), o_leaves[arrays[0]], x, (leaves, tree),
                          (o_tree, o_leaves, arrays[0]), _config(mod)))
            return out

        jax.eval_shape(lambda p, b: self.run(loss_fn, p, b, on_unit), params, mb)
        names = [c[0] for c in calls]
        found = self.lay.found
        if sorted(names) != sorted(found) or len(set(names)) != len(names):
            raise ValueError(f"pipeline: the model called the units {names}; every unit {found} must be called "
                             "exactly once per loss_fn call.")
        if names != found:
            raise ValueError(f"pipeline: the model calls the units in the order {names}, not in the order of their "
                             f"names' numbers {found}; the stages follow that order: name the units by their "
                             "place in the chain.")
        _, self.unit, _, x, (leaves, tree), o, _ = calls[0]
        self.act = jax.ShapeDtypeStruct(x.shape, x.dtype)
        # an array argument that is another array in some unit's call: a constant per unit (unit_consts)
        varying = sorted({k for c in calls[1:] for k, (a, b) in enumerate(zip(c[4][0], leaves))
                          if _is_array(a) and a is not b})
        self.unit_consts = self._unit_constants(loss_fn, params, mb, varying, [c[0] for c in calls])
        self.side_pos = [k for k, a in enumerate(leaves) if _is_array(a) and k not in self.unit_consts]
        self.side_tree = jax.tree_util.tree_unflatten(tree, [
            _UnitSlot(k) if k in self.unit_consts else _Slot if _is_array(a) else a for k, a in enumerate(leaves)])
        self.side_shapes = [jax.ShapeDtypeStruct(leaves[k].shape, leaves[k].dtype) for k in self.side_pos]
        self.out = (o[0], [None if _is_array(y) else y for y in o[1]], o[2])
        self._group([c[1] for c in calls], [c[6] for c in calls])
        if self.side_shapes:
            self._check_side(loss_fn, params, mb)
        check_sown_read(self, loss_fn, params, mb, sown)

    def _unit_constants(self, loss_fn, params, mb, positions: list[int], names: list[str]) -> dict:
        """``{argument position: [L, ...] array}``: the side arguments at ``positions`` (flattened ``(args[1:],
        kwargs)``) that differ between units, each unit's value, in unit order. They must be constants (depend on
        neither the batch, the parameters nor the activation: a head mask's rows): each stage holds them all and
        picks its units' rows. One abstract trace; their values from one compiled program of only them."""
        if not positions:
            return {}
        from jax.extend.core import jaxpr_as_fun

        def sides(p, b):
            got = []

            def on_unit(path, mod, call, args, kwargs):
                leaves = jax.tree_util.tree_leaves((tuple(args[1:]), dict(kwargs)))
                got.append([leaves[k] for k in positions])
                return call(*args, **kwargs)

            self.run(loss_fn, p, b, on_unit)
            return got

        closed = jax.make_jaxpr(sides)(params, mb)
        dep = _depends(closed.jaxpr, [True] * len(closed.jaxpr.invars))
        if any(dep):
            i = dep.index(True)
            unit, k = names[max(1, i // len(positions))], positions[i % len(positions)]  # one that differs
            raise ValueError(f"pipeline: unit {unit!r} is called with other arguments than {names[0]!r} (besides the "
                             f"activation): its argument {k} after the activation (flattened) differs between units "
                             "and depends on the batch, the parameters or the activation; every unit must get the "
                             "same ones, which each stage computes again from its micro-batch, or constants (a head "
                             "mask's row per unit).")
        zeros = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        values = jax.jit(lambda: jaxpr_as_fun(closed)(*zeros))()  # the constants only: XLA drops the rest
        n = len(positions)
        return {k: np.stack([np.asarray(values[u * n + c]) for u in range(len(names))]) for c, k in enumerate(positions)}

    def _record_scan(self, loss_fn: Callable, params: Any, mb: Any) -> None:
        """``record`` of a scanned stack: its layer's calls (one per trace of the scan's body: the layer's
        module, the activation, the other arguments, the output's structure), then the cut before the scan
        (``_ScanCut``), which ``pre`` evaluates."""
        stack = self.lay.scanned
        calls: list = []
        sown: dict = {}  # {stack: [names]}: what its layer sowed where loss_fn can read it (check_sown_read)

        def on_unit(path, mod, call, args, kwargs):
            if not args or not _is_array(args[0]):
                raise ValueError(f"pipeline: the layers of the scanned stack {path!r} are called without an activation "
                                 "as their first positional argument; a stage passes one activation between layers "
                                 "(the scan's carry).")
            leaves, tree = jax.tree_util.tree_flatten((tuple(args[1:]), dict(kwargs)))
            out = call(*args, **kwargs)
            sown[path] = sown_names(self.kind, mod)
            o_leaves, o_tree = jax.tree_util.tree_flatten(out)
            outs = [i for i, y in enumerate(o_leaves) if _is_array(y)]
            x = args[0]
            if len(outs) != 1 or o_leaves[outs[0]].shape != x.shape or o_leaves[outs[0]].dtype != x.dtype:
                raise ValueError(f"pipeline: a layer of the scanned stack {path!r} maps {x.shape} to "
                                 f"{jax.tree.map(_shape, out)!r}; a layer must return one activation of its input's "
                                 "shape and dtype (the carry; alone or with None as the scan's output).")
            calls.append((self._unit_of(path, mod), x, (leaves, tree), (o_tree, o_leaves, outs[0]), _config(mod)))
            return out

        jax.eval_shape(lambda p, b: self.run(loss_fn, p, b, on_unit), params, mb)
        if not calls:
            raise ValueError(
                f"pipeline: loss_fn never called the layers of the scanned stack {stack!r}; a stage runs the layers "
                "loss_fn calls on the model it is given. Call that model in loss_fn: linen, loss_fn(params, batch) "
                "running model.apply({'params': params}, ...); nnx, loss_fn(model, batch) calling its model "
                "argument, not a model it closes over.")
        unit, x, (leaves, tree), o, config = calls[0]
        self.unit, self.act = unit, jax.ShapeDtypeStruct(x.shape, x.dtype)
        self.side_pos = [k for k, a in enumerate(leaves) if _is_array(a)]  # broadcast into the scan (a mask)
        self.side_tree = jax.tree_util.tree_unflatten(tree, [_Slot if _is_array(a) else a for a in leaves])
        self.side_shapes = [jax.ShapeDtypeStruct(leaves[k].shape, leaves[k].dtype) for k in self.side_pos]
        self.out = (o[0], [None if _is_array(y) else y for y in o[1]], o[2])
        n = len(self.lay.units)
        self.units_of, self.configs, self.kinds, self.kind_of = [unit], [config], [0], [0] * n
        # before the cut: its trace runs loss_fn with the layers not run (a loss reading what they sow fails there)
        check_sown_read(self, loss_fn, params, mb, sown, shown=lambda u: f"{u}/<layer>")
        self.cut = _ScanCut(self, loss_fn, params, mb)
        self.remat = self.cut.remat  # the user's checkpoint of each layer, its policy: a stage runs it so too
        if self.side_shapes:
            self._check_side(loss_fn, params, mb)

    def _group(self, mods: list, configs: list) -> None:
        """Group the units into kinds that compute the same function: equal configurations (a linen module's
        fields but its name, an nnx module's static attributes), else equal traced programs (GPT-Neo's
        ``layer_id`` differs per block, but its blocks compute one of two programs). ``kinds``: a
        representative unit index per kind; ``kind_of``: each unit's kind. A stage runs each unit as its own
        kind (``apply_unit(..., kind=)``); units of one kind share one traced body."""
        keys: dict[int, Any] = {}

        def key(i):
            if i not in keys:
                keys[i] = self._trace_key(mods[i])
            return keys[i]

        self.units_of, self.configs, self.kinds, self.kind_of = mods, configs, [], []
        for i in range(len(mods)):
            k = next((k for k, rep in enumerate(self.kinds) if _equal(configs[rep], configs[i])
                      and self._same_graph(mods[rep], mods[i])), None)
            if k is None:
                k = next((k for k, rep in enumerate(self.kinds) if key(rep) == key(i)), None)
            if k is None:
                k = len(self.kinds)
                self.kinds.append(i)
            self.kind_of.append(k)

    def _same_graph(self, a, b) -> bool:
        """An nnx unit's graph definition holds every static attribute, private ones (``self._scale``) too, which
        ``_config`` leaves out (nnx keeps its own state in ``_``-named attributes): equal configurations group
        two nnx units only with equal graph definitions (else their traced programs decide)."""
        return self.kind != "nnx" or a[0] == b[0]

    def _trace_key(self, unit):
        """The unit's traced program (and its constants): equal keys compute the same function."""
        import numpy as np

        shapes = [self.lay.unit_shapes[r] for r in self.lay.rel]
        closed = jax.make_jaxpr(lambda ls, x, sd: self._apply(unit, ls, x, sd))(shapes, self.act, self.side_shapes)
        consts = tuple((np.shape(c), str(np.result_type(c)), np.asarray(c).tobytes()) for c in closed.consts)
        return str(closed.jaxpr), consts

    def _check_side(self, loss_fn, params, mb) -> None:
        rest = {p: self.lay.shapes[p] for p in self.lay.rest}
        closed = jax.make_jaxpr(lambda r, b: self.pre(loss_fn, r, b)[1])(rest, mb)
        n, k = len(jax.tree.leaves(rest)), len(jax.tree.leaves(mb))
        if any(_depends(closed.jaxpr, [True] * n + [False] * k)):
            raise ValueError(f"pipeline: the units {self.lay.found[0]!r}... are called with an array besides the "
                             "activation that depends on the parameters; each stage computes those again from its "
                             "micro-batch, without their gradient: compute it inside the unit, or pass it as the "
                             "activation.")

    # --- a stage's pieces -------------------------------------------------------------------------------
    def _unit_of(self, path: str, mod):
        """What ``apply_unit`` runs: linen, the module unbound; nnx, its graph and its parameters' rel paths."""
        if self.kind != "nnx":
            return mod.clone(parent=None)
        from flax import nnx

        from spmd.parallel.plan._param_plan import path_str

        routed, mod.__class__ = mod.__class__, _BASE[mod.__class__]  # its own class in the graph, not the routed one
        route = vars(mod).pop(UNIT_ATTR)
        try:
            # what the unit sowed in a trace (nnx.Intermediate: an MoE's drops) does not reach the loss under a
            # pipeline (a stage's units run on their own): dropped, the unit's parameters stacked
            nnx.pop(mod, nnx.Intermediate)
            gd, ps, other = nnx.split(mod, nnx.Param, ...)
        finally:
            mod.__class__ = routed
            object.__setattr__(mod, UNIT_ATTR, route)
        if jax.tree.leaves(other):
            raise ValueError(f"pipeline: unit {path!r} holds state other than nnx.Param; pipeline stages stack "
                             "parameters only: keep the units free of batch statistics and rngs.")
        kp, ptree = jax.tree_util.tree_flatten_with_path(ps)
        return gd, ptree, [path_str(k) for k, _ in kp]

    def _side(self, side: list, unit=0):
        """The unit call's other arguments: the stage's side arrays, and unit ``unit``'s constants."""
        it = iter(side)
        return jax.tree.map(lambda a: next(it) if a is _Slot else jnp.asarray(self.unit_consts[a.k])[unit]
                            if isinstance(a, _UnitSlot) else a, self.side_tree)

    def _output(self, h):
        tree, leaves, i = self.out
        return jax.tree_util.tree_unflatten(tree, leaves[:i] + [h] + leaves[i + 1:])

    def pre(self, loss_fn: Callable, rest: dict, mb: Any) -> tuple[Any, list]:
        """``(the first unit's input, its side arrays)``: ``loss_fn`` run up to the first unit call (a scanned
        stack: up to the scan, ``_ScanCut``)."""
        if self.lay.scanned:
            return self.cut(rest, mb)
        def on_unit(path, mod, call, args, kwargs):
            leaves = jax.tree_util.tree_leaves((tuple(args[1:]), dict(kwargs)))
            raise _Stop(args[0], [leaves[k] for k in self.side_pos])

        try:
            self.run(loss_fn, self.lay.full_params(rest), mb, on_unit)
        except _Stop as s:
            return s.x, s.side
        raise ValueError("pipeline: loss_fn called no pipeline unit.")

    def post(self, loss_fn: Callable, rest: dict, mb: Any, h):
        """``loss_fn``'s output with the last unit's output replaced by ``h`` (the earlier code is dead)."""
        last = self.lay.found[-1]  # a scanned stack: its one body, returning h in every iteration

        def on_unit(path, mod, call, args, kwargs):
            return self._output(h if path == last else args[0])

        return self.run(loss_fn, self.lay.full_params(rest), mb, on_unit)

    def apply_unit(self, leaves: list, x, side: list = (), kind: int = 0, unit=0):
        """One unit of ``kind`` (``kind_of``; 0: the first unit's) on its parameters (``leaves``, in
        ``StageLayout.rel`` order), the stage's side arrays and unit ``unit``'s constants (``unit_consts``)."""
        return self._apply(self.units_of[self.kinds[kind]], leaves, x, side, unit)

    def difference(self, a: int, b: int) -> str:
        """What units ``a`` and ``b`` (indices) differ in: ``name=value vs value``."""
        return _difference(self.configs[a], self.configs[b])

    def _apply(self, unit, leaves: list, x, side: list = (), index=0):
        args, kwargs = self._side(list(side), index)
        if self.kind == "nnx":
            from flax import nnx

            gd, ptree, rels = unit
            by_rel = dict(zip(self.lay.rel, leaves))
            unit_mod = nnx.merge(gd, jax.tree_util.tree_unflatten(ptree, [by_rel[r] for r in rels]))
            hooks = installed_hooks()
            if hooks is not None:  # tp: the unit's styled calls, named as the unit it runs as (StageHooks.unit)
                hook_submodules(unit_mod, hooks, prefix=hooks.prefix)
            out = unit_mod(x, *args, **kwargs)
            if self.sown is not None:
                self.sown.update(sown_values(nnx.pop(unit_mod, nnx.Intermediate)))
        elif self.sown is not None:
            out, vs = unit.apply({"params": self.lay.unit_tree(leaves)}, x, *args, mutable=["intermediates"], **kwargs)
            self.sown.update(sown_values(vs.get("intermediates", {})))
        else:
            out = unit.apply({"params": self.lay.unit_tree(leaves)}, x, *args, **kwargs)
        return jax.tree.leaves(out)[self.out[2]]


def sown_values(tree: Any) -> dict:
    """``{name: value}`` of what a unit sowed (linen's ``intermediates`` collection, nnx's ``Intermediate``
    state): the name its path in the unit (``mlp/dropped``), the values of one name (a module sowing it more than
    once) summed."""
    out: dict = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        name = "/".join(str(k) for k in keys if k is not None and k != "value")
        out[name] = out[name] + x if name in out else x
    return out


def _config(mod) -> dict:
    """What makes a unit module compute what it does besides its parameters: a linen module's fields but its
    name and parent; an nnx module's attributes that are neither variables, arrays nor modules (its submodules'
    too, by path)."""
    import dataclasses

    import flax.linen as nn

    if isinstance(mod, nn.Module):
        return {f.name: getattr(mod, f.name) for f in dataclasses.fields(mod) if f.name not in ("parent", "name")}
    from flax import nnx

    out = {}
    for path, sub in nnx.iter_modules(mod):
        for k, v in vars(sub).items():
            if k.startswith("_") or isinstance(v, (nnx.Variable, nnx.Module)) or _is_array(v):
                continue
            if isinstance(v, (list, tuple, dict)) and any(isinstance(y, (nnx.Variable, nnx.Module))
                                                          for y in jax.tree.leaves(v, is_leaf=lambda y: isinstance(
                                                              y, (nnx.Variable, nnx.Module)))):
                continue
            out["/".join(map(str, (*path, k)))] = v
    return out


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        try:
            if not bool(a[k] == b[k]):
                return False
        except Exception:  # an array-valued field: compared by the traced program instead
            return False
    return True


def _difference(a: dict, b: dict) -> str:
    """The first attribute two unit configurations differ in, as ``name=value vs value``."""
    for k in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        try:
            same = bool(va == vb)
        except Exception:
            same = False
        if not same:
            if hasattr(va, "to_diff_dict") and hasattr(vb, "to_dict"):  # a Hugging Face config: the keys that differ
                da, db = va.to_dict(), vb.to_dict()
                ks = [x for x in sorted(set(da) | set(db)) if da.get(x) != db.get(x)]
                return ", ".join(f"{k}.{x}={da.get(x)!r} vs {db.get(x)!r}" for x in ks[:3])
            return f"{k}={va!r} vs {vb!r}"
    return "equal attributes"


def _shape(y):
    return getattr(y, "shape", y)


# --- a scanned stack: the model's code before its scan ---------------------------------------------------------
_MARK = None


def _mark(*xs):
    """The identity on the layer's activation and side arrays, as a primitive of its own: marks the scan body
    that calls the stack's layer in a jaxpr, and what the layer is called on."""
    global _MARK
    if _MARK is None:
        from jax.extend.core import Primitive

        _MARK = Primitive("spmd_pipeline_layer")
        _MARK.multiple_results = True
        _MARK.def_impl(lambda *ys: list(ys))
        _MARK.def_abstract_eval(lambda *ys: list(ys))
    return _MARK.bind(*xs)


def _has_mark(jaxpr) -> bool:
    from jax.extend.core import jaxprs_in_params

    return any(e.primitive is _MARK or any(_has_mark(j) for j in jaxprs_in_params(e.params)) for e in jaxpr.eqns)


_CALLS = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2")  # sub-jaxpr on the eqn's own inputs


def _inner(e):
    """``(jaxpr, consts)`` of a call-like equation whose sub-jaxpr takes the equation's inputs, else None."""
    from jax.extend.core import ClosedJaxpr

    if e.primitive.name not in _CALLS:
        return None
    j = e.params.get("jaxpr", e.params.get("call_jaxpr"))
    j, consts = (j.jaxpr, list(j.consts)) if isinstance(j, ClosedJaxpr) else (j, [])
    return (j, consts) if j is not None and len(j.invars) == len(e.invars) else None


class _ScanCut:
    """Where the model's code enters the scan over its stack: the path of equations (through calls such as a
    ``jit``) to the ``scan`` whose body calls the stack's layer, found in one trace of ``loss_fn`` with the
    layer marked. ``_ScanCut(rest, mb)`` evaluates the code before it and returns the scan's carry: the first
    layer's input. The scan must iterate the stack's ``L`` layers and carry one array, the activation."""

    def __init__(self, calls: UnitCalls, loss_fn, params, mb):
        lay = calls.lay
        stack, n = lay.scanned, len(lay.units)

        def marked(path, mod, call, args, kwargs):
            leaves = jax.tree_util.tree_leaves((tuple(args[1:]), dict(kwargs)))
            return calls._output(_mark(args[0], *[leaves[k] for k in calls.side_pos])[0])

        rest = {p: lay.shapes[p] for p in lay.rest}
        closed = jax.make_jaxpr(lambda r, b: calls.run(loss_fn, lay.full_params(r), b, marked))(rest, mb)
        self.jaxpr, self.consts, self.path = closed.jaxpr, list(closed.consts), []
        j = closed.jaxpr
        while True:
            hits = [i for i, e in enumerate(j.eqns) if e.primitive is _MARK or _has_mark_eqn(e)]
            if len(hits) != 1:
                raise ValueError(f"pipeline: loss_fn runs the scanned stack {stack!r} {len(hits)} times; a pipeline "
                                 "runs it once per call.")
            e = j.eqns[hits[0]]
            self.path.append(hits[0])
            if e.primitive.name == "scan":
                break
            sub = _inner(e)
            if sub is None:
                raise ValueError(f"pipeline: the scan over the stack {stack!r} runs inside a {e.primitive.name!r} the "
                                 "pipeline cannot cut before; call the stack from the model's own code.")
            j = sub[0]
        if e.params["length"] != n or e.params["num_carry"] != 1:
            raise ValueError(f"pipeline: the scan over the stack {stack!r} runs {e.params['length']} iterations carrying "
                             f"{e.params['num_carry']} arrays; a pipeline cuts a scan over the stack's {n} layers that "
                             "carries one array, the activation.")
        carry = e.invars[e.params["num_consts"]].aval
        if (carry.shape, carry.dtype) != (calls.act.shape, calls.act.dtype):
            raise ValueError(f"pipeline: the scan over the stack {stack!r} carries {carry.str_short()}, but its layer "
                             f"takes {calls.act.shape} {calls.act.dtype}; the carry must be the layer's activation.")
        # the layer's side arrays: the scan's broadcast inputs (its consts), traced from the marked call up
        self.sides = [_scan_input(e, k, stack) for k in range(1, 1 + len(calls.side_pos))]
        self.carry = e.params["num_consts"]
        self.remat = _layer_remat(e)

    def __call__(self, rest, mb):
        ins = _eval_until(self.jaxpr, self.consts, jax.tree.leaves((rest, mb)), self.path)
        return ins[self.carry], [ins[i] for i in self.sides]


def _scan_input(scan, k: int, stack: str) -> int:
    """The input of ``scan`` (an equation) that operand ``k`` of the marked layer call is: one of its consts
    (broadcast into every iteration), reached through the calls between (``nn.remat``'s)."""
    where = f"pipeline: the layers of the scanned stack {stack!r} take an array (argument {k - 1} after the activation)"
    path, j = [], scan.params["jaxpr"].jaxpr
    while True:  # the equations from the scan's body down to the marked call
        i = next(i for i, e in enumerate(j.eqns) if e.primitive is _MARK or _has_mark_eqn(e))
        path.append((j, j.eqns[i]))
        if j.eqns[i].primitive is _MARK:
            break
        sub = _inner(j.eqns[i])
        if sub is None:
            raise ValueError(f"{where} through a {j.eqns[i].primitive.name!r} the pipeline cannot follow.")
        j = sub[0]
    v = path[-1][1].invars[k]
    for level in range(len(path) - 1, -1, -1):  # up from the marked call's jaxpr to the scan's body
        j = path[level][0]
        if v not in j.invars:
            raise ValueError(f"{where} computed inside the scan's body; a stage computes the layers' other arrays "
                             "from its micro-batch: pass them into the scan broadcast (nn.broadcast / in_axes=None).")
        j_index = j.invars.index(v)
        if level:
            v = path[level - 1][1].invars[j_index]
    if j_index >= scan.params["num_consts"]:
        raise ValueError(f"{where} that the scan carries or slices per layer; a stage computes the layers' other "
                         "arrays from its micro-batch: pass them into the scan broadcast (nn.broadcast / in_axes=None).")
    return j_index


def _layer_remat(scan) -> list[tuple[Any, bool]]:
    """The checkpoints (``nn.remat`` / ``nnx.remat`` / ``jax.checkpoint``) the scan's body runs the layer under:
    ``(policy, prevent_cse)`` of each, outermost first. A stage runs each layer of its slice under the same
    (``_Stages.chunk``), so its backward pass saves what the user's policy saves."""
    found, j = [], scan.params["jaxpr"].jaxpr
    while True:
        i = next((i for i, e in enumerate(j.eqns) if e.primitive is _MARK or _has_mark_eqn(e)), None)
        if i is None or j.eqns[i].primitive is _MARK:
            return found
        e = j.eqns[i]
        if e.primitive.name in ("checkpoint", "remat2"):
            found.append((e.params["policy"], bool(e.params["prevent_cse"])))
        sub = _inner(e)
        if sub is None:
            return found
        j = sub[0]


def _has_mark_eqn(e) -> bool:
    from jax.extend.core import jaxprs_in_params

    return any(_has_mark(j) for j in jaxprs_in_params(e.params))


def _eval_until(jaxpr, consts, args, path):
    """``jaxpr``'s equations before ``path[0]`` evaluated on ``args``; then into that equation's sub-jaxpr
    (``path[1:]``), or, at the end of the path (the scan), its carry's input."""
    from jax.extend.core import DropVar, Literal

    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    i, *more = path
    for e in jaxpr.eqns[:i]:
        params = e.primitive.get_bind_params(e.params)  # (subfuns, params) on older jax
        subfuns, params = params if isinstance(params, tuple) else ((), params)
        with e.ctx.manager if hasattr(e, "ctx") else contextlib.nullcontext():
            outs = e.primitive.bind(*subfuns, *map(read, e.invars), **params)
        for v, o in zip(e.outvars, outs if e.primitive.multiple_results else [outs]):
            if not isinstance(v, DropVar):
                env[v] = o
    e = jaxpr.eqns[i]
    ins = [read(v) for v in e.invars]
    if not more:
        return ins  # the scan's inputs
    sub, sub_consts = _inner(e)
    return _eval_until(sub, sub_consts, ins, more)
