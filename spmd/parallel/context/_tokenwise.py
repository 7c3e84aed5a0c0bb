"""Whether a traced module keeps positions apart: each output position a function of the same input position alone
(a projection, a norm, an activation), read from its jaxpr, so that it may run on a device's part of a sequence.

``token_wise(jaxpr, seq)``: the inputs flagged in ``seq`` carry the sequence on dim 1; it follows that dim through
the equations and answers True only where every equation is known to keep it apart (elementwise ops, products and
reductions over other dims, broadcasts, transposes, reshapes that leave the leading dims, calls whose bodies do the
same) and every output carries it on dim 1. Anything else (a cumulative sum or a product over the sequence, a
sort, a gather, a primitive it does not know) answers False: the module is run as it was.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from spmd.parallel.context._moves import gather_seq
from spmd.parallel._jaxprs import sub_jaxprs

__all__ = ["run_on_cut", "token_wise"]

_ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan",
    "tanh", "xor"}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin"}


def _out_axis(eqn, axes: list) -> int | None | bool:
    """The sequence's dim in the equation's (first) output, None where no operand carries it, False where the
    equation mixes positions or is not known to keep them apart."""
    carried = [(i, a) for i, a in enumerate(axes) if a is not None]
    if not carried:
        return None
    name, p = eqn.primitive.name, eqn.params
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    if name in _ELEMENTWISE:
        a = carried[0][1]
        ok = all(ax == a and shapes[i][a] == out_shape[a] for i, ax in carried) and all(  # size-1 dims broadcast
            s == () or len(s) == len(out_shape) and all(m in (n, 1) for m, n in zip(s, out_shape)) for s in shapes)
        return a if ok else False
    if len(carried) != 1:
        return False
    i, a = carried[0]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        contract, batch = (lc, lb) if i == 0 else (rc, rb)
        if a in contract:
            return False
        if a in batch:
            return list(batch).index(a)
        nb = len(lb)
        free_l = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        if i == 0:
            return nb + free_l.index(a)
        free_r = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
        return nb + len(free_l) + free_r.index(a)
    if name in _REDUCE:
        red = tuple(p["axes"]) if "axes" in p else (p.get("axis"),)
        return False if a in red else a - sum(1 for d in red if d < a)
    if name == "broadcast_in_dim" and i == 0:
        return p["broadcast_dimensions"][a]
    if name == "transpose":
        return list(p["permutation"]).index(a)
    if name == "squeeze":
        dims = tuple(p["dimensions"])
        return False if a in dims else a - sum(1 for d in dims if d < a)
    if name == "reshape" and i == 0:
        old, new = shapes[0], tuple(p["new_sizes"])
        return a if old[:a + 1] == new[:a + 1] else False
    if name == "top_k" and i == 0:
        return a if a != len(shapes[0]) - 1 else False
    return False


def token_wise(jaxpr: Any, seq: list[bool]) -> bool:
    """Whether ``jaxpr`` (a module's traced call; ``seq``: which of its inputs carry the sequence on dim 1) keeps
    positions apart, every output carrying the sequence on dim 1."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = _walk(jaxpr, [1 if s else None for s in seq])
    return found is not False and all(a == 1 for a in found)


def _walk(jx: Any, ins: list) -> list | bool:
    axis: dict[int, int] = {id(v): a for v, a in zip(jx.invars, ins) if a is not None}
    for eqn in jx.eqns:
        axes = [None if hasattr(v, "val") else axis.get(id(v)) for v in eqn.invars]
        subs = sub_jaxprs(eqn, called=True)
        if subs and any(a is not None for a in axes):
            outs = _walk(subs[0], axes)
            if outs is False or len(outs) != len(eqn.outvars):
                return False
            for v, a in zip(eqn.outvars, outs):
                if a is not None:
                    axis[id(v)] = a
            continue
        a = _out_axis(eqn, axes)
        if a is False:
            return False
        if a is not None:
            if len(eqn.outvars) != 1 and eqn.primitive.name != "top_k":
                return False
            for v in eqn.outvars:
                if math.prod(getattr(v.aval, "shape", ())) and a < len(v.aval.shape):
                    axis[id(v)] = a
    return [axis.get(id(v)) if not hasattr(v, "val") else None for v in jx.outvars]


def run_on_cut(calls: Any, call: Any, run: Callable) -> Any:
    """``ContextCalls.around``'s way with a submodule of an MoE's routing run on the gathered sequence
    (``calls.routers``): one called on that module's gathered input whose code keeps positions apart
    (``token_wise``: the router's projection) runs on this device's positions instead, and its outputs are gathered
    over cp (one all-gather each, in the routing's record); its parameters' gradients are then sums over cp
    (``calls.cut_params``), as every module's on the cut sequence. ``NotImplemented``: anything else, run as it is."""
    if not calls.whole_of:
        return NotImplemented
    leaves, tree = jax.tree.flatten((call.args, call.kwargs))
    hits = [calls.whole_of.get(id(x)) for x in leaves]
    hits = [h if h is not None and h[0] is x else None for h, x in zip(hits, leaves)]
    tp = call.hooks.model.tp
    if not any(h is not None for h in hits) or (tp and call.tp_key and tp.style_for(call.tp_key)):
        return NotImplemented  # a tp style inside the routing takes the whole sequence
    args, kwargs = jax.tree.unflatten(tree, [h[1] if h is not None else x for h, x in zip(hits, leaves)])
    try:
        program = call.abstract(args, kwargs, how=lambda f, *a: jax.make_jaxpr(f)(*a))
    except Exception:  # a module flax will not trace on its own (one writing a collection): run as it is
        return NotImplemented
    if not token_wise(program, [h is not None for h in hits]):
        return NotImplemented
    joint, rec = next((h[2], h[3]) for h in hits if h is not None)
    given = call.args, call.kwargs
    call.args, call.kwargs = args, kwargs
    try:
        out = run(call)
    finally:
        call.args, call.kwargs = given
    calls.cut_params.update(p for p, _ in call.params())
    rec.setdefault("on_cut", []).append(call.fqn)

    def whole(y):
        rec["gathered"].append((tuple(y.shape), str(y.dtype)))
        return gather_seq(y, calls, joint) if jnp.issubdtype(y.dtype, jnp.inexact) else calls._all_gather(y, joint=joint)

    return jax.tree.map(whole, out)
