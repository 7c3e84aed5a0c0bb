"""The loss's reductions over a column-parallel output's cut features: read the traced step, count tp's all-reduces.

A column-parallel projection whose output leaves the model cut on its features (``"lm_head": ColwiseParallel()``,
torchtitan's output layer: the logits cut over tp on the vocabulary, handed on as ``Shard(-1)``) meets the user's
loss in global view; GSPMD partitions the loss on each device's vocabulary rows, and each reduction over the cut
dim (the log-sum-exp's max and sum, the label logit's pick) is one all-reduce over tp of its output (one value per
position; under cp, of the device's positions). ``vocab_reductions`` walks the step's jaxpr from each marked column-parallel output
(``checkpoint_name`` in ``spmd.parallel.styles._tp_calls``) through the ops that keep its shape (elementwise), into
the calls and loops that hold them but not into the styles' own regions (manual over tp: their collectives are
the styles' rows), and returns each reduction or gather over the cut last dim: ``(module, op, bytes, calls)``.
An output split into heads (its reshape changes its shape) ends there: attention's and the MLP's cuts are the
styles' own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spmd.parallel._jaxprs import sub_jaxprs
from spmd.parallel.styles._tp_calls import COLWISE_MARK

__all__ = ["check_vocab_gathers", "vocab_reductions", "vocab_terms"]

_REDUCE = {"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "argmax", "argmin", "reduce_and", "reduce_or"}


def _itemsize(v) -> int:
    return np.dtype(v.aval.dtype).itemsize


def vocab_reductions(jaxpr: Any, tp_axis: str) -> list:
    """``[(module, op, shape, itemsize, calls)]``: the reductions and gathers over the cut last dim of a
    column-parallel output, each an all-reduce over ``tp_axis`` of its output (``shape`` in the view of the jaxpr
    it sits in: the data region's rows), ``calls`` times a step (a loop's length); ``op`` is the primitive (see the
    module doc)."""
    found: list = []
    _walk(jaxpr, tp_axis, found, {}, 1)
    return found


def _walk(jaxpr: Any, tp_axis: str, found: list, cut: dict, calls: int) -> None:
    """``cut``: var -> (module, the cut value's shape), filled in place. An op whose outputs nothing reads (max's
    derivative counts its ties and drops them) is left out: XLA removes it."""
    live = {v for v in jaxpr.outvars if not hasattr(v, "val")}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(o in live for o in eqn.outvars):
            live.update(v for v in eqn.invars if not hasattr(v, "val"))
    for eqn in jaxpr.eqns:
        if not eqn.effects and not any(o in live for o in eqn.outvars):
            continue
        name = eqn.primitive.name
        label = str(eqn.params.get("name", "")) if name == "name" else ""
        if label.startswith(COLWISE_MARK):
            cut[eqn.outvars[0]] = (label.split("|")[1], tuple(eqn.outvars[0].aval.shape))
            continue
        if name == "shard_map" and tp_axis in set(eqn.params.get("axis_names", ()) or ()):
            continue  # a style's region: its collectives are its own rows
        ins = [v for v in eqn.invars if not hasattr(v, "val") and v in cut]
        subs = sub_jaxprs(eqn)
        if subs:
            n = calls * int(eqn.params.get("length", 1)) if name == "scan" else calls
            for sub in subs:
                inner = {}
                if len(sub.invars) == len(eqn.invars):
                    inner = {i: cut[o] for o, i in zip(eqn.invars, sub.invars) if not hasattr(o, "val") and o in cut}
                _walk(sub, tp_axis, found, inner, n)
                if len(sub.outvars) == len(eqn.outvars):
                    cut.update({o: inner[i] for i, o in zip(sub.outvars, eqn.outvars)
                                if not hasattr(i, "val") and i in inner})
            continue
        if not ins:
            continue
        x = ins[0]
        fqn, shape = cut[x]
        last = len(x.aval.shape) - 1
        if name in _REDUCE and last in tuple(eqn.params.get("axes", ())):
            found.append((fqn, name, tuple(eqn.outvars[0].aval.shape), _itemsize(eqn.outvars[0]), calls))
        elif name == "gather" and eqn.invars[0] is x and last in tuple(
                eqn.params["dimension_numbers"].collapsed_slice_dims):
            found.append((fqn, "gather", tuple(eqn.outvars[0].aval.shape), _itemsize(eqn.outvars[0]), calls))
        else:
            for v in eqn.outvars:
                if tuple(getattr(v.aval, "shape", ())) == shape:
                    cut[v] = cut[x]


def vocab_terms(found: list, seq_len: int | None = None, n_cp: int = 1) -> dict:
    """The table's term of ``vocab_reductions``' answer: ``{"all-reduce": {count, bytes}, "calls": [...]}``; under
    cp (``n_cp`` > 1) an output whose dim 1 is the sequence (``seq_len``) holds the device's positions."""
    rows = []
    for fqn, op, shape, item, calls in found:
        nbytes = int(np.prod(shape)) * item
        if n_cp > 1 and len(shape) >= 2 and shape[1] == seq_len:
            nbytes //= n_cp
        rows.append({"module": fqn, "op": op, "bytes": nbytes, "calls": calls})
    return {"all-reduce": {"count": sum(r["calls"] for r in rows), "bytes": sum(r["bytes"] * r["calls"] for r in rows)},
            "calls": rows}


def check_vocab_gathers(found: list, dims: dict) -> None:
    """Refuse a gather over a column-parallel output's cut features on a mesh with cp and data dims (``dims``:
    the mesh dims, data first, then cp and tp, with their sizes), naming the module and the fixes."""
    gathers = sorted({fqn for fqn, op, *_ in found if op == "gather"})
    if gathers:
        mesh = ",".join(f"{d}={n}" for d, n in dims.items())
        raise ValueError(
            f"make_train_step: the loss indexes {gathers[0]!r}'s output, cut over tp on its features "
            f"(ColwiseParallel's Shard(-1)), with a gather on mesh {mesh}: XLA's partitioner aborts the process on "
            f"a gather cut over tp on its indexed dim and over cp on the sequence inside the data dims' region. "
            f"Read the labels' logits with jnp.take_along_axis(logits, labels[..., None], axis=-1) (as optax's "
            f"softmax_cross_entropy_with_integer_labels does: the step runs it as a masked sum, torch's "
            f"loss_parallel) or a one-hot product, or hand {gathers[0]!r}'s output on whole "
            f"(ColwiseParallel(output_layouts=Replicate())), or leave {gathers[0]!r} out of the plan.")
