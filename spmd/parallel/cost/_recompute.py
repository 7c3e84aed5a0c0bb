"""The collectives a backward pass runs again because a ``jax.checkpoint`` recomputes the forward pass around
them: a user's own ``nn.remat`` / ``jax.checkpoint`` (inside an ``nn.scan`` or not) whose policy does not keep
an FSDP unit's gathered parameters or a tensor-parallel collective's result.

What a checkpoint recomputes is decided by JAX's partial evaluation under the checkpoint's own policy; the
backward pass it builds runs the recomputation under the name ``rematted_computation``
(``jax._src.ad_checkpoint``). This reads that program (the ``ClosedJaxpr`` of the step's backward pass,
traced before the step compiles): each collective traced under ``rematted_computation`` is one the step runs
once more, counted per buffer in the table's byte convention (all-gather: the gathered result, all-reduce: the
buffer, reduce-scatter: the input), times the trip count of the loops (``scan``) around it. The step's own
re-gather of a ``fully_shard`` unit (``reshard_after_forward``: ``spmd.parallel.styles._fully_shard``) runs
under ``REGATHER``: its all-gathers over the shard dim are left out (the fsdp term counts them), its other
collectives (a SyncBatchNorm's means, which its policy does not keep; under ``"full"``, its tp collectives) are
counted. Besides the table's kinds, the collective-permutes (cp's ring) and all-to-alls (ep's exchanges) a
recomputation runs again are counted too (``EXTRA``: the step adds them to its total). Collectives over mesh
dims of size 1 and on scalars are not counted (the table's convention).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from spmd.parallel._jaxprs import sub_jaxprs
from spmd.parallel.styles._fully_shard import REGATHER

__all__ = ["recomputed_collectives", "dead_gathers", "regathered", "RECOMPUTED", "SYNC_BN", "EXTRA"]

RECOMPUTED = "rematted_computation"  # JAX's name for a checkpoint's recomputation in the backward pass
SYNC_BN = "spmd_sync_batch_norm"  # the named scope of a BatchNorm call whose statistics the step averages

_KIND = {"all_gather": "all-gather", "psum": "all-reduce", "psum_invariant": "all-reduce",
         "reduce_scatter": "reduce-scatter", "ppermute": "collective-permute", "all_to_all": "all-to-all"}
EXTRA = ("collective-permute", "all-to-all")  # cp's ring and zigzag moves, ep's exchanges: beyond the table's KINDS
_AXES = {"psum": "axes", "psum_invariant": "axes"}


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _names(eqn: Any) -> tuple:
    names = eqn.params.get(_AXES.get(eqn.primitive.name, "axis_name"), ())
    return tuple(n for n in (names if isinstance(names, (tuple, list)) else (names,)) if isinstance(n, str))


def _group(eqn: Any, sizes: Mapping[str, int]) -> int:
    return int(np.prod([sizes.get(n, 1) for n in _names(eqn)], dtype=np.int64))


def regathered(closed: Any, sizes: Mapping[str, int], axis: str) -> dict:
    """``{kind: {"count", "bytes"}}`` of the all-gathers ``closed`` (a backward pass's ``ClosedJaxpr``) runs to
    gather re-gathering ``fully_shard`` units again (under ``REGATHER``), those the gradients read: JAX's partial
    evaluation emits no re-gather of a parameter whose gradient does not read its value (a bias), and a
    re-gather nothing reads (the first unit's kernels, whose input needs no gradient) is dead code, dropped.
    ``axis``: the shard dim the units gather over (a sequence-parallel all-gather there is the tp term's)."""
    return recomputed_collectives(closed, sizes, scope=REGATHER, axis=axis)


def _table() -> dict:
    return {k: {"count": 0, "bytes": 0} for k in ("all-gather", "reduce-scatter", "all-reduce")}


def recomputed_collectives(closed: Any, sizes: Mapping[str, int], scope: str | None = None,
                           axis: str | None = None, *, by_dims: bool = False,
                           seq: tuple[str, str] | None = None) -> dict:
    """``{kind: {"count", "bytes"}}`` of the collectives ``closed`` (a backward pass's ``ClosedJaxpr``) runs
    in a checkpoint's recomputation (see the module doc); ``sizes``: mesh dim name -> size. ``scope``: instead,
    those it runs under that named scope outside any recomputation (a SyncBatchNorm's transposed means); under
    ``REGATHER``, a unit's re-gathers (its all-gathers, in or out of a recomputation: ``regathered``). With no
    ``scope``, ``axis``: the units' shard dim, whose re-gathers are left out (the fsdp term's; None: every
    all-gather under ``REGATHER``), the others counted (a sequence-parallel gather over tp a "full" unit runs again).
    ``by_dims``: ``{"dim[,dim]": {kind: ...}}`` instead, the same collectives by the mesh dims they run over
    (those of size > 1, in ``sizes``' order: ``"tp"`` for a checkpointed unit's tensor-parallel collectives),
    which the planner prices at their own group (``spmd.parallel.auto._auto``). ``seq``: ``(cp, tp)``, the mesh
    dims cutting the sequence and the tp blocks: a collective over ``tp`` traced where ``cp`` is not manual (a
    tp region in global view over cp, the step's region manual over the data dims alone) holds the sequence
    whole in its shapes, cut over cp on the devices: it moves ``1 / cp`` of those bytes (the table's tp terms
    count so too)."""
    out, by = _table(), {}

    seen: set = set()

    def walk(jaxpr: Any, stack: tuple, trips: int, source: dict, manual: frozenset = frozenset()) -> None:
        for eqn in jaxpr.eqns:
            here = stack + tuple(str(eqn.source_info.name_stack).split("/"))
            n = trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else trips
            kind = _KIND.get(eqn.primitive.name)
            path = "/".join(here)  # a scope's name may come wrapped: transpose(jvp(name))
            if scope is None:
                hit = RECOMPUTED in path and not (REGATHER in path and kind == "all-gather"
                                                  and (axis is None or axis in _names(eqn)))
            elif scope == REGATHER:
                names = eqn.params.get("axis_name", ())
                hit = REGATHER in path and kind == "all-gather" and axis in (
                    names if isinstance(names, (tuple, list)) else (names,))
            else:
                hit = scope in path and RECOMPUTED not in path
            if kind is not None and hit and _group(eqn, sizes) > 1:
                # one all-gather of a value however many modules gather it (a sequence-parallel input that q,
                # k and v read): XLA merges equal ones
                key = (eqn.primitive.name, tuple(source.get(id(v), id(v)) for v in eqn.invars),
                       repr(sorted(eqn.params.items())))
                if kind != "all-gather" or key not in seen:
                    seen.add(key)
                    dims = ",".join(d for d in sizes if d in _names(eqn) and sizes[d] > 1)
                    cut = (sizes[seq[0]] if seq is not None and seq[0] not in manual and _names(eqn) == (seq[1],)
                           else 1)
                    for a in [v.aval for v in (eqn.outvars if kind == "all-gather" else eqn.invars)]:
                        if getattr(a, "shape", ()) != ():
                            for t in (out, by.setdefault(dims, _table())):
                                t.setdefault(kind, {"count": 0, "bytes": 0})
                                t[kind]["count"] += n
                                t[kind]["bytes"] += n * _nbytes(a) // cut
            for inner in sub_jaxprs(eqn):
                inner_source = dict(source)  # a call's parameters are the values it is called on
                if len(inner.invars) == len(eqn.invars):
                    inner_source.update({id(iv): source.get(id(ov), id(ov))
                                         for iv, ov in zip(inner.invars, eqn.invars)})
                walk(inner, here, n, inner_source, manual | frozenset(
                    eqn.params.get("newly_manual_axes", ()) if eqn.primitive.name == "shard_map" else ()))

    from jax.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    walk(jaxpr, (), 1, {})  # what the outputs need (a recomputed value nothing reads is not run: XLA drops it too)
    return by if by_dims else out


def dead_gathers(closed: Any, axis: str) -> dict:
    """``{"count", "bytes"}`` of the all-gathers over the mesh dim ``axis`` (a ``fully_shard`` unit's gathers) in
    ``closed`` (the ``ClosedJaxpr`` of a whole train step) whose result nothing reads: those JAX's dead-code
    elimination removes (as XLA's does), times the trip count of the loops (``scan``) around them: a parameter
    the loss never reads is gathered for nothing. A gather in a
    checkpoint's recomputation (``recomputed_collectives``' term, counted alive) and a unit's re-gather (the
    table counts those its backward pass runs: ``regathered``) are left out."""
    from jax.interpreters import partial_eval as pe

    def count(jaxpr: Any, stack: tuple, trips: int, out: list) -> None:
        for eqn in jaxpr.eqns:
            here = stack + tuple(str(eqn.source_info.name_stack).split("/"))
            n = trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else trips
            if eqn.primitive.name == "all_gather":
                names = eqn.params.get("axis_name", ())
                path = "/".join(here)
                if axis in (names if isinstance(names, (tuple, list)) else (names,)) and (
                        RECOMPUTED not in path and REGATHER not in path):
                    out[0] += n
                    out[1] += n * sum(_nbytes(v.aval) for v in eqn.outvars)
            for inner in sub_jaxprs(eqn):
                count(inner, here, n, out)

    every, live = [0, 0], [0, 0]
    count(closed.jaxpr, (), 1, every)
    count(pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)[0], (), 1, live)
    return {"count": every[0] - live[0], "bytes": every[1] - live[1]}
