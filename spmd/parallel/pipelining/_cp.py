"""cp under a pipeline: the sequence cut over ``cp`` inside the stages (``spmd.parallel.pipelining._step``).

- **a recognized attention call** (``jax.nn.dot_product_attention``, flax's) runs as the ring, as in the plain step
  (``ring_blocker``: where the units of different kinds make the same attention calls, without ep; tp in the stages
  runs it manual over tp too, each device its heads). A stage runs inside a per-rank
  ``lax.switch`` branch, and XLA:CPU meets the devices of every collective-permute of the program in the order
  each device runs them, whatever op each runs (every one has ``channel_id=1``; its rendezvous waits for every
  device of the program): a ring in one pp rank's branch would wait on the pp ranks in other branches (idle, or
  the last stage's forward, which runs nothing) and hang. So where a unit holds a ring (``unit_rings``), the
  branches without one run the same chunk on a block of their own and keep nothing of it (``shadow``): every
  device runs the same collective-permutes in the same order, each moving within its own cp group (the cp ranks
  of one pp rank, always in the same branch). Elsewhere the call runs as the all-gather of K/V
  (``ContextCalls(ring=False)``; an all-gather meets its cp group only), the reason printed in the plan;
- **a model's own attention** (an einsum over the whole sequence inside a unit, linen or nnx:
  ``models.Transformer``'s ``attn``; an nnx unit's merged copy has its submodules hooked, ``_NnxRoute``) is found
  in one unit's trace (``unit_gathered``: its ``[.., T, T]`` scores under the scope of the innermost submodule
  taking the sequence) and that submodule runs on the sequence gathered over cp, as the plain step runs it
  (``ContextCalls.around``, routed here by ``routed``: a unit runs on its own, outside the step's
  hooks): its input gathered forward, its output's cotangent gathered backward, its parameters' gradients whole on
  every device of cp. Left to GSPMD it gathered K and V at both einsums of every forward and recompute and
  all-reduced their gradients (pp=2, cp=2: 17 all-gathers, 29,952 B, against 9 here, 14,336 B).

``context_records`` traces one unit and the pre-unit code for the table (``_comm.cp_terms``).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.context._calls import CALL_SCOPE, ContextCalls, scopes_of, seq_len

__all__ = ["context_records", "gathered_context", "kinds_alike", "ring_blocker", "routed", "slot_bodies",
           "stage_context", "uncounted", "unit_gathered", "unit_rings"]


class _UnitCall:
    """A linen module call inside a unit, as ``ContextCalls.around`` reads it: ``fqn`` its path in the unit (dotted),
    ``args`` / ``kwargs``, ``params()`` its parameters by their path in the unit (``StageLayout.rel``'s form)."""

    method = "__call__"

    def __init__(self, mod, next_fun, args, kwargs):
        self.mod, self.next_fun, self.args, self.kwargs = mod, next_fun, args, kwargs
        self.fqn = ".".join(str(p) for p in mod.scope.path)

    def params(self) -> list:
        base = "/".join(str(p) for p in self.mod.scope.path)
        own = jax.tree_util.tree_leaves_with_path(self.mod.variables.get("params", {}))
        return [(base + "/" + "/".join(str(getattr(k, "key", k)) for k in path), v) for path, v in own]


class _NnxUnitCall:
    """An nnx submodule call inside a unit (a merged copy's, ``UnitCalls._apply``), as ``ContextCalls.around``
    reads it: ``fqn`` its dotted path in the unit, ``params()`` its parameters by their path in ``names`` (the
    unit's ``StageLayout.rel``, or the code around the units' ``StageLayout.rest``)."""

    method = "__call__"

    def __init__(self, fqn: str, sub, orig, args, kwargs, names):
        self.fqn, self.sub, self.orig, self.args, self.kwargs, self.names = fqn, sub, orig, args, kwargs, names

    def params(self) -> list:
        from spmd.parallel.styles._nnx import nnx_unit_params

        base = self.fqn.replace(".", "/")
        out = []
        for rel, v in nnx_unit_params(self.sub):
            p = f"{base}/{rel}"
            out.append((p + "/value" if p + "/value" in self.names else p, v[...]))
        return out


class _NnxRoute:
    """The hooks (``spmd.parallel.styles._nnx.hook_submodules``' protocol: ``prefix``, ``nnx_call``) routing an nnx
    unit's submodule calls through ``calls.around``, as ``routed`` does linen's with ``nn.intercept_methods``."""

    prefix = ()

    def __init__(self, calls: ContextCalls, names):
        self.calls, self.names = calls, set(names)

    def nnx_call(self, fqn, sub, orig, args, kwargs):
        out = self.calls.around(_NnxUnitCall(fqn, sub, orig, args, kwargs, self.names),
                                lambda c: c.orig(c.sub, *c.args, **c.kwargs))
        return orig(sub, *args, **kwargs) if out is NotImplemented else out


class _StagedNnxCall(_NnxUnitCall):
    """A stage hooks' nnx call (``spmd.parallel.styles._hooks.NnxCall``, named by the unit it runs as,
    ``StageHooks.unit``) as ``ContextCalls.around`` reads it: named by its path in the unit."""

    def __init__(self, call, fqn: str, base: str, names):
        super().__init__(fqn, call.sub, call.orig, call.args, call.kwargs, names)
        self.call, self.base = call, base

    def params(self) -> list:
        return [(p[len(self.base) + 1:], v) for p, v in self.call.params()]


class _StageRoute:
    """``Hooks.around`` of a tp or ep stage's hooks under cp: an nnx unit's submodule calls (named by the unit it runs
    as) through ``calls.around`` by their path in the unit, a module of ``calls.gathered`` on the sequence gathered
    over cp with its styles inside (an MoE's ``ExpertParallel`` on the whole sequence's buffers); the calls outside
    a unit as they are. Reads as ``calls`` otherwise."""

    def __init__(self, calls: ContextCalls, hooks, names):
        self.calls, self.hooks, self.names = calls, hooks, set(names)

    def __getattr__(self, name):
        return getattr(self.calls, name)

    def experts_dim(self, x, keep) -> None:
        """No experts cut over cp inside a stage's gathered module (``ContextCalls.experts_dim``): each device of cp
        runs them on the whole sequence's buffers. (Cut, the pipelined zoo MoE's forward differed from one device's
        at pp=2 x cp=2 x ep=2: a first loss of 3.9187 against 3.7991.)"""
        return None

    def around(self, call, run):
        base = ".".join(self.hooks.prefix)
        if not base or not call.fqn.startswith(base + ".") or not hasattr(call, "sub"):
            return NotImplemented

        def go(c):
            call.args, call.kwargs = c.args, c.kwargs
            return run(call)

        return self.calls.around(_StagedNnxCall(call, call.fqn[len(base) + 1:], base.replace(".", "/"), self.names),
                                 go)


@contextlib.contextmanager
def routed(calls: ContextCalls | None, lay=None):
    """A unit's submodule calls through ``calls.around`` (a module of ``calls.gathered`` on the sequence gathered
    over cp, the others as they are, each under its scope); nothing without ``calls``. Linen: intercepted
    (``nn.intercept_methods``); nnx (``lay`` an nnx model's layout): the unit's merged copy hooked
    (``UnitCalls._apply`` hooks the installed hooks' submodules); under tp or ep, whose hooks these are, through
    their ``around`` (``_StageRoute``, and their ``context``: a tp style inside a gathered module takes the whole
    sequence)."""
    if calls is None:
        yield
        return
    if lay is not None and lay.calls.kind == "nnx":
        from spmd.parallel.styles._nnx import installed_hooks, installing

        hooks = installed_hooks()
        if hooks is not None and hasattr(hooks, "around"):  # a tp / ep stage's hooks: their calls routed
            saved = hooks.around, getattr(hooks, "context", None)
            hooks.around = _StageRoute(calls, hooks, lay.rel).around
            hooks.context = calls
            try:
                yield
            finally:
                hooks.around, hooks.context = saved
            return
        if hooks is not None:
            yield
            return
        with installing(_NnxRoute(calls, lay.rel)):
            yield
        return
    import flax.linen as nn

    def icpt(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or getattr(mod, "scope", None) is None or not mod.scope.path:
            return next_fun(*args, **kwargs)
        out = calls.around(_UnitCall(mod, next_fun, args, kwargs), lambda c: c.next_fun(*c.args, **c.kwargs))
        return next_fun(*args, **kwargs) if out is NotImplemented else out

    with nn.intercept_methods(icpt):
        yield


def unit_gathered(pm, lay, t: int) -> frozenset:
    """The submodules of a unit (linen or nnx) that compute a product over the whole sequence of ``t`` positions
    (a model's own einsum attention, not an intercepted call): for each, the innermost submodule taking the
    ``[batch, seq, ...]`` sequence, read from one unit's trace (``spmd.parallel.step._heads.whole_sequence_products``),
    once per layout, sequence length and shapes (``StageLayout.traced``); an nnx unit of tp or ep stages traced
    with their hooks (``_StageRoute``); empty for a linen unit under tp."""
    if (pm.tp is not None and lay.calls.kind != "nnx") or lay.scanned:
        return frozenset()
    return lay.traced(("cp gathered", *_trace_key(pm, lay, t)), lambda: _find_gathered(pm, lay, t))


def _trace_key(pm, lay, t: int) -> tuple:
    """What one unit's trace under cp reads beyond the layout: the sequence length, the activation's and side arrays'
    shapes, the mesh dims (and sizes) of cp, tp and ep."""
    dims = tuple((d, pm.mesh.size(d)) for d in (pm.cp, pm.tp and pm.tp.tp.mesh_dim, pm.ep and pm.ep.ep.mesh_dim) if d)
    return t, lay.act, tuple(lay.calls.side_shapes), dims


def _find_gathered(pm, lay, t: int) -> frozenset:
    from spmd.parallel.step._heads import whole_sequence_products

    calls = ContextCalls(pm.mesh.jax_mesh, pm.mesh.size(pm.cp), t, pm.cp, ring=False)
    jaxpr = _unit_jaxpr(pm, lay, calls)
    found = set()
    for _, stack in whole_sequence_products(jaxpr.jaxpr, t):
        if CALL_SCOPE in stack:
            continue
        mods = [m for m in scopes_of(stack) if m and calls.seen.get(m)]
        if mods and not any(m in found for m in mods):
            found.add(mods[-1])
    return frozenset(found)


def _unit_jaxpr(pm, lay, calls: ContextCalls, route: bool = True):
    """One unit traced with ``calls`` (``route``: every submodule call through ``calls.around``); an nnx unit of tp
    or ep stages with their hooks too (``pipelining._tp``: its styled calls in their regions, the unit as a rank of
    ep runs it)."""
    from spmd.parallel.pipelining._tp import local_unit, on_ep, stage_hooks

    hooks = stage_hooks(pm, lay) if lay.calls.kind == "nnx" else None
    if hooks is None:
        unit = [lay.unit_shapes[rel] for rel in lay.rel]
        with calls.installed(), routed(calls if route else None, lay):
            return jax.make_jaxpr(lambda ls, x, sd: lay.apply_unit(ls, x, sd))(unit, lay.act, lay.calls.side_shapes)
    with hooks.installed(), hooks.unit(lay.module_of(0)), calls.installed(), routed(calls if route else None, lay):
        return jax.make_jaxpr(on_ep(pm, lambda ls, x, sd: lay.apply_unit(ls, x, sd)))(
            local_unit(pm, lay), lay.act, lay.calls.side_shapes)


def uncounted(pm, lay, t: int) -> str | None:
    """What the stages move over cp that the table's cp terms (``context_records``) leave out, said so (None:
    nothing): a unit's own attention (a product over the whole sequence, not an intercepted call) under tp
    (a linen unit's: ``unit_gathered`` is empty there, GSPMD partitions its products over the whole sequence; an
    nnx unit's runs on the gathered sequence, ``_StageRoute``, counted); under tp, the projections run whole over tp (fewer
    heads than tp, ``_tp.unit_whole_heads``), whose outputs GSPMD makes whole over cp too (measured at pp=2, cp=2,
    tp=2, Llama with 1 KV head: all-gather 62 buffers, 38,144 B, against the table's 24, 9,472 B)."""
    if not pm.cp or pm.mesh.size(pm.cp) < 2 or lay.scanned or pm.tp is None:
        return None
    from spmd.parallel.pipelining._tp import unit_whole_heads

    whole = unit_whole_heads(pm, lay)
    if whole:
        return (f"{pm.cp}={pm.mesh.size(pm.cp)} with tp in the stages: the projections run whole over tp (fewer "
                f"heads than tp: {', '.join(sorted(repr(m) for m in whole))}) are partitioned over {pm.cp!r} by "
                "GSPMD, their gathers and reductions over cp not in this table")
    own = lay.traced(("cp own attention", *_trace_key(pm, lay, t)), lambda: _find_gathered(pm, lay, t))
    own = own - unit_gathered(pm, lay, t)  # an nnx unit's: run on the gathered sequence (``_StageRoute``), counted
    if own:
        return (f"{pm.cp}={pm.mesh.size(pm.cp)} with tp in the stages: the units' own attention ("
                + ", ".join(sorted(f"{m!r}" for m in own)) + f") runs as GSPMD partitions it over {pm.cp!r}, its "
                "collectives (and the gradients' sums they change) not in this table")
    return None


def ring_blocker(pm, lay, t: int | None = None) -> str | None:
    """Why a stage's attention calls cannot run as the ring (None: they can): the branches without a ring run the
    chunk of a rank that has one (``shadow``), which holds where every device runs the same collective-permutes:
    the units of different kinds a slot holds across the ranks (a switch over the kinds in each chunk,
    ``_step._Stages.chunk``) make the same attention calls (``kinds_alike``, on a sequence of ``t`` positions,
    the activation's by default), and no ep call of the stages moves anything of its own in them. tp in the stages
    moves nothing of its own in them: the ring's region is manual over tp too (each device its heads), and a styled
    call's collectives meet its tp group only, in the same branch."""
    if pm.ep is not None:
        return "ep in the stages"
    if not kinds_alike(pm, lay, t or int(lay.act.shape[1])):
        return "units of different kinds across the stages, whose attention calls differ"
    return None


def slot_bodies(lay) -> list[int]:
    """Per slot of a chunk: how many unit kinds some rank's chunk holds there (a switch over them where > 1)."""
    kinds = lay.kind_rows
    return [len({int(k) for k in kinds[:, :, l].flat if k >= 0}) for l in range(lay.per_slot)]


def kinds_alike(pm, lay, t: int) -> bool:
    """Whether the unit kinds a slot holds across the ranks (``slot_bodies``) make the same attention calls: each
    kind's unit traced on a sequence of ``t`` positions, its calls' records (method, shapes, causal) equal to the
    first kind's, and no module of a unit run on the gathered sequence (``unit_gathered``). True where every slot
    holds one kind. Once per layout, sequence length and shapes (``StageLayout.traced``)."""
    if all(b == 1 for b in slot_bodies(lay)):
        return True
    return lay.traced(("cp kinds alike", *_trace_key(pm, lay, t)), lambda: _find_kinds_alike(pm, lay, t))


def _find_kinds_alike(pm, lay, t: int) -> bool:
    unit = [lay.unit_shapes[rel] for rel in lay.rel]
    seen = []
    for k in range(len(lay.calls.kinds)):
        calls = ContextCalls(pm.mesh.jax_mesh, pm.mesh.size(pm.cp), t, pm.cp, ring=True)
        with calls.installed():
            jax.eval_shape(lambda ls, x, sd: lay.apply_unit(ls, x, sd, kind=k), unit, lay.act, lay.calls.side_shapes)
        seen.append([{n: v for n, v in r.items() if n not in ("open", "module")} for r in calls.records])
    return all(s_ == seen[0] for s_ in seen) and not unit_gathered(pm, lay, t)


def unit_rings(pm, lay, t: int) -> bool:
    """Whether one unit, traced on a sequence of ``t`` positions, runs an attention call as the ring (once per layout,
    sequence length and shapes: ``StageLayout.traced``); False where ``ring_blocker`` says it cannot."""
    if ring_blocker(pm, lay, t) is not None:
        return False
    return lay.traced(("cp rings", *_trace_key(pm, lay, t)), lambda: _find_rings(pm, lay, t))


def _find_rings(pm, lay, t: int) -> bool:
    calls = _calls(pm, lay, t)
    unit = [lay.unit_shapes[rel] for rel in lay.rel]
    with calls.installed(), routed(calls if calls.gathered else None, lay):
        jax.eval_shape(lambda ls, x, sd: lay.apply_unit(ls, x, sd), unit, lay.act, lay.calls.side_shapes)
    return any(r.get("method", "").startswith("ring") for r in calls.records)


def _calls(pm, lay, t: int) -> ContextCalls:
    tp = pm.tp.tp.mesh_dim if pm.tp else None
    return ContextCalls(pm.mesh.jax_mesh, pm.mesh.size(pm.cp), t, pm.cp, gathered=unit_gathered(pm, lay, t),
                        tp=(tp, pm.mesh.size(tp)) if tp else None, ring=ring_blocker(pm, lay, t) is None)


@contextlib.contextmanager
def gathered_context(pm, lay, t: int):
    """A unit's calls as a stage runs them under cp (``_calls``, routed): its gathered modules on the whole sequence;
    nothing where it has none or cp is 1."""
    calls = _calls(pm, lay, t) if pm.mesh.size(pm.cp) > 1 else None
    if calls is None or not calls.gathered:
        yield
        return
    with calls.installed(), routed(calls, lay):
        yield


def stage_context(st, batch):
    """Under cp: the attention calls of the stages across the sequence cut (``ContextCalls``, the ring where
    ``ring_blocker`` allows, kept as ``st.attention``), with the units' gathered modules (``unit_gathered``);
    ``st.shadow``: whether a unit runs a ring (the branches without one run a chunk too, ``unit_rings``); nothing
    without cp."""
    pm = st.pm
    if not pm.cp or pm.mesh.size(pm.cp) < 2:
        return contextlib.nullcontext()
    t = st.seq_len or seq_len(batch)
    st.attention = _calls(pm, st.lay, t)
    st.shadow = unit_rings(pm, st.lay, t)
    return st.attention.installed()


def context_records(pm, lay, loss_fn, mb, t: int | None = None) -> dict:
    """Under cp: one unit's attention calls and gathered modules (``ContextCalls`` records,
    traced on the micro-batch's shapes), the embedding lookups of the code before the first unit (a module with one
    rank-2 parameter called on the ``[batch, seq]`` ids or the ``[seq]`` positions, linen's or nnx's: GSPMD transposes
    it by gathering the ids and its output's gradient over cp) and its position tables (``positional``: a parameter added to the sequence row by row, its
    gradient cut over cp on the rows), the unit's ``side`` parameters (computed on its side arrays, whole over cp;
    ``joins``: the bytes of each broadcast of such a value into the sequence, all-reduced over cp backward), the tied heads of the code after the last unit (``attends``: a lookup's table
    multiplied by there, that product's gradient summed over cp on the last stage), for the table's cp terms (``spmd.parallel.pipelining._comm.cp_terms``).
    ``t``: the batch's sequence length (``seq_batch_leaves``; None: the one dim-1 length of ``mb``'s leaves)."""
    import flax.linen as nn

    from spmd.parallel.step._loss_io import _split_loss
    from spmd.parallel.step._heads import dot_params, positional_params, side_params

    t = t or seq_len(mb)
    calls = _calls(pm, lay, t)
    unit = [lay.unit_shapes[rel] for rel in lay.rel]
    closed = _unit_jaxpr(pm, lay, calls, route=bool(calls.gathered))
    # the unit's parameters computed on its side arrays only (whole over cp: a [batch, d] vector's dense layer) whose
    # output joins the sequence by broadcast: their gradients whole over cp, the join's cotangent summed over cp
    ins = closed.jaxpr.invars[len(unit):]  # the unit's activation (the sequence), then its side arrays' leaves
    side, joins = side_params(closed.jaxpr, closed.jaxpr.invars[:len(unit)], ins[:1], t, ins[1:])
    lookups = []

    def lookup(x, out, own, path):  # a module with one rank-2 parameter on the [batch, seq] ids (or the [seq]
        # positions: an nnx.Embed of learned positions on jnp.arange(seq)): a lookup
        if (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer) and np.ndim(x) in (1, 2)
                and x.shape[-1] == calls.seq_len and hasattr(out, "shape")
                and tuple(out.shape[:np.ndim(x)]) == tuple(x.shape) and len(own) == 1 and np.ndim(own[0][1]) == 2):
            lookups.append({"param": path(own[0][0]),
                            "bytes": [x.size * x.dtype.itemsize, out.size * out.dtype.itemsize]})

    def note(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        mod = context.module
        own = jax.tree_util.tree_leaves_with_path(mod.variables.get("params", {})) if mod.scope is not None else []
        if context.method_name == "__call__":
            lookup(args[0] if args else None, out, own, lambda k: "/".join(str(p) for p in mod.scope.path) + "/"
                   + "/".join(str(e.key) for e in k))
        return out

    rest = {p: lay.shapes[p] for p in lay.rest}
    if lay.calls.kind == "nnx":  # the model's submodules before the units hooked (``UnitCalls._run_nnx``)
        from spmd.parallel.styles._nnx import installing, nnx_unit_params

        class _Note:
            prefix = ()

            def nnx_call(self, fqn, sub, orig, args, kwargs):
                out = orig(sub, *args, **kwargs)
                base = fqn.replace(".", "/")
                own = [(f"{base}/{r}" + ("/value" if f"{base}/{r}/value" in lay.rest else ""), v[...])
                       for r, v in nnx_unit_params(sub)]
                lookup(args[0] if args else None, out, own, lambda k: k)
                return out

        with installing(_Note()):
            jax.eval_shape(lambda r, b: lay.pre(loss_fn, r, b), rest, mb)
    else:
        with nn.intercept_methods(note):
            jax.eval_shape(lambda r, b: lay.pre(loss_fn, r, b), rest, mb)
    tail = ContextCalls(pm.mesh.jax_mesh, calls.n, t, pm.cp, ring=False)  # notes a tied head (``Embed.attend``)
    with tail.installed():
        jax.eval_shape(lambda r, b, h: lay.post(loss_fn, r, b, h), rest, mb, lay.act)
    jaxpr = jax.make_jaxpr(lambda r, b: lay.pre(loss_fn, r, b)[0])(rest, mb).jaxpr
    flat = jax.tree_util.tree_flatten_with_path(rest)[0]
    order = [path[0].key for path, _ in flat]
    # a lookup's table multiplied by after the units (a tied head: linen's or nnx's ``Embed.attend``, a dense layer
    # on the table), read from the post-unit code's gradient (``dot_params``: a product of its forward pass)
    post = jax.make_jaxpr(jax.grad(lambda r, b, h: _split_loss(lay.post(loss_fn, r, b, h), "make_train_step")[0]))(
        rest, mb, lay.act).jaxpr
    dotted = {order[i] for i in dot_params(post, post.invars[:len(order)])}
    attends = set(tail.attends) | (dotted & {r["param"] for r in lookups})
    positional = sorted(order[i] for i in positional_params(jaxpr, jaxpr.invars[:len(order)], t))
    return {"unit": list(calls.records), "shadow": unit_rings(pm, lay, t), "lookups": lookups, "positional": positional, "attends": sorted(attends),
            "side": sorted(lay.rel[i] for i in side), "joins": list(joins)}
