"""A tensor-parallel cut must not split an attention head: read the traced program, name the module.

``ColwiseParallel`` cuts a projection's output features over ``tp``; the model then reshapes them by its
head count, ``(..., H * hd) -> (..., H, hd)``. When ``H`` does not divide by the tp size (2 key/value
heads over tp=4) GSPMD would still run it, by moving the activations around every attention: silently
slower and off the analytic bound. ``check_head_cuts`` walks the step's jaxpr from each column-parallel
output (marked by ``checkpoint_name`` in ``spmd.parallel.styles._hooks``) through elementwise ops to the reshape
that splits its last dim, and refuses the split.
"""

from __future__ import annotations

from typing import Any

from spmd.parallel.styles._hooks import COLWISE_MARK

__all__ = ["check_head_cuts"]

_PASS = {"convert_element_type", "add", "sub", "mul", "div", "neg", "copy", "copy_p", "tanh", "logistic",
         "exp", "max", "min", "integer_pow", "pow", "sqrt", "rsqrt", "erf", "select_n", "pjit", "name"}


def _sub_jaxprs(eqn) -> list:
    out = []
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns") and hasattr(inner, "invars"):
                out.append(inner)
    return out


def check_head_cuts(jaxpr: Any, origin: dict | None = None) -> None:
    """Raise ``ValueError`` when a column-parallel output is reshaped into heads the tp size does not divide."""
    origin = dict(origin or {})
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "name" and str(eqn.params.get("name", "")).startswith(COLWISE_MARK):
            _, fqn, n = str(eqn.params["name"]).split("|")
            origin[eqn.outvars[0]] = (fqn, int(n), eqn.outvars[0].aval.shape[-1])
            continue
        src = [origin[v] for v in eqn.invars if not hasattr(v, "val") and v in origin]
        if name == "reshape" and src:
            fqn, n, feat = src[0]
            shape_in = eqn.invars[0].aval.shape
            shape_out = eqn.outvars[0].aval.shape
            if (len(shape_out) == len(shape_in) + 1 and tuple(shape_out[:-2]) == tuple(shape_in[:-1])
                    and shape_out[-2] * shape_out[-1] == feat):
                heads = shape_out[-2]
                if heads % n:
                    raise ValueError(
                        f"parallelize_module: ColwiseParallel on {fqn!r} cuts its {feat} output features over tp={n}, "
                        f"and the model splits them into {heads} heads of {shape_out[-1]}: {heads} heads do not divide "
                        f"by tp={n}, so a cut would split a head. Use a tp size that divides {heads}, or leave "
                        f"{fqn!r} out of the plan (its heads then stay whole on every device).")
            continue
        subs = _sub_jaxprs(eqn)
        if subs and src:
            for sub in subs:
                inner = {}
                for outer_v, inner_v in zip(eqn.invars, sub.invars[-len(eqn.invars):] if len(sub.invars) >= len(
                        eqn.invars) else sub.invars):
                    if not hasattr(outer_v, "val") and outer_v in origin:
                        inner[inner_v] = origin[outer_v]
                check_head_cuts(sub, inner)
        elif subs:
            for sub in subs:
                check_head_cuts(sub)
        if src and name in _PASS:
            for v in eqn.outvars:
                if getattr(v.aval, "shape", ())[-1:] == (src[0][2],):
                    origin[v] = src[0]
