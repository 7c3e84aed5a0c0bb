"""``fully_shard``'s unit as a parallel style: ``FullyShardUnit`` owns its parameters' placement over the shard
dim and the communication around its call, as a tensor-parallel style owns its own.

torch's FSDP2 ``fully_shard(module)`` installs hooks around the module's forward: a pre-forward all-gather
of its parameters, a post-forward free (``_fully_shard/_fsdp_state.py``, ``_fsdp_param_group.py``); the
backward pass reduce-scatters their gradients. Here the hooks (``spmd.parallel.styles._hooks``) hand a
unit's call to its style's ``run_call``, as they hand a styled module's to its tensor-parallel style:

- **placements** (``param_placements``): each parameter cut on dim 0 over the shard dim, torch's; the plan
  moves the cut to the first dim no other mesh dim cuts (a row-wise kernel's tp cut, a scan's layer axis);
- **the call** (``run_call``): gather the unit's parameters right before it runs (``gather_unit``: one
  all-gather per buffer over the shard dim, in a nested region manual over every dim, so XLA never sees a
  collective on a tp-sharded operand, which it would first gather over tp), run the unit on them. ``jax.grad``
  of the all-gather is one reduce-scatter per buffer. With ``reshard_after_forward`` that runs under
  ``jax.checkpoint`` (every value saved but the gathered parameters and their casts and reshapes: the backward
  pass gathers again and recomputes nothing else, as torch's FSDP2), its
  gathers tied to its input so that they run when it runs (``_after``; the tie's zero summed on each device's
  block, no collective: ``_zero_from``).
- **with activation checkpointing** (``spmd.parallel.styles._remat``) on the same unit: re-gathering, its
  policy replaces the one above; keeping its gathers, only the apply after the gather is checkpointed, so the
  gathered parameters are the recomputation's inputs, never gathered again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from placements import Replicate, Shard
from spmd.parallel.plan._param_plan import PlanEntry
from spmd.parallel.plan._shard import gather_unit
from spmd.parallel.styles._styles import ParallelStyle
from spmd.parallel.styles._tp_calls import _is_array, split_arrays

__all__ = ["FullyShardUnit", "REGATHER"]

REGATHER = "spmd_fsdp_regather"  # the named scope of a unit's backward pass: its re-gather, the fsdp term's

# What a re-gathering unit's backward pass computes again: the gather and what the gathered parameters become
# without arithmetic (a slice off the padding, a cast, a transpose, a reshape), the operations below. Every other
# value its forward pass computed is kept, as torch's FSDP keeps every activation autograd saves and frees only
# the gathered parameters: no norm, softmax or activation function runs twice. A user's ``jax.custom_vjp`` whose
# forward rule calls the function itself (``return f(x), res``, the JAX docs' idiom) reaches the policy as one
# ``custom_vjp_call``: it is kept too (not kept, its forward ran again in the backward pass). A mixed precision's
# gather, a custom_vjp too, runs its gather inline in its forward rule (``_gather_mixed``), so the policy sees
# the all-gather and the casts, not a ``custom_vjp_call``.
_REGATHERED = frozenset({"all_gather", "slice", "split", "concatenate", "convert_element_type", "transpose",
                         "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "copy_p"})


def _saved(axis: str) -> Callable:
    """The ``jax.checkpoint`` policy of a re-gathering unit whose parameters gather over the mesh dim ``axis``
    (see ``_REGATHERED``): the gathered parameters and their casts and reshapes are not saved, every other value
    is: the tp collectives' results, and an all-gather over another dim (cp's sequence gather, sp's over tp),
    an activation as torch's FSDP2 keeps it (recomputed from its saved input, XLA merged it with the forward
    pass's gather: held all along, but a collective the table counted twice)."""

    def policy(prim, *_, **params) -> bool:
        if prim.name == "all_gather":
            names = params.get("axis_name", ())
            return axis not in (names if isinstance(names, (tuple, list)) else (names,))
        return prim.name not in _REGATHERED

    return policy


@dataclass(frozen=True)
class FullyShardUnit(ParallelStyle):
    """The style of one ``fully_shard`` unit (``FSDPSpec.unit_style``): see the module doc. ``mp_policy``: a
    ``MixedPrecisionPolicy`` (gather in ``param_dtype``, reduce in ``reduce_dtype``) or None."""

    reshard_after_forward: bool = True
    mp_policy: Any = None

    def param_placements(self, module_path, params, module_type=None):
        return {name: Shard(0) if len(shape) else Replicate() for name, shape in params.items()}

    def run_call(self, call) -> Any:
        hooks = call.hooks
        if hooks.in_remat:
            raise ValueError(
                f"activation_checkpointing: unit {hooks.in_remat[-1]!r} holds the fully_shard unit {call.fqn!r}; "
                "recomputing it would gather that unit's parameters again in the backward pass. Checkpoint the "
                "fully_shard units themselves, or modules inside them.")
        params = call.params()
        entries = [hooks.entry_for(p, v) for p, v in params]
        mine = [i for i, e in enumerate(entries) if e.unit == call.spath]
        arrays, rebuild = split_arrays((call.args, call.kwargs))
        policy = call.remat_policy  # the unit's own activation checkpointing, if any

        def apply(full, arrays):
            a, k = self.cast_inputs(rebuild(list(arrays)))
            return call.apply(full, a, k, remat=policy is not None)

        def run(shards, arrays):
            full = list(shards)
            for i, y in zip(mine, self.gather(hooks, [shards[i] for i in mine], [entries[i] for i in mine])):
                full[i] = y
            if policy is not None and not self.reshard_after_forward:
                return _tied_checkpoint(hooks, apply, policy, full, arrays)
            return apply(full, arrays)

        return self._call(hooks, run, [v for _, v in params], arrays, policy)

    # --- the gathers ----------------------------------------------------------------------------------
    def gather(self, hooks, leaves: Sequence[Any], entries: Sequence[PlanEntry]) -> list:
        """The full parameters of ``entries`` from this device's padded blocks (cast to ``param_dtype``); the
        tp-cut ones gather in a region manual over tp too, the tp-whole ones where they are (a region's
        transpose would all-reduce their gradients over tp once more)."""
        pd = self.mp_policy.param_dtype if self.mp_policy else None
        out = [x.astype(pd) if pd is not None and jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]
        cut = [i for i, e in enumerate(entries) if e.shard_dim(hooks.fi) is not None]
        groups: dict[bool, list[int]] = {}  # the cut leaves, tp-cut and tp-whole apart, in first-seen order
        for i in cut:
            groups.setdefault(hooks.layouts.tp_cut(entries[i]), []).append(i)
        for in_island, group in groups.items():
            ents = [entries[i] for i in group]

            def gather_in(*ls, ents=ents):
                flip = [e.stacked is None and e.path in hooks.gather_flip for e in ents]
                return tuple(gather_unit(list(ls), ents, hooks.fsdp, hooks.fi, flip))

            run = (lambda *ls, f=gather_in, ents=ents: hooks.layouts.island(f, ents, ls)) if in_island else gather_in
            got = run(*[out[i] for i in group]) if pd is None else self._gather_mixed(run, [leaves[i] for i in group])
            for i, y in zip(group, got):
                out[i] = y
        return out

    def _gather_mixed(self, gather_in: Callable, stored: list) -> tuple:
        """Gather in ``param_dtype``; the gradients reduce-scattered in ``reduce_dtype``, then stored dtype."""
        pd, rd = self.mp_policy.param_dtype, self.mp_policy.reduce_dtype
        dtypes = [x.dtype for x in stored]

        def cast(xs, dt):
            return [x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]

        @jax.custom_vjp
        def gathered(*xs):
            return gather_in(*cast(xs, pd))

        def fwd(*xs):  # the gather inline, not ``gathered``: a re-gathering unit's policy drops all-gathers
            return gather_in(*cast(xs, pd)), None

        def bwd(_, cts):
            dt = rd or pd
            cts = cast(cts, dt)
            prims = [jax.ShapeDtypeStruct(x.shape, dt if jnp.issubdtype(d, jnp.floating) else d)
                     for x, d in zip(stored, dtypes)]
            gs = jax.linear_transpose(lambda *xs: gather_in(*xs), *prims)(tuple(cts))
            return tuple(g.astype(d) for g, d in zip(gs, dtypes))

        gathered.defvjp(fwd, bwd)
        return gathered(*stored)

    def cast_inputs(self, tree: Any) -> Any:
        mp = self.mp_policy
        if not (mp and mp.param_dtype is not None and mp.cast_forward_inputs):
            return tree
        pd = mp.param_dtype
        return jax.tree.map(lambda x: x.astype(pd) if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
                            tree)

    # --- the unit's call ----------------------------------------------------------------------------
    def _call(self, hooks, run: Callable, shards: list, arrays: list, policy: Callable | None = None) -> Any:
        """``run(shards, arrays)``: the unit gathering its parameters and running. With
        ``reshard_after_forward``, the backward pass gathers them again: ``jax.checkpoint`` keeps every value
        computed with arithmetic (matmul outputs, norms, softmax, the tp collectives' results) and drops the
        gathered parameters and their casts and reshapes (``_saved``), so it recomputes no activation; the
        shards it keeps get
        ``+ 0`` computed from the incoming cotangent (``_plus_zero``), so the re-gather is a new all-gather of
        the backward pass (XLA:CPU drops optimization barriers before it merges equal ops, and would merge it
        with the forward pass's all-gather, holding the parameters all along, when the blocks are a Python
        loop). Likewise the shards get ``+ 0`` computed from the unit's input in the forward pass (``_after``).
        The forward pass is ``jax.vjp`` of the checkpoint less the value-preserving roundings it puts on each
        saved value (``_vjp_unrounded``). ``policy``: an activation-checkpointing unit's, in place of ``_saved``; then
        the saved values shaped like the unit's inputs get the ``+ 0`` too, or what it recomputes from its input
        alone (a norm's statistics) runs at the end of the forward pass, every unit's at once (Llama 3 8B
        fsdp=8,tp=8 ac=full: 5.4 GiB a layer, 1.39 after)."""
        if not self.reshard_after_forward:
            return run(shards, arrays)
        shards = _after(hooks, shards, arrays)
        kinds = {(tuple(np.shape(x)), jnp.dtype(x.dtype)) for x in shards}
        if policy is not None:  # checkpointed: what is recomputed from the unit's inputs alone waits too
            kinds |= _input_kinds(arrays)
        # the re-gather cannot run (or merge) before the cotangent
        return _tied(hooks, jax.checkpoint(run, policy=policy or _saved(hooks.fsdp)), shards, arrays, kinds, REGATHER)


def _input_kinds(arrays: Any) -> set:
    """The ``(shape, dtype)`` of a unit's floating array inputs."""
    return {(tuple(np.shape(x)), jnp.dtype(x.dtype)) for x in jax.tree.leaves(arrays)
            if jnp.issubdtype(x.dtype, jnp.floating)}


def _tied_checkpoint(hooks, f: Callable, policy: Callable, full: list, arrays: list) -> Any:
    """``jax.checkpoint(f, policy=policy)(full, arrays)`` (a keeping unit's activation checkpointing) whose
    backward pass cannot start before the unit's cotangent: the saved values shaped like the unit's array inputs
    get ``+ 0`` computed from the cotangent, as a re-gathering unit's shards do (``_tied``).
    Without it the recomputation's inputs are ready at the end of the forward pass and XLA (XLA:CPU's scheduler,
    whose compile the planner reads) runs it there, before the loss's backward pass: every block's recomputed
    activations were live at once, and a checkpointed keeping step peaked as the uncheckpointed one (Llama 3 8B,
    dp=8,fsdp=8 keep: 158.6 GiB under every policy)."""
    return _tied(hooks, jax.checkpoint(f, policy=policy), full, arrays, _input_kinds(arrays))


def _tied(hooks, ckpt: Callable, first: list, arrays: list, kinds: set, scope: str | None = None) -> Any:
    """``ckpt(first, arrays)`` (a ``jax.checkpoint``-ed function) whose backward pass cannot run before the
    cotangent: the saved values whose ``(shape, dtype)`` is in ``kinds`` get ``+ 0`` computed from it
    (``_plus_zero``), under the named scope ``scope``. Its forward pass is ``_vjp_unrounded``'s."""

    @jax.custom_vjp
    def unit(first, arrays):
        return ckpt(first, arrays)

    def fwd(first, arrays):
        return _vjp_unrounded(ckpt, first, arrays)

    def bwd(res, ct):
        leaves, treedef = jax.tree_util.tree_flatten(res)
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            return jax.tree_util.tree_unflatten(treedef, _plus_zero(leaves, _zero_from(hooks, ct), kinds))(ct)

    unit.defvjp(fwd, bwd)
    return unit(first, arrays)


def _vjp_unrounded(f: Callable, *args) -> tuple:
    """``jax.vjp(f, *args)`` of a ``jax.checkpoint``-ed ``f`` without the ``reduce_precision`` its partial
    evaluation puts on every value the backward pass keeps (``jax._src.ad_checkpoint._insert_reduce_precision``,
    against a low-precision value held in excess precision in the forward pass and recomputed rounded in the
    backward one). To a float32 or float64 value the bits of its own type change nothing, but XLA:CPU keeps the
    op: a re-gathering unit keeps every value, and each got one, some as a pass of their own over an
    attention-sized array (the zoo's Llama at fsdp=8: 244 ``reduce-precision``, 8 of them unfused, 12.7 MB a
    step of the 647 MB its ``cost_analysis`` reads; GSPMD's step, with no checkpoint, has none). Those are
    dropped; a narrower type's are kept. The vjp is traced once, its eqns replayed without them
    (``_drop_exact_roundings``)."""
    flat, tree = jax.tree_util.tree_flatten(args)
    out_tree: list = []

    def flat_vjp(*xs):
        out, pull = jax.vjp(f, *jax.tree_util.tree_unflatten(tree, list(xs)))
        leaves, t = jax.tree_util.tree_flatten((out, pull))  # pull: a Partial, its leaves the saved values
        out_tree.append(t)
        return leaves

    closed = jax.make_jaxpr(flat_vjp)(*flat)
    outs = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(_drop_exact_roundings(closed.jaxpr), closed.consts))(*flat)
    return jax.tree_util.tree_unflatten(out_tree[0], outs)


def _drop_exact_roundings(jaxpr):
    """``jaxpr`` less its ``reduce_precision`` eqns that round a float32 / float64 value to its own type's bits
    (the identity), each use of their output reading their input."""
    same: dict = {}

    def read(v):
        return same.get(v, v) if isinstance(v, jcore.Var) else v

    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "reduce_precision":
            dt = e.invars[0].aval.dtype
            if dt in (np.dtype(np.float32), np.dtype(np.float64)):
                fi = jnp.finfo(dt)
                if e.params["exponent_bits"] >= fi.nexp and e.params["mantissa_bits"] >= fi.nmant:
                    same[e.outvars[0]] = read(e.invars[0])
                    continue
        eqns.append(e.replace(invars=[read(v) for v in e.invars]) if same else e)
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars]) if same else jaxpr


def _after(hooks, shards: list, arrays: Sequence[Any]) -> list:
    """``shards`` plus a 0 computed from the unit's input (no gradient through it): the unit's all-gathers
    then cannot run before its input exists. Without it XLA schedules every unit's forward gather at the
    start of the step, and a re-gathering layout holds all the gathered parameters at once, as if it kept
    them."""
    return _plus_zero(shards, _zero_from(hooks, jax.lax.stop_gradient(list(arrays))))


def _zero_from(hooks, source: Any) -> Any:
    """A scalar 0 computed from ``source``'s first non-empty floating leaf (None: it has none), with no
    collective. A sum, not an element: the leaf may be cut over tp, and one element would be gathered.
    Where the plan cuts the activations on a dim over tp, the leaf is first narrowed to that dim (index 0
    elsewhere: on each device's own block) and summed in a region manual over tp, so each device sums its
    own part; a sum in global view would be an all-reduce over tp, one per unit and pass."""
    x = next((a for a in jax.tree.leaves(source) if jnp.issubdtype(a.dtype, jnp.floating) and a.size), None)
    if x is None:
        return None
    d, n_tp = hooks.act_cut, hooks.layouts.n_tp
    if d is None or n_tp < 2 or x.ndim <= d or x.shape[d] % n_tp:
        return jnp.sum(x * 0)
    line = x[tuple(slice(None) if i == d else 0 for i in range(x.ndim))]
    tp = hooks.layouts.tp
    return jax.shard_map(lambda v: jnp.sum(v * 0), mesh=hooks.layouts.region_mesh(), in_specs=P(tp), out_specs=P(),
                         axis_names={tp}, check_vma=False)(line)


def _plus_zero(leaves: list, zero: Any, kinds: set | None = None) -> list:
    """``leaves`` plus ``zero`` (a scalar; None: ``leaves`` unchanged), added to the floating leaves, or to those
    whose ``(shape, dtype)`` is in ``kinds``."""
    if zero is None:
        return list(leaves)

    def tied(x) -> bool:
        return jnp.issubdtype(x.dtype, jnp.floating) if kinds is None else (tuple(np.shape(x)),
                                                                             jnp.dtype(x.dtype)) in kinds

    return [x + zero.astype(x.dtype) if tied(x) else x for x in leaves]
