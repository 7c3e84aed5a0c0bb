"""Where a tensor-parallel cut meets the model's heads: read the traced program, name the module.

``ColwiseParallel`` cuts a projection's output features over ``tp``; the model then reshapes them by its
head count, ``(..., H * hd) -> (..., H, hd)``. ``head_splits`` walks the step's jaxpr from each marked
projection output (``checkpoint_name`` in ``spmd.parallel.styles._tp_calls``: column-parallel outputs, and
the outputs of projections whole over tp) through elementwise ops to the reshape that splits its last dim,
and reports each module's head count. ``whole_over_tp`` turns them into the step's decision:

- a cut projection whose heads divide by the tp size ``n`` runs as planned (each device its heads);
- a cut projection with fewer heads than ``n``, ``n`` a multiple of them (grouped-query attention's key /
  value heads, 2 heads over tp=4): no device can hold a whole head of its own, so the projection runs whole
  over tp (Megatron's rule for tp > KV heads): its weight gathered over tp at the call, each device computing
  every head and reading the one its query heads use; its output's gradient summed over the devices that
  share a head (``spmd.parallel.cost._comm``);
- a projection left out of the plan (whole over tp) split into heads next to a column-parallel one of the
  same parent module (its query heads cut over tp): the same, without the gather;
- heads that neither divide nor are divided by ``n`` (3 heads over tp=4): refused, naming the module.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from spmd.parallel.styles._hooks import COLWISE_MARK, WHOLE_MARK
from spmd.parallel._jaxprs import sub_jaxprs

__all__ = ["head_splits", "sliced_heads", "whole_over_tp", "check_head_cuts", "check_whole_sequence", "positional_params",
           "whole_sequence_products", "dot_params", "lookup_cotangents", "side_params"]

# elementwise ops a projection's output passes through on its way to the heads' reshape; ``reduce_precision`` at
# its own dtype's precision is the identity that ``jax.checkpoint`` puts after each value it saves (a re-gathering
# unit's policy saves a projection's output and recomputes its reshape: ``_fully_shard._saved``)
_PASS = {"convert_element_type", "add", "sub", "mul", "div", "neg", "copy", "copy_p", "tanh", "logistic",
         "exp", "max", "min", "integer_pow", "pow", "sqrt", "rsqrt", "erf", "select_n", "pjit", "name",
         "reduce_precision"}


def head_splits(jaxpr: Any, origin: dict | None = None, found: dict | None = None) -> dict:
    """``{module: (cut, n, heads, features)}``: each marked projection output the program reshapes into heads
    (``cut``: column-parallel; else whole over tp)."""
    origin = dict(origin or {})
    found = {} if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        label = str(eqn.params.get("name", "")) if name == "name" else ""
        if label.startswith((COLWISE_MARK, WHOLE_MARK)):
            _, fqn, n = label.split("|")
            origin[eqn.outvars[0]] = (fqn, int(n), eqn.outvars[0].aval.shape[-1], label.startswith(COLWISE_MARK))
            continue
        src = [origin[v] for v in eqn.invars if not hasattr(v, "val") and v in origin]
        if name == "reshape" and src:
            fqn, n, feat, cut = src[0]
            shape_in = eqn.invars[0].aval.shape
            shape_out = eqn.outvars[0].aval.shape
            if (len(shape_out) == len(shape_in) + 1 and tuple(shape_out[:-2]) == tuple(shape_in[:-1])
                    and shape_out[-2] * shape_out[-1] == feat):
                found.setdefault(fqn, (cut, n, shape_out[-2], feat))
            continue
        subs = sub_jaxprs(eqn)
        if subs and src:
            for sub in subs:
                inner = {}
                for outer_v, inner_v in zip(eqn.invars, sub.invars[-len(eqn.invars):] if len(sub.invars) >= len(
                        eqn.invars) else sub.invars):
                    if not hasattr(outer_v, "val") and outer_v in origin:
                        inner[inner_v] = origin[outer_v]
                head_splits(sub, inner, found)
        elif subs:
            for sub in subs:
                head_splits(sub, None, found)
        if src and name in _PASS:
            for v in eqn.outvars:
                if getattr(v.aval, "shape", ())[-1:] == (src[0][2],):
                    origin[v] = src[0]
    return found


def sliced_heads(jaxpr: Any, origin: dict | None = None, heads: dict | None = None,
                 found: dict | None = None) -> dict:
    """``{module: (features, heads)}``: each column-parallel projection whose output the program reshapes into
    heads and then slices along the heads (a fused ``qkv`` split into q, k and v): a piece is not the tp cut, so
    GSPMD moves heads across the tp devices (collective-permutes) to lay it out."""
    origin, heads = dict(origin or {}), dict(heads or {})
    found = {} if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        label = str(eqn.params.get("name", "")) if name == "name" else ""
        if label.startswith(COLWISE_MARK):
            origin[eqn.outvars[0]] = (label.split("|")[1], eqn.outvars[0].aval.shape[-1])
            continue
        src = [origin[v] for v in eqn.invars if not hasattr(v, "val") and v in origin]
        hsrc = [heads[v] for v in eqn.invars if not hasattr(v, "val") and v in heads]
        if name == "reshape" and src:
            (fqn, feat), shape_in, shape_out = src[0], eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            if (len(shape_out) == len(shape_in) + 1 and tuple(shape_out[:-2]) == tuple(shape_in[:-1])
                    and shape_out[-2] * shape_out[-1] == feat):
                heads[eqn.outvars[0]] = (fqn, feat, len(shape_out) - 2, shape_out[-2])
            continue
        if name in ("split", "slice") and eqn.invars[0] in heads:
            fqn, feat, ax, n_heads = heads[eqn.invars[0]]
            shape = eqn.invars[0].aval.shape
            if (eqn.params["axis"] == ax if name == "split" else
                    (eqn.params["start_indices"][ax], eqn.params["limit_indices"][ax]) != (0, shape[ax])):
                found.setdefault(fqn, (feat, n_heads))
            continue
        for sub in sub_jaxprs(eqn):
            inner_o, inner_h = {}, {}
            if len(sub.invars) >= len(eqn.invars):
                for outer_v, inner_v in zip(eqn.invars, sub.invars[-len(eqn.invars):]):
                    if not hasattr(outer_v, "val"):
                        if outer_v in origin:
                            inner_o[inner_v] = origin[outer_v]
                        if outer_v in heads:
                            inner_h[inner_v] = heads[outer_v]
            sliced_heads(sub, inner_o, inner_h, found)
        if name in _PASS:
            for v in eqn.outvars:
                if src and getattr(v.aval, "shape", ())[-1:] == (src[0][1],):
                    origin[v] = src[0]
                if hsrc and getattr(v.aval, "shape", ()) == eqn.invars[0].aval.shape:
                    heads[v] = hsrc[0]
    return found


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def whole_over_tp(found: dict) -> dict:
    """``{module: heads}``: the projections that run whole over tp (see the module doc); raises ``ValueError``
    for a cut that would split a head."""
    out = {}
    for fqn, (cut, n, heads, feat) in found.items():
        if not cut or heads % n == 0:
            continue
        if n % heads:
            raise ValueError(
                f"parallelize_module: ColwiseParallel on {fqn!r} cuts its {feat} output features over tp={n}, "
                f"and the model splits them into {heads} heads of {feat // heads}: {heads} heads neither divide by "
                f"tp={n} nor divide it, so no even split exists (a cut would split a head, and the devices cannot "
                f"share the heads evenly). Use a tp size that divides {heads} or that {heads} divides, or leave "
                f"{fqn!r} out of the plan (its heads then stay whole on every device).")
        out[fqn] = heads
    cut_parents = {_parent(f) for f, (cut, n, heads, _) in found.items() if cut}
    for fqn, (cut, n, heads, _) in found.items():
        if not cut and _parent(fqn) in cut_parents:
            out[fqn] = heads
    return out


def check_head_cuts(jaxpr: Any) -> None:
    """Raise ``ValueError`` where a column-parallel output is split into heads with no even split over tp."""
    whole_over_tp(head_splits(jaxpr))


def _pairs_positions(eqn, seq_len: int) -> bool:
    """A ``dot_general`` of two activations (rank 3+) each keeping a free dim of ``seq_len``, the two its output's
    last dims: a [.., T, T] product of scores."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars[:2]]
    out = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    # two activations share their batch dims (a projection's kernel, even one whose width equals seq_len, has none)
    if not lb or any(len(s) < 3 for s in shapes) or len(out) < 3 or out[-2:] != (seq_len, seq_len):
        return False
    return all(any(d == seq_len for i, d in enumerate(s) if i not in c and i not in b)
               for s, c, b in zip(shapes, (lc, rc), (lb, rb)))


def whole_sequence_products(jaxpr: Any, seq_len: int, scope: str = "") -> list[tuple[tuple, str]]:
    """``[(shape, name stack)]`` of every product over two sequence dims of the whole cut sequence (``[.., T, T]``
    attention scores of a model's own einsum), each with the name stack it was traced under (the step's module
    scopes, ``spmd.parallel.context._calls.scope_name``, say which module computed it)."""
    out = []
    for eqn in jaxpr.eqns:
        stack = f"{scope}/{eqn.source_info.name_stack}"
        if eqn.primitive.name == "dot_general" and _pairs_positions(eqn, seq_len):
            out.append((tuple(eqn.outvars[0].aval.shape), stack))
        for sub in sub_jaxprs(eqn):
            out.extend(whole_sequence_products(sub, seq_len, stack))
    return out


def check_whole_sequence(jaxpr: Any, seq_len: int, n: int, gathered: Callable[[str], bool] = lambda s: False) -> None:
    """Refuse a product over two sequence dims of the whole cut sequence (``[.., T, T]`` attention scores from a
    model's own einsum) outside the intercepted calls, whose products are on each device's positions, and outside
    the modules run on the gathered sequence (``gathered(name stack)``)."""
    for shape, stack in whole_sequence_products(jaxpr, seq_len):
        if not gathered(stack):
            raise ValueError(
                f"make_train_step: the model multiplies over the whole sequence cut over cp={n} (a product of "
                f"shape {shape!r}: attention scores [.., {seq_len}, {seq_len}] of its own einsum) outside any "
                "submodule taking the [batch, seq, ...] sequence, which the step could run on the sequence gathered "
                "over cp. Compute the attention in a submodule called on the hidden states (its input gathered over "
                "cp, its output cut back), or call jax.nn.dot_product_attention or flax's dot_product_attention "
                "(ring attention across the cut; models.Llama: LlamaConfig(attn_implementation='sdpa')), or leave "
                "cp out of the mesh.")


_ALONG = {"slice", "dynamic_slice", "reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "expand_dims",
          "copy", "copy_p", "all_gather", "sharding_constraint", "reduce_precision"}  # ops that carry a parameter's rows
# along unmixed (reduce_precision: what jax.checkpoint puts on a saved value, at its own precision a no-op)


def _sub_invars(eqn) -> list:
    """``(sub-jaxpr, its invars)`` where a sub-jaxpr takes the equation's operands one for one."""
    return [(sub, sub.invars) for sub in sub_jaxprs(eqn, called=True)]


def positional_params(jaxpr: Any, invars: Any, seq_len: int) -> set[int]:
    """Which of ``invars`` (a traced step's parameter leaves, by index) are added to the sequence's activations
    row by row: a learned position table whose rows ``[0, seq_len)`` are added to ``[batch, seq, ...]`` hidden
    states (carried there by slices, reshapes and broadcasts only). Under a sequence cut over cp its gradient is
    cut over cp on those rows, not a partial sum."""
    found: set[int] = set()
    shapes = [tuple(v.aval.shape) for v in invars]

    def table(src: int, shape: tuple) -> bool:
        """Parameter ``src`` reaches ``shape`` as a table broadcast over the batch: a ``[.., seq, ..]`` table of
        lower rank (``[seq, d]`` -> ``[batch, seq, d]``) or one stored with a leading 1 (``[1, seq, d]``); not a
        parameter of the same rank updated in place (an optimizer's ``p - lr * g`` on an ``[E, d, f]`` expert
        whose ``d`` equals the sequence length)."""
        own = shapes[src]
        return len(own) < len(shape) or (len(own) == len(shape) and own[0] == 1)

    def walk(jx, origin: dict) -> None:
        origin = dict(origin)
        for eqn in jx.eqns:
            ins = [origin.get(id(v)) if not hasattr(v, "val") else None for v in eqn.invars]
            name = eqn.primitive.name
            if name in _ALONG and ins and ins[0] is not None:
                origin[id(eqn.outvars[0])] = ins[0]
            elif name in ("add", "add_any", "sub") and len(ins) == 2:
                for k, src in enumerate(ins):
                    shape = tuple(eqn.invars[k].aval.shape)
                    other = tuple(getattr(eqn.invars[1 - k].aval, "shape", ()))
                    if (src is not None and len(shape) >= 3 and shape[1] == seq_len and len(other) >= 3
                            and other[1] == seq_len and table(src, shape)):
                        found.add(src)
            for sub, sub_in in _sub_invars(eqn):
                walk(sub, {id(sv): src for sv, src in zip(sub_in, ins) if src is not None})

    walk(jaxpr, {id(v): i for i, v in enumerate(invars)})
    return found


def dot_params(jaxpr: Any, invars: Any) -> set[int]:
    """Which of ``invars`` (a traced step's parameter leaves, by index) are an operand of a product
    (``dot_general``) of the model's forward pass (under ``jvp``, not its transpose nor the optimizer's update),
    carried there unmixed (transposed, cast, reshaped): an embedding table that is also a tied output head
    (linen's ``Embed.attend``, a ``Dense`` applied with the table as its kernel) is one."""
    found: set[int] = set()

    def walk(jx, origin: dict, ctx: str) -> None:
        origin = dict(origin)
        for eqn in jx.eqns:
            ins = [origin.get(id(v)) if not hasattr(v, "val") else None for v in eqn.invars]
            name, stack = eqn.primitive.name, f"{ctx}/{eqn.source_info.name_stack}"
            if (name in _ALONG or name == "transpose") and ins and ins[0] is not None:
                origin[id(eqn.outvars[0])] = ins[0]
            elif name == "dot_general" and "jvp(" in stack and "transpose(" not in stack:
                found.update(src for src in ins if src is not None)
            for sub, sub_in in _sub_invars(eqn):
                walk(sub, {id(sv): src for sv, src in zip(sub_in, ins) if src is not None}, stack)

    walk(jaxpr, {id(v): i for i, v in enumerate(invars)}, "")
    return found


def lookup_cotangents(jaxpr: Any, scopes: Callable[[str], list]) -> dict[str, int]:
    """``{module: key}``: the embedding lookups (``jnp.take`` under a module's scope, ``scopes(name stack)``) by the
    cotangent their transpose scatter-adds: lookups whose outputs are summed (GPT-2's token and position tables)
    share one (one key), which GSPMD gathers over cp once for both."""
    out: dict[str, int] = {}

    def walk(jx) -> None:
        for eqn in jx.eqns:
            stack = str(eqn.source_info.name_stack)
            if (eqn.primitive.name in ("pjit", "jit") and str(eqn.params.get("name", "")) == "_take"
                    and "transpose(" in stack and scopes(stack)):
                cts = [v for v in eqn.invars if not hasattr(v, "val") and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
                if len(cts) == 1:
                    out[scopes(stack)[-1]] = id(cts[0])
                continue
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return out


_BINARY = {"add", "add_any", "sub", "mul", "div", "max", "min"}


def _broadcast_into(eqn, seq_len: int) -> bool:
    """A ``broadcast_in_dim`` of a per-example value (its batch dim kept) whose output gains a sequence dim (dim 1
    of ``seq_len`` positions) its input lacks (absent, or of size 1); not a bias's broadcast over the batch."""
    if eqn.primitive.name != "broadcast_in_dim":
        return False
    out, x = tuple(eqn.outvars[0].aval.shape), tuple(getattr(eqn.invars[0].aval, "shape", ()))
    dims = tuple(eqn.params["broadcast_dimensions"])
    return (len(out) >= 2 and out[1] == seq_len and 0 in dims and x[dims.index(0)] == out[0]
            and (1 not in dims or x[dims.index(1)] == 1))


_DATA = -1  # in a value's dependencies: it is computed from a batch leaf whole over cp (a side input)


def side_params(jaxpr: Any, params: Any, seqs: Any, seq_len: int, sides: Any = ()) -> tuple[set[int], list[int]]:
    """``(side, joins)``: the parameters (of ``params``, by index) computed on values whole over cp only, and the
    bytes of each place where such a value joins the sequence (``joins``). ``seqs``: the batch leaves cut over cp
    (the sequence); ``sides``: the batch leaves whole over cp. A parameter computed with a ``[batch, d]`` batch
    vector of ``sides`` (a dense layer on it) into a value the model broadcasts into the ``[batch, seq, ...]``
    hidden states: the broadcast's transpose sums its cotangent over the cut sequence (GSPMD: one all-reduce over cp
    of the broadcast's input, there), and the parameters' gradients formed from it are whole over cp (no all-reduce
    of theirs). A value computed from parameters alone is no side value, whatever its shape: a bias broadcast
    ``[1, 1, d] -> [1, seq, d]`` at one row per device reaches the sequence as a parameter does, its gradient a
    partial sum over cp. A parameter that meets the sequence otherwise is not a side one. Read off the forward pass
    (outside ``transpose``)."""
    touched: set[int] = set()
    joined: set[int] = set()
    joins: list[int] = []

    def walk(jx, seq: set, deps: dict, ctx: str) -> tuple[set, dict]:
        seq, deps = set(seq), dict(deps)
        for eqn in jx.eqns:
            stack = f"{ctx}/{eqn.source_info.name_stack}"
            if "transpose(" in stack:
                continue
            ins = [v for v in eqn.invars if not hasattr(v, "val")]
            subs = _sub_invars(eqn)
            if subs and len(subs) == 1 and len(subs[0][0].outvars) == len(eqn.outvars):
                sub, sub_in = subs[0]
                s_in = {id(sv) for sv, v in zip(sub_in, eqn.invars) if not hasattr(v, "val") and id(v) in seq}
                d_in = {id(sv): deps[id(v)] for sv, v in zip(sub_in, eqn.invars)
                        if not hasattr(v, "val") and id(v) in deps}
                s_out, d_out = walk(sub, s_in, d_in, stack)
                for o, so in zip(eqn.outvars, sub.outvars):
                    if id(so) in s_out:
                        seq.add(id(o))
                    elif id(so) in d_out:
                        deps[id(o)] = d_out[id(so)]
                continue
            d = frozenset().union(*[deps.get(id(v), frozenset()) for v in ins])
            name = eqn.primitive.name
            if any(id(v) in seq for v in ins):
                out = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
                for v in ins:
                    own = deps.get(id(v), frozenset()) - {_DATA}  # its parameters
                    if id(v) in seq or not own:
                        continue
                    x = tuple(getattr(v.aval, "shape", ()))
                    if (_DATA in deps[id(v)] and len(x) == len(out) >= 2 and out[1] == seq_len and x[1] == 1
                            and x[0] == out[0] and name in _BINARY):  # broadcast into the sequence by the op itself
                        joined.update(own)
                        joins.append(int(np.prod(x)) * v.aval.dtype.itemsize)
                    else:
                        touched.update(own)
                seq.update(id(o) for o in eqn.outvars)
            elif _DATA in d and len(d) > 1 and _broadcast_into(eqn, seq_len):
                joined.update(d - {_DATA})
                x = eqn.invars[0].aval
                joins.append(int(np.prod(x.shape)) * x.dtype.itemsize)
                seq.add(id(eqn.outvars[0]))
            elif d:
                for o in eqn.outvars:
                    deps[id(o)] = d
        return seq, deps

    deps = {id(v): frozenset({i}) for i, v in enumerate(params)}
    deps.update({id(v): frozenset({_DATA}) for v in sides})
    walk(jaxpr, {id(v) for v in seqs}, deps, "")
    return joined - touched, joins
