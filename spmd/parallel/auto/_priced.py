"""``auto_layout(hardware=)``: a candidate priced on a ``Hardware``'s published figures, nothing timed here.

- **communication**: the step's own table (``step.communication``, by role: the parameters' collectives
  over the data dims, the activations' over ``tp``), each kind's ``count`` collectives at their mean size
  priced by ``Hardware.collective_s`` at the group of the mesh dim(s) it runs over **and their stride** in the
  layout's row-major device order (``pp`` x ``dp`` x ``fsdp`` x ``tp``: ``tp`` innermost at stride 1, ``fsdp``
  at stride ``tp``, ``dp`` at ``fsdp x tp``, ``pp`` at ``dp x fsdp x tp``): a group whose devices sit in
  one node (``stride x group <= devices_per_node``) runs at the node's links, one that spans nodes at the
  inter-node ones (``mesh_group``).
- **compute**: the roofline, ``max(flops / the matmul peak of the dtype the model's matmuls run in, bytes
  accessed / the memory bandwidth)``, of the same flops and bytes the calibrated model uses (the one-device
  step's ``cost_analysis``, ``spmd.parallel.cost._compute_cost``). The max, not the sum: a matmul-bound
  step's memory traffic runs under its matmuls (and a memory-bound step's flops under its loads), so adding
  them would count the overlapped time twice; the max is the standard roofline bound. The per-operation
  launch cost and the dispatch a measured calibration carries are not on a datasheet: not counted (a
  GPU's fused step is far from launch-bound at the sizes planned for).
- **bounds** (``auto_layout``'s search, ``spmd.parallel.auto._budget.searched``): a compiled step's predicted
  time is at least ``step_floor`` (its matmul flops at the peak rate, or the bytes its matmuls read and write
  plus its state's, read and written once by the update, over the memory bandwidth, whichever is more) plus
  its communication: before any trace, the one-device gradient's matmuls (``dot_cost``) split over all the
  devices, ``state_floor``, ``comm_floor`` and, under ``tp``, ``tp_floor`` (the collectives the plan's cut
  parameters force on the activations, read off the same gradient: ``tp_traffic``); once traced, the traced step's own matmuls (per device, what it
  recomputes and replicates included), its own shards (``shard_bytes``) and its own table, priced exactly as
  the compiled candidate's is.
- **dtype**: the matmuls' (``dot_general``) input dtype weighted by their flops in the loss's jaxpr
  (``matmul_dtype``); the parameters' floating dtype where the loss has no matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import Var

from placements import Shard
from spmd.parallel.cost._hardware import Hardware
from spmd.parallel._jaxprs import sub_jaxprs
from spmd.parallel.cost._loops import ON_CHIP
from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.styles._transforms import TPSpec, param_module, tp_placements

__all__ = ["HardwareRates", "mesh_group", "matmul_dtype", "dot_flops", "dot_cost", "dot_bytes", "comm_floor",
           "tp_traffic", "tp_floor", "state_floor", "shard_bytes", "step_floor"]


def mesh_group(mesh_dims: Sequence[tuple[str, int]], names: Sequence[str]) -> tuple[int, int]:
    """``(group, stride)`` of a collective over the mesh dims ``names`` (adjacent ones, e.g. ``("dp",
    "fsdp")``) of a row-major mesh ``mesh_dims`` (``Layout.mesh_dims``): the product of their sizes, and the
    product of the sizes of the dims after the innermost of them. ``(1, 1)`` where none is in the mesh."""
    order = [n for n, _ in mesh_dims]
    sizes = dict(mesh_dims)
    present = [n for n in names if sizes.get(n, 1) > 1]
    if not present:
        return 1, 1
    inner = max(order.index(n) for n in present)
    return math.prod(sizes[n] for n in present), math.prod(s for _, s in mesh_dims[inner + 1:])


def _dots(jaxpr, folded_in: frozenset = frozenset()) -> tuple[dict, dict]:
    """``(work, io)`` of ``jaxpr`` and its sub-jaxprs: ``work`` per promoted input dtype, ``2 x M x N x K`` of
    each ``dot_general``; ``io`` per dtype, the elements each ``dot_general`` reads (its two operands, but one
    made by a ``broadcast_in_dim`` or ``iota``, or by other operations of those and constants alone, which XLA
    may fold into the dot: ``folded_in``, the positions of ``jaxpr``'s inputs so made) and writes (its result).
    A ``scan``'s body counts its length times (as the compiled step's cost counts a loop of known trip count,
    ``spmd.parallel.cost._loops``), another loop's body once, and a fused kernel's (``ON_CHIP``) matmuls read and
    write nothing of the device's memory (its tiles stay on chip); of a ``cond``, the branch with the least of
    each (a bound's side)."""
    work: dict = {}
    io: dict = {}
    folded: set = {v for j, v in enumerate(jaxpr.invars) if j in folded_in}  # those vars in this jaxpr

    def add(into: dict, got: dict, times: float = 1) -> None:
        for k, v in got.items():
            into[k] = into.get(k, 0) + times * v

    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in ("broadcast_in_dim", "iota") or (name != "dot_general" and not sub_jaxprs(e) and all(
                not isinstance(v, Var) or v in folded for v in e.invars)):  # made of those and constants alone
            folded.update(e.outvars)
        if name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            a, b = e.invars[0].aval, e.invars[1].aval
            k = math.prod(a.shape[d] for d in lc)
            dt = np.promote_types(a.dtype, b.dtype).name
            add(work, {dt: 2 * k * math.prod(e.outvars[0].aval.shape)})
            for v in (*e.invars[:2], e.outvars[0]):
                if isinstance(v, Var) and v not in folded:
                    add(io, {np.dtype(v.aval.dtype).name: math.prod(v.aval.shape)})
            continue
        if name == "cond":  # one branch runs: the least of each (a bound's side)
            got = [_dots(b.jaxpr) for b in e.params["branches"]]
            add(work, min((w for w, _ in got), key=lambda w: sum(w.values())))
            add(io, min((i for _, i in got), key=lambda i: sum(i.values())))
            continue
        if name == "scan":  # a known trip count: each trip's matmuls (XLA's cost of the compiled loop adds them)
            w, i = _dots(e.params["jaxpr"].jaxpr)
            add(work, w, e.params["length"])
            if ON_CHIP not in str(e.source_info.name_stack):  # a fused kernel's tiles stay on chip (cost._loops)
                add(io, i, e.params["length"])
            continue
        for sub in sub_jaxprs(e):  # a call's inputs are the eqn's, in order (pjit, shard_map, remat)
            called = len(sub.invars) == len(e.invars)
            w, i = _dots(sub, frozenset(j for j, v in enumerate(e.invars)
                                        if called and isinstance(v, Var) and v in folded))
            add(work, w)
            add(io, i)
    return work, io


def _dot_work(jaxpr, work: dict) -> dict:
    """``work`` plus ``_dots(jaxpr)``'s matmul flops per promoted input dtype."""
    for dt, v in _dots(jaxpr)[0].items():
        work[dt] = work.get(dt, 0) + v
    return work


def dot_bytes(io: dict, compute_dtype: str | None = None) -> float:
    """The bytes of ``_dots``' elements ``io`` (per dtype), each at its dtype's size, or ``compute_dtype``'s
    where smaller (a mixed-precision layout's matmuls run in it: the one-device loss's float32 ones, read at
    its size)."""
    cap = np.dtype(compute_dtype).itemsize if compute_dtype else math.inf
    return float(sum(n * min(np.dtype(dt).itemsize, cap) for dt, n in io.items()))


def dot_cost(loss: Any, params: Any, batch: Any) -> tuple[float, dict]:
    """``(flops, io)``: ``dot_flops`` and the elements per dtype the gradient's matmuls read and write
    (``_dots``), one device, on the whole batch (a bound's side: a layout's ``n`` devices compute that gradient
    between them, each matmul's operands read and its result written by one device at least, so one device's
    step moves at least ``dot_bytes(io) / n``)."""
    work, io = _dots(jax.make_jaxpr(jax.grad(loss))(params, batch).jaxpr)
    return float(sum(work.values())), io


def dot_flops(loss: Any, params: Any, batch: Any) -> float:
    """The matmul flops (``2 x M x N x K`` per ``dot_general``) of the loss and its gradient on ``batch``, one
    device, read off the gradient's jaxpr (traced on abstract inputs, nothing compiled). A layout's step on
    ``n`` devices computes this gradient on the same batch split over them, so one device's compiled step
    counts at least ``dot_flops / n`` (more where a part is replicated or recomputed): the compute bound of
    ``auto_layout``'s search (``spmd.parallel.auto._budget.searched``)."""
    return dot_cost(loss, params, batch)[0]


def matmul_dtype(loss: Any, params: Any, batch: Any) -> str:
    """The dtype name the loss's matmuls run in (their inputs' promoted dtype, weighted by their flops; see
    the module doc), traced on abstract inputs."""
    work = _dot_work(jax.make_jaxpr(loss)(params, batch).jaxpr, {})
    if work:
        return max(work, key=work.get)
    floats = [x for x in jax.tree.leaves(params) if np.issubdtype(x.dtype, np.floating)]
    return max(floats, key=lambda x: math.prod(x.shape)).dtype.name if floats else "float32"


def comm_floor(layout: Any, hardware: Any, params: Any) -> float:
    """A lower bound, before anything of ``layout`` is traced, on the seconds its step's parameter collectives
    take as ``auto_layout(hardware=)`` prices them (each kind's total bytes over the group of its mesh dims,
    ``auto._auto._groups``): the gradients, in the parameters' dtype (a mixed-precision policy reduces in
    float32), are reduce-scattered over ``fsdp`` and the shards all-reduced over ``dp`` (``fsdp`` alone:
    reduce-scattered; ``dp`` alone: all-reduced), and under FSDP the parameters are all-gathered at least once,
    in the compute dtype. Every parameter is taken as cut over ``tp`` (the plan cuts some, the rest are whole
    on each device: fewer bytes than any layout moves), each kind as one collective of its total bytes (one
    link latency, not one a collective). The weight-stationary layout's parameters too: they stay cut over
    ``tp`` (its batch cut over ``tp`` moves activations, ``tp_floor``). 0 where the layout's data dims are not
    ``dp`` x ``fsdp`` alone (pipelines, cp, ep)."""
    if layout.pp > 1 or layout.cp > 1 or layout.ep > 1 or layout.n_data < 2:
        return 0.0
    leaves = [x for x in jax.tree.leaves(params) if np.issubdtype(x.dtype, np.floating)]
    grads = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves) / layout.tp
    dims = layout.mesh_dims
    t = 0.0
    if layout.fsdp > 1:
        item = np.dtype(layout.mixed_precision).itemsize if layout.mixed_precision else None
        gathered = sum(math.prod(x.shape) * (item or np.dtype(x.dtype).itemsize) for x in leaves) / layout.tp
        t += hardware.collective_s("all-gather", gathered, *mesh_group(dims, ("fsdp",)))
        t += hardware.collective_s("reduce-scatter", grads, *mesh_group(dims, ("fsdp",)))
        grads /= layout.fsdp
    if layout.dp > 1:
        t += hardware.collective_s("all-reduce", grads, *mesh_group(dims, ("dp",)))
    return t


def tp_traffic(loss: Any, params: Any, batch: Any, plan: Sequence) -> dict:
    """``{kind: {dtype: elements}}`` (``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``; the whole batch,
    one device): what tensor parallelism by ``plan`` (``(fqn glob, style)`` pairs) must move over ``tp`` in the
    loss's gradient, read off its jaxpr (abstract inputs).

    A ``dot_general`` that reads a parameter the plan cuts (``tp_placements``; through dtype casts and
    transposes) and contracts its cut dim sums partial products: its result is reduced over ``tp`` (a
    row-parallel layer's output forward, a column-parallel layer's input gradient backward), once per dot, as
    each styled call redistributes its own output and input; reduce-scattered where the style cuts the
    activations between modules (a ``Shard`` layout off the features: sequence parallelism, the
    weight-stationary layout), else all-reduced. One that keeps the cut dim needs its other operand whole over
    ``tp``: where the style cuts the activations between modules that operand is all-gathered, each distinct one
    once (calls sharing an input share its gather). Only the top-level jaxpr's dots are read (a scanned stack's
    are not seen: fewer, a bound's side); a plan whose styles cannot place the parameters moves nothing here
    (the trace names its error)."""
    got: dict = {"all-reduce": {}, "reduce-scatter": {}, "all-gather": {}}
    tp = TPSpec("tp", tuple(plan))
    try:
        cuts = tp_placements(tp, params)
    except (TypeError, ValueError):
        return got
    order = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, batch).jaxpr
    cut: dict = {}  # var -> (the dim tp cuts, whether its style cuts the activations between modules)
    for v, path in zip(jaxpr.invars, order):  # the parameters' leaves come first, in this order
        p = cuts.get(path)
        if isinstance(p, Shard):
            fqn, _ = param_module(path)
            style = (tp.style_for(fqn) or tp.style_for(fqn + ".attend"))[1]
            cut[v] = (p.dim % len(v.aval.shape), any(isinstance(x, Shard) and x.dim >= 0
                                                     for x in style.activation_layouts()))
    whole: dict = {}
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in ("convert_element_type", "transpose") and e.invars[0] in cut:  # the cut dim where it goes
            d, between = cut[e.invars[0]]
            cut[e.outvars[0]] = (d if name == "convert_element_type" else e.params["permutation"].index(d), between)
        if name != "dot_general":
            continue
        contracting = e.params["dimension_numbers"][0]
        for side in (0, 1):
            v = e.invars[side]
            if not isinstance(v, Var) or v not in cut:
                continue
            d, between = cut[v]
            if d in contracting[side]:
                out = got["reduce-scatter" if between else "all-reduce"]
                a = e.outvars[0].aval
                out[a.dtype.name] = out.get(a.dtype.name, 0) + math.prod(a.shape)
            elif between and isinstance(other := e.invars[1 - side], Var):
                whole[other] = other.aval
            break
    for a in whole.values():
        got["all-gather"][a.dtype.name] = got["all-gather"].get(a.dtype.name, 0) + math.prod(a.shape)
    return got


def tp_floor(layout: Any, hardware: Any, traffic: dict) -> float:
    """A lower bound, before anything of ``layout`` is traced, on the seconds its step's activation collectives
    over ``tp`` take as ``auto_layout(hardware=)`` prices them: ``traffic`` (``tp_traffic`` of its plan, the
    whole batch) split over the batch's ``dp x fsdp`` ways, each element at its dtype's size or the layout's
    compute dtype's where smaller, each kind as one collective of its total bytes over ``tp``'s group. 0
    without ``tp``, and for pipelines, cp and ep (their batch splits differ)."""
    if layout.tp < 2 or layout.pp > 1 or layout.cp > 1 or layout.ep > 1:
        return 0.0
    cap = np.dtype(layout.mixed_precision).itemsize if layout.mixed_precision else math.inf
    group = mesh_group(layout.mesh_dims, ("tp",))
    return sum(hardware.collective_s(kind, sum(n * min(np.dtype(dt).itemsize, cap) for dt, n in elements.items())
                                     / layout.n_data, *group) for kind, elements in traffic.items() if elements)


def state_floor(layout: Any, params: Any, optimizer: Any) -> float:
    """A lower bound, before anything of ``layout`` is traced, on the bytes its step's optimizer update moves
    per device: the parameters and the optimizer state, each read once and written once, cut over every mesh
    dim but ``dp`` (the plan cuts some over ``tp``, the rest are whole: fewer bytes than any layout's shards).
    The traced step's own shards: ``shard_bytes``."""
    p = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    o = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(jax.eval_shape(optimizer.init,
                                                                                                     params)))
    return 2 * (p + o) / max(layout.size // layout.dp, 1)


def shard_bytes(plan: Any, optimizer: Any) -> float:
    """The bytes a step's optimizer update moves per device at least: its parameter and optimizer-state shards
    (``plan``'s local shapes), each read once and written once."""
    local = [jax.ShapeDtypeStruct(e.local_shape, e.dtype) for e in plan.entries]
    opt = jax.eval_shape(optimizer.init, local)
    return 2.0 * (plan.bytes_per_device + sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                                              for x in jax.tree.leaves(opt)))


def step_floor(hardware: Hardware, dtype: str, flops: float, io_bytes: float, state_bytes: float) -> float:
    """The roofline ``max(flops / dtype's matmul peak, (io_bytes + state_bytes) / the memory bandwidth)``: a
    lower bound on a compiled step's compute (``HardwareRates.compute_s`` of its ``cost_analysis()``) where
    ``flops`` are matmul flops it runs, ``io_bytes`` what its matmuls read and write (``dot_bytes``) and
    ``state_bytes`` what its update moves (``shard_bytes``): XLA counts each op's operands and result, so the
    matmuls' and the update's are among the bytes it counts."""
    return max(hardware.matmul_s(flops, dtype), hardware.memory_s(io_bytes + state_bytes))


@dataclass(frozen=True)
class HardwareRates:
    """A ``Hardware`` in the place of a ``Calibration`` in ``auto_layout``'s cost terms (see the module doc):
    ``compute_s`` the roofline at ``dtype``'s matmul peak, ``collective_s`` at a group's links by its stride;
    nothing measured (``measured=False``: no anchoring on a timed step), no dispatch or launch cost, devices
    that share no compute (``alone_speedup=1``)."""

    hardware: Hardware
    dtype: str
    group_size: int = 8
    measured: bool = False
    dispatch_s: float = 0.0
    alone_speedup: float = 1.0

    def compute_s(self, flops: float, nbytes: float, ops: float = 0) -> float:
        """``max(flops / the dtype's matmul peak, nbytes / the memory bandwidth)`` (``ops`` not counted)."""
        return max(self.hardware.matmul_s(flops, self.dtype), self.hardware.memory_s(nbytes))

    def collective_s(self, kind: str, nbytes: float, count: int, group: int, stride: int = 1) -> float:
        """``count`` collectives of ``kind`` moving ``nbytes`` in all over ``group`` devices ``stride`` apart:
        ``count`` times ``Hardware.collective_s`` at their mean size."""
        if group <= 1 or not count:
            return 0.0
        return count * self.hardware.collective_s(kind, nbytes / count, group, stride)
