"""The forward flops of the matmuls that read each parameter, read off the loss's traced program (its jaxpr):
through casts and views, into a scan's body its trip count times, the costlier branch of a cond."""

from __future__ import annotations

import math
from typing import Any

import jax
from spmd.parallel._jaxprs import sub_jaxprs

__all__ = ["param_matmul_flops"]


# ops that hand a parameter on unchanged in content (a cast, a view): a matmul on their output reads it
_VIEW = {"convert_element_type", "copy", "copy_p", "reshape", "transpose", "squeeze", "expand_dims", "name",
         "sharding_constraint", "optimization_barrier"}


def _matmul_flops(eqn) -> float:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(out.shape) * math.prod(lhs[d] for d in lc)
    rhs = eqn.invars[1].aval.shape  # conv_general_dilated: each output element a kernel window over its inputs
    return 2.0 * math.prod(out.shape) * math.prod(rhs) / max(rhs[eqn.params["dimension_numbers"].rhs_spec[0]], 1)


def _walk(jaxpr, origin: dict, flops: dict, times: float) -> None:
    """Add to ``flops[i]`` the forward flops of every matmul of ``jaxpr`` an operand of which is parameter
    ``i`` (``origin``: var -> parameter index), through views and into sub-programs (a scan's body its trip
    count times, the costlier branch of a cond)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        src = [origin.get(v) if not hasattr(v, "val") else None for v in eqn.invars]
        if name in ("dot_general", "conv_general_dilated"):
            for i in {i for i in src[:2] if i is not None}:
                flops[i] = flops.get(i, 0.0) + times * _matmul_flops(eqn)
        elif name in _VIEW and src and src[0] is not None:
            origin[eqn.outvars[0]] = src[0]
        elif name == "cond":
            best: dict = {}
            for br in eqn.params["branches"]:
                got: dict = {}
                _walk(br.jaxpr, {v: i for v, i in zip(br.jaxpr.invars, src[1:]) if i is not None}, got, times)
                best = got if sum(got.values()) > sum(best.values()) else best
            for i, f in best.items():
                flops[i] = flops.get(i, 0.0) + f
        elif any(i is not None for i in src):
            n = times * (eqn.params.get("length", 1) if name == "scan" else 1)
            for inner in sub_jaxprs(eqn):
                if len(inner.invars) == len(src):
                    _walk(inner, {w: i for w, i in zip(inner.invars, src) if i is not None}, flops, n)
                    break


def param_matmul_flops(loss, params: Any, batch: Any) -> list[float]:
    """Per leaf of ``params`` (flattened), the forward flops of the matmuls (``dot_general``, convolutions)
    that read it in ``loss(params, batch)``, from its traced program: an embedding table read by a lookup
    counts none, the same table read by a tied output projection its matmul; the tokens each matmul runs on
    are the program's, whatever the batch's leaves are."""
    n = len(jax.tree.leaves(params))
    closed = jax.make_jaxpr(loss)(params, batch)
    flops: dict = {}
    _walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[:n])}, flops, 1.0)
    return [flops.get(i, 0.0) for i in range(n)]
