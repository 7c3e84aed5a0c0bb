"""The attention calls of a train step whose mesh has a ``cp`` dim: the sequence cut, attention across it.

The step's region is automatic (global view, GSPMD) over ``cp``, as it is over ``tp``: the batch's sequence
dim (dim 1 of every batch leaf of rank 2 or more) is cut over ``cp`` and every op of the model runs on each
device's positions as GSPMD partitions it, so code that builds positions from the global length (RoPE's
``arange(t)``, a learned table's ``pos[:t]``) runs unchanged and right. Attention is the one op whose
operands mix positions: while the step traces, ``jax.nn.dot_product_attention`` and flax's
``dot_product_attention`` (``flax.linen``, ``flax.nnx``) are intercepted (``ContextCalls.installed``) and
each call runs in a region manual over ``cp``, chosen per call:

- **ring** (no mask and no bias array; ``is_causal`` allowed): :func:`ring_attention`, K/V passed around the
  ring with ``ppermute``. A causal call whose local sequence is even first moves its q, k, v to torch's
  head-tail (zigzag) cut (two ``ppermute`` of half the local block each, :func:`to_zigzag`), so that every
  rank does the same causal work, and its output back (``from_zigzag``): ``ring (zigzag)``;
- **all-gather K/V** (a ``mask`` or ``bias`` array, any mask: padding, a custom pattern): K and V gathered
  over ``cp``, the local queries attend with the mask's rows of this device's positions (the
  reduce-scatter of dK, dV in the backward pass). The mask itself is the model's, formed in global view: one
  computed from the batch's cut ids (a padding mask) has its inputs gathered by GSPMD, which the table does not
  count; a constant mask moves nothing, and flax's ``make_causal_mask(tokens)`` is built where it stands
  (``_causal_mask``: each device its rows).

An attention the step cannot intercept (a model's own einsum over the whole sequence) is found in the traced
step (``spmd.parallel.step._heads.whole_sequence_products``: its ``[.., T, T]`` scores, under the scope of the
module that computed them, ``scope_name``), and that module runs on the sequence gathered over cp
(``ContextCalls.around``) rather than left to GSPMD, which would gather it in its own way; one outside any
submodule taking the sequence is refused with the fix (``check_whole_sequence``).
``records`` (one per call, filled by the trace) are the communication table's rows (``spmd.parallel.cost``).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from spmd.parallel.context._attention import ring_attention
from spmd.parallel.context._dispatch import ACTIVE, install_dispatchers
from spmd.parallel.context._moves import cut_dim as _cut_dim, cut_seq as _cut_seq, gather_dim as _gather_dim
from spmd.parallel.context._moves import gather_seq as _gather_seq
from spmd.parallel.context._take import masked_take_along_axis
from spmd.parallel.context._tokenwise import run_on_cut
from spmd.parallel.cost._comm import activation_terms
from spmd.parallel.plan._param_plan import ParamPlan
from spmd.parallel.plan._scan import scan_of
from spmd.parallel.styles._tp_calls import TP_COMM
from spmd.parallel.styles._transforms import CP_DIM, EP_DIM

__all__ = ["CALL_SCOPE", "CP", "ContextCalls", "attention_terms", "experts_routers", "from_zigzag",
           "lookup_terms", "seq_len", "to_zigzag", "with_context"]

CP = CP_DIM  # the mesh dim name of the sequence cut


def _dest(chunk: int, n: int) -> int:
    """The rank holding ``chunk`` of ``2 n`` under the zigzag cut."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _halves(axis: str, n: int) -> tuple[list, list]:
    """The ppermute pairs moving each rank's first (chunk ``2 r``) and second (``2 r + 1``) half to zigzag."""
    return [(r, _dest(2 * r, n)) for r in range(n)], [(r, _dest(2 * r + 1, n)) for r in range(n)]


def _move(x, axis: str, pairs: list):
    """``lax.ppermute`` but for the identity (cp=2's even chunks stay home)."""
    return x if all(s == d for s, d in pairs) else lax.ppermute(x, axis, pairs)


def zigzag_moves(n: int) -> int:
    """The ppermutes of one :func:`to_zigzag` over ``n`` ranks (each of half the local block): 2, or 1 at n=2."""
    return sum(not all(s == d for s, d in pairs) for pairs in _halves("", n))


def to_zigzag(x, axis: str, n: int):
    """Inside a region manual over ``axis`` (size ``n``): rank ``r``'s contiguous block ``[B, t, ...]`` (chunks
    ``2 r``, ``2 r + 1`` of ``2 n``) -> its zigzag block (chunks ``r``, ``2 n - 1 - r``); two ppermutes of
    ``t / 2`` positions each."""
    c = x.shape[1] // 2
    pa, pb = _halves(axis, n)
    even = _move(x[:, :c], axis, pa)  # each rank receives one even and one odd chunk
    odd = _move(x[:, c:], axis, pb)
    first_even = lax.axis_index(axis) % 2 == 0  # rank r's first zigzag chunk is r: even iff r is
    return jnp.concatenate([jnp.where(first_even, even, odd), jnp.where(first_even, odd, even)], axis=1)


def from_zigzag(y, axis: str, n: int):
    """The inverse of :func:`to_zigzag`."""
    c = y.shape[1] // 2
    pa, pb = _halves(axis, n)
    first_even = lax.axis_index(axis) % 2 == 0
    even = jnp.where(first_even, y[:, :c], y[:, c:])
    odd = jnp.where(first_even, y[:, c:], y[:, :c])
    home_a = _move(even, axis, [(d, s) for s, d in pa])
    home_b = _move(odd, axis, [(d, s) for s, d in pb])
    return jnp.concatenate([home_a, home_b], axis=1)


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


_SCOPE = re.compile(r"spmd\[([^\]]*)\]")
CALL_SCOPE = "spmd_cp_attention"  # the scope an intercepted attention call runs under


def scope_name(fqn: str) -> str:
    """The ``jax.named_scope`` each module call of the step is traced under, so that a product found in the traced
    program names the module that computed it (``scopes_of``)."""
    return f"spmd[{fqn}]"


def scopes_of(name_stack: str) -> list[str]:
    """The modules (outermost first) of the name stack of a traced op."""
    return _SCOPE.findall(name_stack)


def _is_seq(x: Any, seq_len: int) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) >= 2 and x.shape[1] == seq_len


def _dim1(x: Any) -> int | None:
    return int(x.shape[1]) if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) >= 2 else None


def _uniform(x, depth: int = 0) -> bool:
    """Whether traced ``x`` is one constant broadcast (``jnp.ones`` of a mask a model makes when none is given):
    read from how the trace built it (its producing equation), so it is never gathered."""
    if depth > 8:
        return False
    const = x.get_const() if hasattr(x, "get_const") else None
    if const is not None:
        const = np.asarray(const)
        return const.size == 0 or bool((const == const.reshape(-1)[0]).all())
    eqn = getattr(x, "parent", None)
    if eqn is None or getattr(eqn, "primitive", None) is None:
        return False
    if eqn.primitive.name in ("broadcast_in_dim", "convert_element_type", "reshape", "copy", "reduce_precision") \
            and len(eqn.in_tracers) == 1:
        return _uniform(eqn.in_tracers[0], depth + 1)
    return False


def experts_routers(seen: dict, ep_records: list) -> set:
    """The modules that route tokens to expert-parallel modules over a sequence cut over cp: each ep-styled
    module's innermost enclosing module taking the ``[batch, seq, ...]`` sequence (``seen``: every module call of
    the trace, and whether it did). Its routing (a capacity per sequence: a running count over the whole
    sequence) runs on the sequence gathered over cp (``ContextCalls.around``), its collectives explicit, and the
    experts inside it on each device's part of the buffers (``ContextCalls.experts_cut``)."""
    out = set()
    for r in ep_records:
        parts = r["module"].split(".")
        m = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if seen.get(".".join(parts[:i]))), None)
        if m is not None:
            out.add(m)
    return out


class ContextCalls:
    """The attention calls of one trace of the step over mesh dim ``cp`` (size ``n``) cutting a sequence of
    ``seq_len`` positions; ``records`` the calls seen, each with its method and local bytes.

    ``gathered``: the modules (dotted paths) run on the whole sequence: the module that computes a model's own
    attention (found by the step, ``spmd.parallel.step._build``), its sequence inputs gathered over cp and its
    outputs cut back to this device's positions (:meth:`around`). ``seen``: every module call of the trace and
    whether it took a ``[batch, seq, ...]`` input (the candidates)."""

    def __init__(self, jax_mesh: Any, n: int, seq_len: int, axis: str = CP, gathered: frozenset = frozenset(),
                 tp: tuple[str, int] | None = None, ring: bool = True, seq_of: dict | None = None,
                 routers: frozenset = frozenset()):
        self.jax_mesh, self.n, self.seq_len, self.axis = jax_mesh, n, seq_len, axis
        # ring=False: every call the all-gather of K/V (a pipeline's stages where no ring can run: _cp.ring_blocker)
        self.ring = ring
        self.tp = tp if tp is not None and tp[1] > 1 else None  # (mesh dim, size): the heads cut over it
        self.gathered = frozenset(gathered)
        # of those, an MoE's routing (``experts_routers``): its token-wise submodules run on the cut (``run_on_cut``)
        self.routers = frozenset(routers)
        self.whole_of: dict[int, tuple] = {}  # a router's gathered inputs, by id: (gathered, cut, joint, record)
        self.records: list[dict] = []
        self.lookups: list[dict] = []  # embedding lookups on the batch's ids (linen, nnx), for the table
        self.attends: set[str] = set()  # the tables a tied output head (linen's Embed.attend) multiplies by
        self.seen: dict[str, bool] = {}
        # each module call's (fqn, k-th call) leaves' dim 1, inputs and outputs (``seq_leaves`` reads two traces')
        self.dims: dict[tuple[str, int], tuple[tuple, tuple]] = {}
        self.seq_of = seq_of or {}  # ``seq_leaves``' answer: which of a call's leaves are the sequence
        self._calls: dict[str, int] = {}  # each module's calls so far in this trace
        self._seq_ids: dict[int, Any] = {}  # the open calls' inputs read from the program as the sequence, by id
        self._open: set[str] = set()
        self._local = False  # inside an intercepted call's own attention on this device's block
        self._ints: dict[int, Any] = {}  # integer inputs gathered once per trace (XLA merges the repeats), by id
        self.cut_params: set[str] = set()  # an expert-parallel module's, run cut over cp (``experts_cut``)
        # the activations a sequence-parallel style handed on cut over cp and tp (``note_sp_cut``), by id
        self._sp_cut: dict[int, Any] = {}

    def _record(self, rec: dict) -> None:
        """A call's record, with the modules open around it (``with_context`` reads which run in an ``nn.scan``)."""
        rec["open"] = tuple(sorted(self._open))
        self.records.append(rec)

    # --- a module run on the gathered sequence --------------------------------------------------------
    def around(self, call: Any, run: Callable) -> Any:
        """``Hooks``' hook (``spmd.parallel.styles._hooks.Hooks.around``) for every module call of the step: traced
        under its module's scope; a module of ``gathered`` runs on the whole sequence: every ``[batch, seq, ...]``
        argument all-gathered over cp (integer ones, ids or masks, once per trace), the module's own code (and its
        styles, ``run``) on it, every ``[batch, seq, ...]`` float output cut back to this device's positions. In
        the backward pass the output's cotangent is all-gathered and the input's cut: the module's gradients are
        whole on every device of cp, its parameters' need no reduction over cp."""
        if call.fqn in self._open:
            return NotImplemented
        args, kwargs = call.args, call.kwargs
        self._calls[call.fqn] = k = self._calls.get(call.fqn, -1) + 1
        key = (call.fqn, k)
        leaves = jax.tree.leaves((args, kwargs))
        self.dims[key] = (tuple(_dim1(x) for x in leaves), ())
        seq_in, seq_out = self.seq_of.get(key, (None, None))
        read = seq_in is not None and len(seq_in) == len(leaves)
        seq_in = seq_in if read else tuple(_is_seq(x, self.seq_len) for x in leaves)
        opened = {id(x): x for x, s in zip(leaves, seq_in) if read and s and id(x) not in self._seq_ids}
        self._seq_ids.update(opened)
        self.seen[call.fqn] = self.seen.get(call.fqn, False) or any(seq_in)
        self._open.add(call.fqn)
        try:
            with jax.named_scope(scope_name(call.fqn)):
                if call.fqn not in self.gathered:
                    out = run_on_cut(self, call, run)
                    out = self._lookup(call, run(call)) if out is NotImplemented else out
                    self.dims[key] = (self.dims[key][0], tuple(_dim1(y) for y in jax.tree.leaves(out)))
                    return out
                rec = {"call": call.fqn, "method": "gather sequence", "n": self.n, "gathered": [], "cut": [],
                       "params": [p for p, _ in call.params()]}
                it = iter(seq_in)
                # sequence parallelism beside cp: inputs cut over cp and tp are gathered over both, and the
                # module's outputs cut back over both (its tp styles take the whole sequence: ``in_gathered``)
                joint = self.tp is not None and any(self._sp_cut.get(id(x)) is x for x in leaves)
                rec["joint"] = joint
                call.args, call.kwargs = jax.tree.map(lambda x: self._gathered(x, rec, next(it), joint),
                                                      (args, kwargs))
                if call.fqn in self.routers:
                    for x, g in zip(leaves, jax.tree.leaves((call.args, call.kwargs))):
                        if g is not x and jnp.issubdtype(g.dtype, jnp.inexact):
                            self.whole_of[id(g)] = (g, x, joint, rec)
                out = run(call)
                call.args, call.kwargs = args, kwargs
                outs = jax.tree.leaves(out)
                self.dims[key] = (self.dims[key][0], tuple(_dim1(y) for y in outs))
                seq_out = seq_out if seq_out is not None and len(seq_out) == len(outs) else \
                    tuple(_is_seq(y, self.seq_len) for y in outs)
                it = iter(seq_out)
                out = jax.tree.map(lambda y: self._cut(y, rec, next(it), joint), out)
                rec["params"] = [p for p in rec["params"] if p not in self.cut_params]  # experts: summed over cp
                self._record(rec)
                return out
        finally:
            self._open.discard(call.fqn)
            for i in opened:
                self._seq_ids.pop(i, None)

    def note_sp_cut(self, y) -> None:
        """``y``: a tp style's output handed on cut over cp and tp (sequence parallelism beside cp): a module run
        on the gathered sequence gathers it over both, and cuts its outputs back over both."""
        self._sp_cut[id(y)] = y
        self.__dict__.setdefault("_sp_alive", []).append(y)  # kept alive: a freed tracer's id may be reused

    def in_gathered(self) -> bool:
        """Whether a module run on the gathered sequence is open (its activations whole over cp)."""
        return any(m in self.gathered for m in self._open)

    def cut_seq(self, x) -> bool:
        """Whether ``x`` (a styled module's input) holds the batch's sequence cut over cp, as read from the program
        (``spmd.parallel.context._seq``: an input of an open module call whose dim 1 follows the batch's), outside
        any module run on the gathered sequence: a tp style's region takes it manual over cp too."""
        return id(x) in self._seq_ids and self._seq_ids[id(x)] is x and not any(m in self.gathered for m in self._open)

    def _lookup(self, call: Any, out: Any) -> Any:
        """Note a lookup: a module with one parameter, a rank-2 table, called on the batch's [batch, seq] integer
        ids (an embedding): GSPMD transposes it by gathering the ids and the output's gradient over cp."""
        x = call.args[0] if call.args else None
        if (getattr(call, "method", "__call__") == "__call__" and hasattr(x, "dtype")
                and jnp.issubdtype(x.dtype, jnp.integer) and np.ndim(x) == 2 and x.shape[1] == self.seq_len
                and hasattr(out, "shape") and tuple(out.shape[:2]) == tuple(x.shape)):
            own = call.params()
            if len(own) == 1 and np.ndim(own[0][1]) == 2:
                self.lookups.append({"param": own[0][0], "module": call.fqn, "ids": (tuple(x.shape), str(x.dtype)),
                                     "out": (tuple(out.shape), str(out.dtype)), "n": self.n})
        return out

    def _gathered(self, x, rec, seq: bool, joint: bool = False):
        if not seq or _uniform(x):  # a constant fill (an all-ones mask) is whole already
            return x
        if not jnp.issubdtype(x.dtype, jnp.inexact):  # ids, positions, a padding mask: no gradient
            if id(x) not in self._ints:
                self._ints[id(x)] = (x, self._all_gather(x))
                rec["gathered"].append((tuple(x.shape), str(x.dtype)))
            return self._ints[id(x)][1]
        rec["gathered"].append((tuple(x.shape), str(x.dtype)))
        return _gather_seq(x, self, joint and self._sp_cut.get(id(x)) is x)

    def _cut(self, y, rec, seq: bool, joint: bool = False):
        if not seq or not jnp.issubdtype(y.dtype, jnp.inexact):
            return y
        rec["cut"].append((tuple(y.shape), str(y.dtype)))
        return _cut_seq(y, self, joint)

    def _axes(self, joint: bool) -> tuple:
        """The mesh dims a sequence is cut over: cp, or (``joint``: sequence parallelism beside cp, each device's
        (cp, tp) block, cp-major) cp and tp."""
        return (self.axis, self.tp[0]) if joint and self.tp is not None else (self.axis,)

    def _all_gather(self, x, dim: int = 1, joint: bool = False):
        """``x`` (global view, cut over cp on ``dim``: the sequence; ``joint``: over cp and tp) whole on every
        device of cp (and tp): one all-gather."""
        axes = self._axes(joint)
        return jax.shard_map(lambda x: lax.all_gather(x, axes, axis=dim, tiled=True), mesh=self._region_mesh(),
                             in_specs=P(*[None] * dim, axes), out_specs=P(), axis_names=set(axes),
                             check_vma=False)(x)

    def _own_chunk(self, y, dim: int = 1, joint: bool = False):
        """``y`` (whole on every device of cp) cut over cp (``joint``: cp and tp) on ``dim`` (the sequence): each
        device keeps its part, nothing moves."""
        axes = self._axes(joint)
        t = y.shape[dim] // (self.n * (self.tp[1] if len(axes) > 1 else 1))

        def body(y):
            return lax.dynamic_slice_in_dim(y, lax.axis_index(axes) * t, t, axis=dim)

        return jax.shard_map(body, mesh=self._region_mesh(), in_specs=P(), out_specs=P(*[None] * dim, axes),
                             axis_names=set(axes), check_vma=False)(y)

    # --- an expert-parallel module inside a module run on the gathered sequence ---------------------------
    def experts_dim(self, x, keep: tuple[int, ...]) -> int | None:
        """The dim of an expert-parallel module's input ``x`` (its dispatch buffers, whole on every device of cp
        inside a module run on the gathered sequence) to cut over cp, so that each device of cp dispatches and
        runs its own part of the routed tokens (the experts do not run whole on every device of cp): the first of
        ``keep`` (the groups), else any other but the last (the features; not the experts dim) that cp divides;
        None outside a gathered module or where cp divides none."""
        if not any(m in self.gathered for m in self._open) or self.n < 2:
            return None
        dims = [d % x.ndim for d in keep[:1]] + [d for d in range(x.ndim - 1) if d not in [k % x.ndim for k in keep]]
        return next((d for d in dims if x.shape[d] % self.n == 0), None)

    def experts_cut(self, fqn: str, x, dim: int, params: list):
        """``x`` cut over cp on ``dim`` (nothing moves; backward: its cotangent all-gathered); ``params`` (the
        experts' own) are then summed over cp, not whole."""
        self.cut_params.update(params)
        self._record({"call": fqn, "method": "experts cut", "n": self.n,
                             "gathered": [(tuple(x.shape), str(x.dtype))]})
        return _cut_dim(x, self, dim)

    def on_cut(self, fn, x, dim: int):
        """``fn`` (an exchange over another manual dim: ep's all-to-all) on each device's block of ``x`` cut over
        cp on ``dim``, in a region manual over cp too (in global view GSPMD would gather the block first)."""
        spec = P(*[None] * dim, self.axis)
        return jax.shard_map(fn, mesh=self._region_mesh(), in_specs=spec, out_specs=spec, axis_names={self.axis},
                             check_vma=False)(x)

    def experts_gathered(self, y, dim: int):
        """The experts' output (cut over cp on ``dim``) whole again on every device of cp: one all-gather."""
        self.records[-1]["gathered"].append((tuple(y.shape), str(y.dtype)))
        return _gather_dim(y, self, dim)

    # --- interception ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        """``jax.nn.dot_product_attention`` and flax's ``dot_product_attention`` / ``make_causal_mask`` run across
        the cut while the step traces in this context: each is a dispatcher (``_dispatch``, put in place once)
        that runs this object's version while it is the context's active one (``_dispatch.ACTIVE``: other
        threads and contexts, tracing at the same time, see theirs or the original), the original otherwise."""
        install_dispatchers()
        import flax.linen as nn

        token = ACTIVE.set(self)
        try:
            with nn.intercept_methods(self._linen):
                yield self
        finally:
            ACTIVE.reset(token)

    def version(self, kind: str, orig: Callable) -> Callable:
        """This object's version of an intercepted function ``orig`` (``kind``: ``"jax"``, ``jax.nn``'s
        attention; ``"flax"``, flax's; ``"causal_mask"``, flax's ``make_causal_mask``), run across the cut;
        ``"take"``: ``jnp.take_along_axis``, a masked sum where tp cuts the model too (``_take``)."""
        if kind == "take":
            return masked_take_along_axis(orig) if self.tp is not None else orig
        make = {"jax": self._jax_call, "flax": self._flax_call, "causal_mask": self._causal_mask}[kind]
        return make(orig)

    def _linen(self, next_fun, args, kwargs, context):
        """Note a tied output head: linen's ``Embed.attend`` (its table's gradient has a product's part, summed
        over cp, beside the lookup's)."""
        out = next_fun(*args, **kwargs)
        mod = context.module
        if context.method_name == "attend" and getattr(mod, "scope", None) is not None:
            own = jax.tree_util.tree_leaves_with_path(mod.variables.get("params", {}))
            if len(own) == 1:
                from spmd.parallel.plan._param_plan import path_str

                self.attends.add("/".join(str(p) for p in mod.scope.path) + "/" + path_str(own[0][0]))
        return out

    def _region_mesh(self):
        mesh = jax.sharding.get_abstract_mesh()
        return mesh if not mesh.empty else self.jax_mesh

    def _check(self, fn: str, q, k, v) -> None:
        for name, x in (("query", q), ("key", k), ("value", v)):
            if np.ndim(x) != 4:
                raise ValueError(f"{fn} under cp={self.n}: {name} has shape {tuple(np.shape(x))!r}, not [batch, seq, "
                                 "heads, head_dim]; the sequence cut over cp needs rank-4 operands with the sequence "
                                 "on dim 1.")
        if q.shape[1] != self.seq_len or k.shape[1] != self.seq_len:
            raise ValueError(f"{fn} under cp={self.n}: query has {q.shape[1]} positions and key {k.shape[1]}, but the "
                             f"batch's sequence cut over cp has {self.seq_len}; attention across the cut is "
                             "self-attention over the batch's sequence (dim 1). Leave cp out of the mesh for this "
                             "model.")

    def _causal_mask(self, orig: Callable) -> Callable:
        """flax's ``make_causal_mask`` of a ``[batch, seq]`` input under cp: each device builds its rows (its query
        positions, every key) where it stands, the mask cut over cp on its rows as the all-gather of K/V takes it;
        nothing moves. (Left to GSPMD, the mask's ``broadcast(arange(T))`` is cut like the tokens, and the
        comparison with every key gathers it over cp.) Inside a module run on the gathered sequence, or on another
        shape: flax's own."""
        calls = self

        def make_causal_mask(x, extra_batch_dims: int = 0, dtype=jnp.float32):
            if (calls._local or extra_batch_dims or np.ndim(x) != 2 or x.shape[1] != calls.seq_len
                    or calls.seq_len % calls.n or any(m in calls.gathered for m in calls._open)):
                return orig(x, extra_batch_dims=extra_batch_dims, dtype=dtype)
            b, t = x.shape[0], calls.seq_len // calls.n

            def rows():
                q = lax.axis_index(calls.axis) * t + jnp.arange(t)
                keep = q[:, None] >= jnp.arange(calls.seq_len)[None, :]
                return jnp.broadcast_to(keep, (b, 1, t, calls.seq_len)).astype(dtype)

            return jax.shard_map(rows, mesh=self._region_mesh(), in_specs=(), out_specs=P(None, None, calls.axis),
                                 axis_names={calls.axis}, check_vma=False)()

        return make_causal_mask

    def _jax_call(self, orig: Callable) -> Callable:
        calls = self
        fn = "jax.nn.dot_product_attention"

        def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                                  query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                                  implementation=None, return_residual=False):
            if calls._local:  # called by a flax dot_product_attention running on this device's block
                return orig(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                            local_window_size=local_window_size, implementation=implementation,
                            return_residual=return_residual)
            for arg, val in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths),
                             ("local_window_size", local_window_size)):
                if val is not None:
                    raise ValueError(f"{fn} under cp={calls.n}: {arg}={val!r} is not supported across the sequence "
                                     f"cut; pass a mask= array (all-gather K/V) or segment ids to "
                                     f"spmd.parallel.ring_attention in the model instead.")
            if return_residual:
                raise ValueError(f"{fn} under cp={calls.n}: return_residual=True is not supported across the sequence "
                                 "cut; call it without return_residual.")
            calls._check(fn, query, key, value)

            def local(q, k, v, b, m, is_causal):
                return orig(q, k, v, b, m, scale=scale, is_causal=is_causal)

            return calls._run(fn, query, key, value, bias, mask, is_causal, scale, local)

        return dot_product_attention

    def _flax_call(self, orig: Callable) -> Callable:
        calls = self
        fn = "flax dot_product_attention"
        accepted = set(inspect.signature(orig).parameters)  # linen's and nnx's differ past ``module``

        def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                                  dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                                  **extra):
            unknown = sorted(set(extra) - accepted)
            if unknown:
                raise TypeError(f"{fn} under cp={calls.n} (intercepted to run across the sequence cut): keyword "
                                f"argument {unknown[0]}={extra[unknown[0]]!r} is not one of "
                                f"{orig.__module__}.dot_product_attention's ({', '.join(sorted(accepted))}); "
                                "pass only those (or leave it out).")
            if dropout_rate > 0.0 and not deterministic:
                raise ValueError(f"{fn} under cp={calls.n}: dropout_rate={dropout_rate!r} with deterministic=False: "
                                 "attention dropout is not supported across the sequence cut; use dropout_rate=0.0 "
                                 "(or deterministic=True).")
            for arg in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
                if extra.get(arg) is not None:
                    raise ValueError(f"{fn} under cp={calls.n}: {arg}={extra[arg]!r} is not supported across the "
                                     "sequence cut; leave it None.")
            calls._check(fn, query, key, value)
            causal = bool(extra.pop("is_causal", False))  # nnx's
            keep = {k: v for k, v in extra.items() if v is not None}

            def local(q, k, v, b, m, is_causal):
                return orig(q, k, v, b, m, deterministic=True, dtype=dtype, precision=precision, **keep)

            out = calls._run(fn, query, key, value, bias, mask, causal, None, local)
            return out.astype(dtype) if dtype is not None else out

        return dot_product_attention

    # --- the two methods -----------------------------------------------------------------------------
    def _run(self, fn, q, k, v, bias, mask, causal, scale, local):
        with jax.named_scope(CALL_SCOPE):  # its products are across the cut already (``whole_sequence_products``)
            return self._run_cut(fn, q, k, v, bias, mask, causal, scale, local)

    def _run_cut(self, fn, q, k, v, bias, mask, causal, scale, local):
        n, axis, t = self.n, self.axis, q.shape[1] // self.n
        if q.shape[1] % n:
            raise ValueError(f"{fn} under cp={n}: the sequence has {q.shape[1]} positions, not divisible by cp={n}; "
                             f"pad it to a multiple of {n}.")
        rec = {"call": fn, "q": (tuple(q.shape), str(q.dtype)), "kv": (tuple(k.shape), str(k.dtype)),
               "causal": bool(causal), "n": n}
        heads = self._heads_tp(q, k, v, bias, mask)
        rec["tp"] = self.tp[1] if heads else 1
        if heads and k.shape[2] < self.tp[1]:  # grouped-query K/V with fewer heads than tp (whole over tp):
            # each head repeated once per device of its group, cut over tp with the queries, each device takes the
            # head its query heads use (nothing moves forward; backward, the devices of a group sum their parts)
            rec["kv_repeat"] = r = self.tp[1] // k.shape[2]
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        if bias is None and mask is None and self.ring:
            zig = bool(causal) and t % 2 == 0 and n > 1
            rec["method"] = "ring (zigzag)" if zig else "ring"
            self._record(rec)
            return self._ring(q, k, v, causal, scale, zig, heads)
        rec["method"] = "all-gather K/V"
        self._record(rec)
        return self._allgather(q, k, v, bias, mask, causal, local, heads)

    def _heads_tp(self, q, k, v, bias, mask) -> str | None:
        """The tp dim the call's heads are cut over (its region manual over it too, as the column-parallel
        projections leave q, k, v: each device attends with its heads; grouped-query K/V with fewer heads than
        tp, a divisor of it, are repeated to one per device), or None: no tp, heads that tp does not divide, or a
        mask / bias with a heads dim of its own."""
        if self.tp is None:
            return None
        name, size = self.tp
        if q.shape[2] % size or (k.shape[2] % size and size % k.shape[2]) or v.shape[2] != k.shape[2]:
            return None
        if any(np.ndim(x) >= 3 and np.shape(x)[-3] != 1 for x in (bias, mask) if x is not None):
            return None
        return name

    def _ring(self, q, k, v, causal, scale, zig, heads=None):
        axis, n = self.axis, self.n
        spec = P(None, axis, heads)

        def body(q, k, v):
            if zig:  # the moves' results are kept by a checkpointed unit (a re-gathering FSDP unit, activation
                # checkpointing), as the tp collectives' are: its backward pass does not move them again
                q, k, v = (checkpoint_name(to_zigzag(x, axis, n), TP_COMM) for x in (q, k, v))
            out = ring_attention(q, k, v, axis_name=axis, causal=causal, scale=scale,
                                 layout="zigzag" if zig else "contiguous")
            return checkpoint_name(from_zigzag(out, axis, n), TP_COMM) if zig else out

        return jax.shard_map(body, mesh=self._region_mesh(), in_specs=(spec, spec, spec), out_specs=spec,
                             axis_names={axis} | ({heads} if heads else set()), check_vma=False)(q, k, v)

    def _allgather(self, q, k, v, bias, mask, causal, local, heads=None):
        axis, n, seq = self.axis, self.n, self.seq_len

        def rows(x):  # a mask / bias: its query rows cut with the queries where it has them
            if x is None:
                return None
            x = jnp.asarray(x)
            if x.ndim >= 2 and x.shape[-2] == seq:
                return P(*([None] * (x.ndim - 2)), axis, None)
            return P()

        extra = [x for x in (bias, mask) if x is not None]
        specs = (P(None, axis, heads),) * 3 + tuple(rows(x) for x in extra)

        def body(q, k, v, *ex):
            ex = list(ex)
            b = ex.pop(0) if bias is not None else None
            m = ex.pop(0) if mask is not None else None
            k_all = lax.all_gather(k, axis, axis=1, tiled=True)
            v_all = lax.all_gather(v, axis, axis=1, tiled=True)
            if causal:  # this device's queries sit at rank * t onwards
                t = q.shape[1]
                q_pos = lax.axis_index(axis) * t + jnp.arange(t)
                keep = q_pos[:, None] >= jnp.arange(seq)[None, :]
                m = keep if m is None else jnp.logical_and(m, keep)
            self._local = True
            try:
                return local(q, k_all, v_all, b, m, False)
            finally:
                self._local = False

        return jax.shard_map(body, mesh=self._region_mesh(), in_specs=specs, out_specs=P(None, axis, heads),
                             axis_names={axis} | ({heads} if heads else set()), check_vma=False)(
            q, k, v, *[jnp.asarray(x) for x in extra])


# ---------------------------------------------------------------------------------------------- the table


def lookup_terms(lookups: list[dict], cotangents: dict | None = None) -> dict:
    """``{"all-gather": {count, bytes}}`` of the embedding lookups on the cut ids: GSPMD's transpose of a lookup
    whose ids are cut over cp gathers the ids and the output's gradient (this device's batch rows, every
    position) and scatter-adds them into the whole table, in place of an all-reduce of its gradient. Lookups
    whose transposes scatter-add one cotangent (``cotangents``: ``{module: key}``, read from the traced step,
    ``spmd.parallel.step._heads.lookup_cotangents``; outputs summed, GPT-2's token and position tables) gather
    it once."""
    out, seen = {"count": 0, "bytes": 0}, set()
    for r in lookups:
        ct = (cotangents or {}).get(r.get("module"))
        for shape, dtype in (r["ids"],) + (() if ct is not None and ct in seen else (r["out"],)):
            out["count"] += 1
            out["bytes"] += _nbytes(shape, dtype)  # the shapes as the device's region saw them
        seen.add(ct)
    return out


def attention_terms(records: list[dict], forward_only: bool = False, switched: bool = False) -> dict:
    """``{kind: {count, bytes}}`` per device of one step's attention calls over cp (forward and backward; a ring's
    forward alone with ``forward_only``, a pipeline's forward branch):

    - ring: ``cp - 1`` hops of K and V forward; backward ``cp - 1`` hops of K and V (none at cp=2: its one hop
      is the forward's, which XLA reuses) and ``cp`` of dK, dV (float32, travelling with their block, the last
      hop home); zigzag adds, per q, k, v and the output, two ppermutes
      of half the local block forward and two backward (the transposes), one each at cp=2 (where the even
      chunks stay home); ``switched``: each call in a branch of a ``lax.switch`` (a pipeline's units of different
      kinds), whose forward and backward are two switches: the backward's hops of K and V at cp=2 too;
    - all-gather K/V: one all-gather each of K and V (the gathered bytes) forward, one reduce-scatter each of
      dK, dV backward;
    - gather sequence (a module run on the whole sequence, :meth:`ContextCalls.around`): one all-gather of each
      of its sequence inputs forward (an integer one once per trace) and one of each float output's cotangent
      backward.
    """
    out = {k: {"count": 0, "bytes": 0} for k in ("all-gather", "reduce-scatter", "collective-permute")}
    layers = 1

    def add(kind, nbytes, count=1):
        out[kind]["count"] += count * layers
        out[kind]["bytes"] += count * layers * nbytes

    for r in records:
        n, layers = r["n"], r.get("scan", 1)  # in an nn.scan body (``per_layer``): once per layer
        if r["method"] == "experts cut":  # the experts' output gathered forward, their input's cotangent backward
            for shape, dtype in r["gathered"]:
                add("all-gather", _nbytes(shape, dtype))
            continue
        if r["method"] == "gather sequence":  # forward: each input gathered; backward: each output's cotangent
            for shape, dtype in r["gathered"]:
                add("all-gather", _nbytes(shape, dtype))
            for shape, dtype in r["cut"]:
                add("all-gather", _nbytes(shape, dtype))
            continue
        (qs, qd), (ks, kd) = r["q"], r["kv"]
        cut = n * r.get("tp", 1)  # the sequence over cp, the heads over tp
        rep = r.get("kv_repeat", 1)  # grouped-query K/V repeated to one head per device of tp
        q_loc, kv_loc = _nbytes(qs, qd) // cut, _nbytes(ks, kd) * rep // cut
        kv32 = _nbytes(ks, np.float32) * rep // cut
        if r["method"].startswith("ring"):
            if forward_only:
                add("collective-permute", kv_loc, 2 * (n - 1))  # K, V
                if r["method"] == "ring (zigzag)":
                    for nbytes in (q_loc, kv_loc, kv_loc, q_loc):  # q, k, v in; the output out
                        add("collective-permute", nbytes // 2, zigzag_moves(n))
                continue
            if n > 1:
                add("collective-permute", kv_loc, 2 * (n - 1))  # K, V forward
                if n > 2 or layers > 1 or switched:  # at cp=2 the backward's one hop is the forward's (XLA inlines
                    # the 1-step loops, merges them), but in an nn.scan body (the backward runs in a loop of its own)
                    # or a switch's branch (the backward in a switch of its own)
                    add("collective-permute", kv_loc, 2 * (n - 1))  # K, V backward
                add("collective-permute", kv32, 2 * n)  # dK, dV
            if r["method"] == "ring (zigzag)":
                for nbytes in (q_loc, kv_loc, kv_loc, q_loc):  # q, k, v in; the output out
                    add("collective-permute", nbytes // 2, 2 * zigzag_moves(n))  # forward and backward
        else:
            add("all-gather", kv_loc * n, 2)
            add("reduce-scatter", kv_loc * n, 2)
    return out


def per_layer(records: list[dict], scans: dict) -> list[dict]:
    """``records`` with those of calls in an ``nn.scan`` body (a module open around them runs in a scan of
    ``scans``, ``{path: length}``) kept from the body's last trace alone (flax traces a scan's body twice: its
    loop-invariant check, then ``lax.scan``'s), each marked ``scan``: its length (the call runs once per layer)."""
    lengths = [max([scan_of(m.replace(".", "/"), scans) for m in r.get("open", ())] or [1]) for r in records]
    last = {(r["call"], r.get("open")): i for i, (r, k) in enumerate(zip(records, lengths)) if k > 1}
    return [r if k == 1 else {**r, "scan": k} for i, (r, k) in enumerate(zip(records, lengths))
            if k == 1 or last[(r["call"], r.get("open"))] == i]


def seq_len(batch: Any) -> int:
    """The sequence length of a batch cut over cp: dim 1 of its leaves of rank 2 or more."""
    lens = {np.shape(x)[1] for x in jax.tree.leaves(batch) if np.ndim(x) >= 2}
    return lens.pop() if len(lens) == 1 else 0


def with_context(comm: dict, plan: ParamPlan, calls: Any, accum_steps: int, region: bool,
                 positional: Any = (), products: Any = (), cotangents: dict | None = None, side: Any = (),
                 joins: Any = ()) -> dict:
    """The table with cp's terms: the attention calls' (``attention_terms``), the all-reduce over cp of every
    parameter's gradient (whole over cp, it sums each device's positions' parts: GSPMD's reduction) but

    - inside a region manual over data dims (``region``), the tables of lookups on the cut ids, whose gradients
      GSPMD forms there from the gathered ids (``lookup_terms``), unless the table is also a tied output head
      (a table among ``products``, the parameters the traced step multiplies by: ``Embed.attend``, GPT-2's
      ``Dense`` with the table as kernel; that product's gradient is all-reduced); with no data dim it
      all-reduces a table's gradient, a tied head's twice (the lookup's part and the head's, each on its own);
      lookups sharing a cotangent (``cotangents``) gather it once (``lookup_terms``);
    - a module's run on the gathered sequence (``ContextCalls.around``): computed whole on every device;
    - a ``positional`` one (a learned position table added to the sequence row by row,
      ``spmd.parallel.step._heads.positional_params``): its gradient is cut over cp on the rows, gathered
      (one all-gather), and reduced over the data dims on each device's rows (1 / cp of its bytes);
    - a ``side`` one (computed on batch vectors whole over cp only, ``spmd.parallel.step._heads.side_params``): its
      gradient is whole over cp, formed from the cotangent of its value where the model broadcasts it into the
      sequence, which is all-reduced there (``joins``: the bytes of each, per micro-batch)."""
    records, lookups = (calls.records, calls.lookups) if calls is not None else ([], [])
    scans = dict(plan.scans)
    records = per_layer(records, scans)
    n = calls.n if calls is not None else 1
    looked_up = {r["param"] for r in lookups}
    attends = (set(calls.attends) if calls is not None else set()) | (looked_up & set(products))
    lookups = lookups if region else []
    comm = {k: (dict(v) if isinstance(v, dict) else v) for k, v in comm.items()}
    ctx = attention_terms(records)
    tables = {r["param"] for r in lookups} - attends
    whole = {p for r in records for p in r.get("params", ())}  # a gathered module's: computed whole on each device
    pos = [e for e in plan.entries if e.path in set(positional) and e.path not in whole]
    summed = [e for e in plan.entries if e.path not in tables and e.path not in whole and e not in pos
              and e.path not in set(side)]
    if not region:
        summed += [e for e in plan.entries if e.path in looked_up & attends]
    tp = calls.tp if calls is not None else None
    ti = plan.mesh_dim_names.index(tp[0]) if tp is not None and tp[0] in plan.mesh_dim_names else None

    names = plan.mesh_dim_names
    ei = names.index(EP_DIM) if EP_DIM in names else None

    def local(e):  # the gradient each device sums over cp: its block over tp, its own experts over ep
        b = e.nbytes // tp[1] if ti is not None and e.shard_dim(ti) is not None else e.nbytes
        return b // plan.mesh_shape[ei] if ei is not None and e.shard_dim(ei) is not None else b

    # each micro-batch's gradients summed over cp (in the accumulation loop), a stacked (nn.scan) parameter's in
    # the backward loop, layer by layer
    ctx["all-reduce"] = {"count": (sum(scan_of(e.path, scans) if e.stacked else 1 for e in summed)
                                   + len(joins)) * accum_steps,
                         "bytes": (sum(local(e) for e in summed) + sum(joins)) * accum_steps}
    looked = lookup_terms(lookups, cotangents)
    ctx["all-gather"] = {f: ctx["all-gather"][f] + looked[f] for f in ("count", "bytes")}
    for kind in ctx:
        if kind != "all-reduce":  # the activations' terms: per micro-batch
            ctx[kind] = {f: ctx[kind][f] * accum_steps for f in ("count", "bytes")}
    if pos:  # once per step, as the gradients' reductions
        ctx["all-gather"]["count"] += len(pos)
        ctx["all-gather"]["bytes"] += sum(e.nbytes for e in pos)
        names = plan.mesh_dim_names
        cut_less = [e for e in pos if not any(e.shard_dim(names.index(d)) is not None for d in names if d != CP)]
        if region and cut_less:  # their reduction over the data dims: each device's rows
            less = sum(e.nbytes - e.nbytes // n for e in cut_less)
            par = comm["parameters"] = {k: dict(v) for k, v in comm["parameters"].items()}
            par["all-reduce"]["bytes"] -= less
            comm["total"] = {k: dict(v) for k, v in comm["total"].items()}
            comm["total"]["all-reduce"]["bytes"] -= less
    total = {k: dict(v) for k, v in comm["total"].items()}
    # the tp styles' activations ([batch, seq, ...]) hold the device's positions: 1 / cp of the bytes, but inside a
    # module run on the gathered sequence (and not the parameters a projection whole over tp gathers: whole); an
    # experts module cut over cp there (``experts_cut``: each device of cp runs its part of the dispatched
    # tokens, ExpertTensorParallel's all-reduces on that part) holds 1 / cp of them again
    wholes = [r["call"] for r in records if r["method"] == "gather sequence"]
    parts = [r["call"] for r in records if r["method"] == "experts cut"]

    def under(r, calls):
        return any(r["module"] == g or r["module"].startswith(g + ".") for g in calls)

    cut = [dict(r, gathered_params=[]) if r.get("gathered_params") else r for r in comm.get("modules", ())
           if not under(r, wholes) or under(r, parts)]
    if cut and n > 1:
        act = comm["activations"] = {k: dict(v) for k, v in comm["activations"].items()}
        for kind, v in activation_terms(cut, accum_steps=accum_steps).items():
            less = v["bytes"] - v["bytes"] // n
            act[kind]["bytes"] -= less
            total[kind]["bytes"] -= less
    for kind, v in ctx.items():
        t = total.setdefault(kind, {"count": 0, "bytes": 0})
        t["count"] += v["count"]
        t["bytes"] += v["bytes"]
    comm["context"] = ctx
    comm["total"] = total
    comm["attention"] = list(records)
    return comm
