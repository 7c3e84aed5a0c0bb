"""Which gradients to reduce in their matmul's layout: read off the backward pass's own jaxpr.

A linen / nnx ``Dense`` computes ``x @ kernel`` with the kernel ``[in, out]``; JAX's transpose of that
``dot_general`` computes the kernel's gradient as ``dot_general(dy, x)`` (``[out, in]``) followed by a
``transpose``. Reduced as it comes (an all-reduce over the data dims of the ``[in, out]`` gradient), XLA folds
the transpose into the dot, which then contracts its left operand on dim 0; XLA:CPU runs such a dot outside
its fast matmul path (YNNPACK), several times slower on the shapes of a layer's weight gradient. GSPMD's
partitioner puts the all-reduce right after the dot, before the transpose, and keeps the dot canonical. The
step does the same for the gradients that are the transpose of a dot's output: it reduces ``g.T`` (the dot's
own output: the two transposes cancel) and transposes the reduced block back. The collective and its bytes
are unchanged. With ``accum_steps > 1`` the flagged gradients (those reduced over the data dims, not
reduce-scattered) accumulate over the micro-batches in the dot's own layout too (the loop's carry holds
``g.T``), so the dot inside the loop stays canonical, and are reduced so. Decided per gradient from the
program (the backward jaxpr; one micro-batch's under accumulation), not from module types or names.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal

__all__ = ["transposed_dot_grads", "zero_grads", "equal_grads", "reduced_once", "gathered_dot_grads", "output_cut",
           "out_cut_gathers"]

_UNARY = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "reduce_precision"})
_LOOPS = frozenset({"scan", "while", "cond"})


class _Producers:
    """The equation producing a variable, per jaxpr (each jaxpr's table built once), for the walkers below,
    which follow a gradient back through the backward pass's equations."""

    def __init__(self):
        self._tables: dict[int, dict] = {}

    def __call__(self, jaxpr: Any, var: Any) -> tuple[Any, int] | None:
        """``(equation, output index)`` producing ``var`` in ``jaxpr``; None for a literal or an input."""
        if isinstance(var, Literal):
            return None
        table = self._tables.get(id(jaxpr))
        if table is None:
            table = self._tables[id(jaxpr)] = {id(v): (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
        return table.get(id(var))


def _called(eqn: Any, i: int) -> tuple[Any, Any] | bool:
    """Output ``i`` of a call-like equation (``pjit``, ``remat``, ``custom_jvp_call`` / ``custom_vjp_call``):
    ``(the called jaxpr, its output)`` to follow; False for a call whose outputs do not map one to one; True
    where ``eqn`` is no call (a loop is none: its body is not entered)."""
    sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    if sub is None or eqn.primitive.name in _LOOPS:
        return True
    inner = getattr(sub, "jaxpr", sub)
    return (inner, inner.outvars[i]) if len(inner.outvars) == len(eqn.outvars) else False


def transposed_dot_grads(closed: Any, stacked: bool = False) -> list[bool]:
    """For each output of ``closed`` (the ``ClosedJaxpr`` of a backward pass): whether it is the 2-D transpose
    of a ``dot_general``'s output (through calls, dtype converts and sums of such). ``stacked``: also a 3-D
    output that is a ``scan``'s stacked per-iteration outputs (through a transpose that moves the layer axis
    alone, as ``nn.scan`` with ``variable_axes={"params": 1}`` does), each of them such a 2-D transpose: a
    kernel ``[L, in, out]`` of blocks under ``nn.scan`` / ``nnx.scan``."""
    producer = _Producers()

    def walk(jaxpr, var, want: str, depth: int = 0) -> bool:
        hit = producer(jaxpr, var) if depth <= 64 else None
        if hit is None:
            return False
        eqn, i = hit
        name = eqn.primitive.name
        call = _called(eqn, i)
        if call is not True:
            return bool(call) and walk(*call, want, depth + 1)
        if name in _UNARY:
            return walk(jaxpr, eqn.invars[0], want, depth + 1)
        if name == "add_any":
            return any(walk(jaxpr, v, want, depth + 1) for v in eqn.invars)
        if want == "layers":  # a 3-D stack of per-layer 2-D gradients
            if name == "transpose":  # the layer axis moved back where it is stored; the other two in order
                perm = tuple(eqn.params["permutation"])
                return (tuple(d for d in perm if d != 0) == (1, 2)
                        and walk(jaxpr, eqn.invars[0], want, depth + 1))
            if name == "scan" and i >= eqn.params["num_carry"]:  # the per-iteration outputs, stacked on axis 0
                body = eqn.params["jaxpr"].jaxpr
                return walk(body, body.outvars[i], "transpose", depth + 1)
            return False
        if want == "transpose":
            return (name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0)
                    and walk(jaxpr, eqn.invars[0], "dot", depth + 1))
        return name == "dot_general"

    def flagged(v) -> bool:
        rank = len(getattr(v.aval, "shape", ()))
        return (rank == 2 and walk(jaxpr, v, "transpose")) or (stacked and rank == 3 and walk(jaxpr, v, "layers"))

    jaxpr = closed.jaxpr
    return [flagged(v) for v in jaxpr.outvars]


# collectives are never taken for one another (XLA merges two equal all-reduces only where nothing orders them)
_NEVER_EQUAL = frozenset({"psum", "pmax", "pmin", "all_gather", "reduce_scatter", "all_to_all", "ppermute",
                          "psum_scatter", "axis_index", "rng_bit_generator", "random_bits", "random_seed"})


def equal_grads(closed: Any) -> list[int | None]:
    """For each output of ``closed`` (the ``ClosedJaxpr`` of a backward pass): the index of the first earlier
    output that is the same value by construction, else ``None``. Two outputs are the same value where the same
    equation computes them: the same primitive with the same parameters on the same inputs, recursively (value
    numbering: what XLA's common-subexpression elimination merges). The residual sum's cotangent reaching two
    BatchNorm biases (``y + r``, each the output of a BatchNorm) is one: each bias's gradient is the
    ``reduce_sum`` of that cotangent over the same axes, and XLA merges their two all-reduces into one.
    Equations with effects, collectives and random bits are never equal to another; a parameter it cannot hash
    (an array, a list) makes its equation unique too."""
    numbers: dict[int, Any] = {}  # id(var) -> its value number
    table: dict[Any, int] = {}  # an equation's key -> its first outputs' value number
    fresh = iter(range(1 << 62))

    def hashable(v: Any) -> Any:
        try:
            hash(v)
        except TypeError:
            return ("id", id(v))
        return v

    def number(var) -> Any:
        if isinstance(var, Literal):
            val = var.val
            try:
                import numpy as np

                a = np.asarray(val)
                return ("lit", a.dtype.str, a.shape, a.tobytes())
            except Exception:  # noqa: BLE001 (an unusual literal: unique)
                return ("id", id(var))
        n = numbers.get(id(var))
        if n is None:  # an input of the backward pass (a residual, the seed): itself
            n = numbers[id(var)] = ("in", next(fresh))
        return n

    jaxpr = closed.jaxpr
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.effects or name in _NEVER_EQUAL:
            key = ("unique", next(fresh))
        else:
            params = tuple(sorted((k, hashable(v)) for k, v in eqn.params.items()))
            key = (name, params, tuple(number(v) for v in eqn.invars))
        base = table.setdefault(key, next(fresh))
        for i, v in enumerate(eqn.outvars):
            numbers[id(v)] = ("eqn", base, i)
    first: dict[Any, int] = {}
    out: list[int | None] = []
    for i, v in enumerate(jaxpr.outvars):
        n = number(v)
        if isinstance(v, Literal):  # a literal gradient (a zero: zero_grads's) is no reduction to merge
            out.append(None)
            continue
        j = first.setdefault(n, i)
        out.append(None if j == i else j)
    return out


def reduced_once(same: list, entries: list, zero: list, cut_over: list) -> list[str]:
    """The paths of the parameters (``entries``: their plan entries, in the backward pass's output order) whose
    gradient is an earlier one's value (``same``: :func:`equal_grads`), neither zero by construction (``zero``)
    and both averaged whole over the data dims (``cut_over``: the data dims each is cut over, none): the step's
    one all-reduce of both, which XLA's common-subexpression elimination reduces once, counts once."""
    return [e.path for i, (e, j) in enumerate(zip(entries, same)) if j is not None and not zero[i] and not zero[j]
            and not cut_over[i] and not cut_over[j] and e.local_shape == entries[j].local_shape]


def output_cut(forward: Any, params: Any, paths: Any) -> tuple[str, ...]:
    """The paths (``paths``: one per leaf of ``params``, in leaf order) of the parameters whose gradient is a
    dot's output transposed (:func:`transposed_dot_grads`, ``stacked``: per layer, for blocks under a scan) in
    the backward pass of ``forward(params)`` (its floating outputs summed), traced abstractly: nothing runs or
    compiles. A ``Dense`` kernel ``[in, out]`` is one; cut over fsdp on its output dim (dim 1, as torch's FSDP
    cuts a ``Linear`` weight ``[out, in]`` on dim 0), it is gathered as the all-gather of its shard's transpose
    on dim 0 and its gradient is reduce-scattered on dim 0 of the dot's own output ``[out, in]``: neither needs
    a full-size transposed copy, and the weight-gradient dot stays canonical (contracting its operands' last
    dims). A stacked kernel ``[L, in, out]`` is so per layer, inside the scan's loop."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    leaves, treedef = jax.tree.flatten(params)
    abstract = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
    floats = [i for i, x in enumerate(abstract) if jnp.issubdtype(x.dtype, jnp.floating)]  # the differentiable

    def total(fl, others):
        full = list(others)
        for i, x in zip(floats, fl):
            full[i] = x
        outs = [y for y in jax.tree.leaves(forward(jax.tree.unflatten(treedef, full)))
                if jnp.issubdtype(jnp.result_type(y), jnp.floating)]
        return sum((jnp.sum(y.astype(jnp.float32)) for y in outs), jnp.zeros((), jnp.float32))

    closed = jax.make_jaxpr(jax.grad(total))([abstract[i] for i in floats], abstract)
    flagged = transposed_dot_grads(closed, stacked=True)
    return tuple(paths[i] for i, f in zip(floats, flagged) if f)


def out_cut_gathers(plan: Any, fsdp: str | None) -> list[str]:
    """The paths of ``plan.out_cut``'s parameters (a ``ParamPlan``'s) that are 2-D (one layer of a stacked one:
    its scan gathers it per layer) and cut over the mesh dim ``fsdp`` (off a stacked one's layer axis): gathered
    transposed (``plan._shard.gather_unit``), no backward pass read for it."""
    if fsdp is None or not plan.out_cut:
        return []
    fi = plan.mesh_dim_names.index(fsdp)
    return [e.path for e in plan.entries if e.path in plan.out_cut and e.shard_dim(fi) is not None
            and len(e.shape) - (e.stacked is not None) == 2
            and (e.stacked is None or e.shard_dim(fi) != e.stacked[1])]


def gathered_dot_grads(closed: Any) -> list[bool]:
    """For each output of ``closed`` (a backward pass's ``ClosedJaxpr``): whether it is the reduce-scatter (an
    FSDP gather's transpose) of the 2-D transpose of a ``dot_general``'s output (through calls, dtype converts,
    sums and the padding's slice). Such a parameter is gathered transposed (``plan._shard.gather_unit``), so
    that the reduce-scatter takes the dot's own output, as GSPMD's partitioner places it."""
    producer = _Producers()

    def walk(jaxpr, var, want: str, depth: int = 0) -> bool:
        hit = producer(jaxpr, var) if depth <= 96 else None
        if hit is None:
            return False
        eqn, i = hit
        name = eqn.primitive.name
        call = _called(eqn, i)
        if call is not True:
            return bool(call) and walk(*call, want, depth + 1)
        if name in _UNARY or (name in ("pad", "slice") and want == "transpose"):
            return walk(jaxpr, eqn.invars[0], want, depth + 1)
        if name in ("add", "add_any"):
            return any(walk(jaxpr, v, want, depth + 1) for v in eqn.invars)
        if want == "scatter":
            return name == "reduce_scatter" and walk(jaxpr, eqn.invars[0], "transpose", depth + 1)
        if want == "transpose":
            return (name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0)
                    and walk(jaxpr, eqn.invars[0], "dot", depth + 1))
        return name == "dot_general"

    jaxpr = closed.jaxpr
    return [len(getattr(v.aval, "shape", ())) == 2 and walk(jaxpr, v, "scatter") for v in jaxpr.outvars]


def zero_grads(closed: Any) -> list[bool]:
    """For each output of ``closed`` (the ``ClosedJaxpr`` of a backward pass): whether it is a zero by
    construction, JAX's instantiation of a symbolic zero cotangent (a parameter the loss reads under
    ``stop_gradient`` only, or not at all): a literal 0, or a ``broadcast_in_dim`` of one, through calls and
    dtype converts. Such a gradient needs no reduction (XLA would drop it: the table must not count it)."""
    producer = _Producers()

    def zero(jaxpr, var, depth: int = 0) -> bool:
        if isinstance(var, Literal):
            return not bool(getattr(var.val, "any", lambda: var.val)())
        hit = producer(jaxpr, var) if depth <= 64 else None
        if hit is None:
            return False
        eqn, i = hit
        name = eqn.primitive.name
        call = _called(eqn, i)
        if call is not True:
            return bool(call) and zero(*call, depth + 1)
        if name in _UNARY or name == "broadcast_in_dim":
            return zero(jaxpr, eqn.invars[0], depth + 1)
        return False

    return [zero(closed.jaxpr, v) for v in closed.jaxpr.outvars]
