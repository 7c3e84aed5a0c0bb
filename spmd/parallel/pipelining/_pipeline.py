"""torch's ``pipeline`` on any flax.linen model, unchanged: its repeated blocks split into pipeline stages.

``pipeline(model, mesh["pp"], units="layers_*", num_microbatches=M, schedule="1f1b")`` returns a
``PipelineModule``; ``init_train_state`` / ``make_train_step`` / ``unshard_params`` take it like any model.

**The split.** The units are the submodules matching the ``units`` glob (``layers_*``, ``block_*``,
``model.layers.*``), in the order of their names' numbers (``layers_2`` before ``layers_10``), which must be
the order the model calls them. The model must chain them: each unit takes the previous unit's output as its
one argument and returns the next one (a decoder's blocks). ``S = pp x v`` stages (``v = stages_per_rank``,
interleaved only) take the units like ``numpy.array_split``: with ``L`` units, the first ``L % S`` stages
get ``ceil(L / S)`` units and the rest ``floor(L / S)``; a stage with one unit fewer stores a zero slot it
skips. Or explicit split points, torch's ``split_spec``: ``split_points={"layers_3": SplitPoint.BEGINNING}``
(``"beginning"``; ``SplitPoint.END``: the next stage begins after the unit) names the units where stages
begin; ``S - 1`` of them, each stage at least one unit; unequal stages store ``max(count)`` slots per stage,
the shorter ones skipping their extra zero slots (``spmd.parallel.pipelining._split``). Stage ``c`` runs on rank ``c % pp``. What the model does before the
first unit (embeddings) runs on the first stage, what it does after the last unit (final norm, head, the
user's loss) on the last stage; their parameters are replicated over ``pp`` and their gradients summed over
it (a tied embedding used by both ends is right by construction).

**The mechanism.** The loss is never split by hand: the user's ``loss_fn`` (``(params, batch)``; an nnx
model's ``(model, batch)``) runs with the unit calls intercepted (``spmd.parallel.pipelining._calls``: linen,
Hugging Face Flax models, nnx). *pre*: stop at the first unit call and return its input; *post*: every unit
call returns the injected last activation (the code before it is dead and compiled away); a stage runs its
units with their own module objects: units whose configurations (or traced programs) are equal share one
traced body, and a stage slot that holds units of several kinds (GPT-Neo's global and local blocks)
``lax.switch``-es on the rank's and chunk's kind, so no unit ever runs another's module. A unit's other
arguments (an attention mask, position ids, flags) must be the same for every unit and free of the
parameters: each stage computes them again from its micro-batch. The units' parameters are stacked
into one array per parameter, leading dim ``pp x v x ceil(L / S)`` cut ``Shard(0)`` over ``pp``, so each
rank stores its own stages only. The step (``spmd.parallel.pipelining._step``) is one ``shard_map`` manual
over every mesh dim but tp, running the schedule's tick table (``spmd.parallel.pipelining._schedules``) unrolled: each tick a
``lax.switch`` on the rank's action (idle, a chunk's forward, a chunk's backward), then one
``collective-permute`` of activations forward and one of gradients backward whose source-target pairs are
exactly the sends of that tick. Why unrolled and not a loop: the pairs of a ``ppermute`` are static, so a
loop would send every tick on every boundary (bubble ticks carry garbage); unrolled, the compiled program
moves each micro-batch across each boundary exactly once each way, which the HLO shows. The backward
recomputes its chunk's forward from the stashed chunk input (activation checkpointing per chunk), so a
rank holds one activation per live micro-batch: the schedule's slot count, its memory bound.

The other mesh dims (but tp) are data-parallel (DDP): each replica runs the pipeline on its rows of the batch and
the gradients are averaged over them. ``pipeline(fully_shard(model, mesh=mesh["fsdp"]), mesh["pp"], ...)``
also cuts each stacked stage parameter over ``fsdp`` (its largest dim that fsdp divides): a rank gathers its
stages once per step, holds them through the schedule (torch's ``reshard_after_forward=False``, the usual
choice under pipelining: a re-gather per micro-batch would multiply the traffic by M) and reduce-scatters
their gradients once; the optimizer state stays cut. The rest (embeddings, head) stays replicated.
``pipeline(parallelize_module(model, mesh["tp"], plan), mesh["pp"], ...)``: tensor-parallel stages, the
region automatic over tp and the tp hooks inside each stage (``spmd.parallel.pipelining._tp``); both
(``fully_shard(parallelize_module(...), mesh=mesh["fsdp"])``): the stages cut over fsdp and tp on two dims,
``pp x dp x fsdp x tp``. ``pipeline(parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts":
ExpertParallel()}), mesh["pp"], ...)``: the units' experts cut over ep on their experts dim (stacked: dim 1),
``ExpertParallel`` run inside every tick's stage, an expert's gradient averaged over the data dims but ep (with
tp stages too; a scanned stack's stacked experts likewise). HSDP (``fully_shard(model, mesh=mesh["dp", "fsdp"])``): the stages cut over fsdp,
their shards averaged over dp. Not offered: mixed precision, dropout rngs.

**A scanned stack.** ``units="layers"`` naming one stack under ``nn.scan`` (the layer axis at any
``variable_axes`` position, with or without ``nn.remat``) or an nnx stack created under ``nnx.vmap`` and run
under ``nnx.scan`` makes its ``L`` layers the units (``layers/0`` ... ``layers/L-1``), found by
``init_train_state``'s abstract call of the model on its example inputs. The stages are equal slices of the
layer axis (``L`` must be a multiple of ``S``; no split points), each stage a ``lax.scan`` of the layer over
its slice, so the program does not grow with the depth. The stored rows are the layers moved to the front
axis (``StageLayout.stack``); ``unstack`` and a checkpoint put the axis back where the model keeps it. The
code before the scan (``pre``) is cut out of one trace of ``loss_fn`` with the layer marked
(``spmd.parallel.pipelining._calls._ScanCut``): the scan must run the ``L`` layers once, carrying one array,
the activation; the layer's other arrays (a mask, positions) must enter the scan broadcast, and a stage
computes them again from its micro-batch as the scan's inputs. Tensor-parallel stages run the layer's styled
calls inside the stage's scan (each layer runs as the stack's module, ``StageLayout.module_of``). Each layer
runs under the checkpoints the scan's body runs it under (the user's ``nn.remat`` and its policy, read off the
same trace: ``_calls._layer_remat``), so a chunk's backward saves what the user's stack saves.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from placements import Shard
from spmd._mesh import DeviceMesh
from spmd.parallel.plan._param_plan import ParamPlan, path_str, plan_params
from spmd.parallel.pipelining._calls import UnitCalls, model_kind
from spmd.parallel.pipelining._split import SplitPoint, check_split_points, natural_key, stage_counts, unit_modules
from spmd.parallel.pipelining._state import stack_state, unstack_state
from spmd.parallel.styles._transforms import CP_DIM
from spmd.parallel.pipelining._tp import ep_placements, tp_placements, unwrap_layouts
from spmd.parallel.pipelining._step import (REST, STAGES, init_pipeline_state, make_pipeline_step,
                                            unshard_pipeline_params)
from spmd.parallel.plan._rules import Rule
from spmd.parallel.step._protocol import OwnsTrainStep
from spmd.parallel.pipelining._schedules import CHUNKED, SCHEDULES, Schedule, build_schedule
from spmd.parallel.styles._transforms import ParallelModule, Wrapped, _modules, glob_regex

__all__ = ["pipeline", "PipelineModule", "SplitPoint", "STAGES", "REST", "unit_modules"]


class PipelineModule(Wrapped, OwnsTrainStep):
    """The user's model split into pipeline stages (what ``pipeline`` returns); calls and attributes forward
    to the model. ``schedule``: the tick table (``print(model.schedule)``). An ``OwnsTrainStep``: its state,
    step and parameters' inverse are its own (``spmd.parallel.pipelining._step``)."""

    _verb = "pipelining"

    def __init__(self, module, mesh: DeviceMesh, pp: str, units: str, schedule: Schedule, unroll: bool = True,
                 fsdp: str | None = None, split_points: dict | None = None, tp: ParallelModule | None = None,
                 ep: ParallelModule | None = None):
        # _scan: (the scanned stack the units name, ((its parameter's rel path, layer axis), ...)), set by
        # init_train_state from its trace of the example inputs (None: the units are modules of their own)
        for k, v in dict(module=module, mesh=mesh, pp=pp, units=units, schedule=schedule, unroll=unroll, fsdp=fsdp,
                         split_points=split_points, tp=tp, ep=ep, _layouts={}, _checkpoints={}, _scan=None).items():
            object.__setattr__(self, k, v)

    def __repr__(self) -> str:
        s = self.schedule
        return (f"PipelineModule({type(self.module).__name__}; units {self.units!r} over {self.pp}={s.pp}, "
                f"{s.name}, M={s.num_microbatches}, v={s.stages_per_rank}" + (f"; stages fsdp on {self.fsdp!r}"
                                                                              if self.fsdp else "")
                + (f"; tp on {self.tp.tp.mesh_dim!r}" if self.tp else "")
                + (f"; experts on {self.ep.ep.mesh_dim!r}" if self.ep else "") + "; mesh "
                f"{dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))})")

    @property
    def data_dims(self) -> tuple[str, ...]:
        return tuple(n for n in self.mesh.mesh_dim_names
                     if n not in (self.pp, self.tp and self.tp.tp.mesh_dim, self.cp))

    @property
    def cp(self) -> str | None:
        """The mesh dim cutting the batch's sequence (automatic in the step's region, as tp is), or None."""
        return CP_DIM if CP_DIM in self.mesh.mesh_dim_names else None

    def layout(self, params: Any) -> "StageLayout":
        """The stage layout of ``params`` (arrays or shapes): which units, stacked how."""
        treedef = jax.tree_util.tree_structure(params)
        if treedef not in self._layouts:
            self._layouts[treedef] = StageLayout(self, params)
        return self._layouts[treedef]

    # OwnsTrainStep: init_train_state / make_train_step / unshard_params hand a pipelined model here
    def init_train_state(self, optimizer, *init_args, params=None, mesh=None):
        """Step 0: the units' parameters stacked per stage and cut over pp (``spmd.parallel.init_train_state``)."""
        return init_pipeline_state(self, optimizer, *init_args, params=params, mesh=mesh)

    def make_train_step(self, loss_fn, optimizer, *, accum_steps=1, mesh=None, check_finite=False, donate=False):
        """The pipeline's ``TrainStep`` (``spmd.parallel.make_train_step``)."""
        return make_pipeline_step(self, loss_fn, optimizer, accum_steps=accum_steps, mesh=mesh,
                                  check_finite=check_finite, donate=donate)

    def unshard_params(self, params):
        """The model's own parameter tree from a pipeline state's (``spmd.parallel.unshard_params``)."""
        return unshard_pipeline_params(self, params)

    # a checkpoint holds the model's own tree (spmd.parallel.pipelining._state)
    def unstack_state(self, state, optimizer):
        """``state`` as the model's own (unstacked) parameters and optimizer state: what a checkpoint saves."""
        return unstack_state(self, state, optimizer)

    def stack_state(self, state, optimizer):
        """The model's own state (restored from any layout) laid out for this pipeline again."""
        return stack_state(self, state, optimizer)


def _shape_key(tree: Any) -> tuple:
    """A tree's structure and its leaves' shapes and dtypes (hashable)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


class StageLayout:
    """The pipeline layout of one parameter tree: units (in call order), the stacked stage tree, the rest."""

    def __init__(self, pm: PipelineModule, params: Any):
        where = "pipeline"
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [path_str(kp) for kp, _ in leaves]
        self.shapes = {p: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for p, (_, x) in zip(self.paths, leaves)}
        found = sorted(unit_modules(self.paths, pm.units), key=natural_key)
        if not found:
            mods = sorted(_modules(self.paths))
            raise ValueError(f"{where}: units={pm.units!r} matches no module of the model; its modules are: "
                             f"{', '.join(mods[:40])}. Fix the glob (e.g. 'layers_*', 'model.layers.*').")
        s = pm.schedule
        n_st = s.num_stages
        stages_text = f"{pm.pp}={s.pp} x stages_per_rank={s.stages_per_rank}"
        self.found = found
        # a scanned stack (nn.scan / nnx.scan, found by init_train_state's trace): its layers are the units
        scan = pm._scan if pm._scan is not None and found == [pm._scan[0]] else None
        self.scanned, self.axis = (scan[0], dict(scan[1])) if scan else (None, {})
        if scan:
            stack = scan[0]
            self.rel = [p[len(stack) + 1:] for p in self.paths if p.startswith(stack + "/")]
            n = _scan_length(self, stack, n_st, pm, stages_text)
            self.units = [f"{stack}/{i}" for i in range(n)]  # the layers, named as split points would name them
            self.unit_shapes = {r: _drop(self.shapes[f"{stack}/{r}"], self.axis[r]) for r in self.rel}
            self.unit_of = {p: stack for p in self.paths if p.startswith(stack + "/")}
        else:
            if len(found) < n_st:
                raise ValueError(
                    f"{where}: units={pm.units!r} matches {len(found)} modules ({', '.join(found)}), fewer than the "
                    f"{n_st} stages ({stages_text}); use fewer stages or a deeper model (a stack under nn.scan or "
                    "nnx.scan is one module here unless init_train_state is given the example inputs the model is "
                    "called on, which reveal its layer axis: init_train_state(model, optimizer, *example_inputs, "
                    "params=params)).")
            self.units = found  # record() checks that the model calls them in this order
            rel0 = [p[len(found[0]) + 1:] for p in self.paths if p.startswith(found[0] + "/")]
            for u in found[1:]:
                rel = [p[len(u) + 1:] for p in self.paths if p.startswith(u + "/")]
                same = rel == rel0 and all(self.shapes[f"{u}/{r}"] == self.shapes[f"{found[0]}/{r}"] for r in rel)
                if not same:
                    def listing(unit, names):
                        return "{" + ", ".join(f"{r!r}: {tuple(self.shapes[f'{unit}/{r}'].shape)}" for r in names) + "}"

                    raise ValueError(f"{where}: unit {u!r} has other parameters than {found[0]!r} ({listing(u, rel)} "
                                     f"vs {listing(found[0], rel0)}); pipeline stages stack repeated blocks of one "
                                     "shape: match only those.")
            self.rel = rel0
            self.unit_shapes = {r: self.shapes[f"{found[0]}/{r}"] for r in rel0}
            self.unit_of = {p: u for p in self.paths for u in found if p.startswith(u + "/")}
            n = len(found)
        self.rest = [p for p in self.paths if p not in self.unit_of]
        counts = stage_counts(self.units, n, n_st, pm.split_points, stages_text)
        self.per_slot = max(counts)  # unit slots per stage (the even rule: ceil(L / S))
        starts = np.cumsum([0] + counts)
        self.stage_units = [list(range(starts[c], starts[c] + counts[c])) for c in range(n_st)]
        v, pp, lc = s.stages_per_rank, s.pp, self.per_slot
        # stacked row -> unit index (or -1: a skipped slot); rank-major: rank r holds its chunks j = 0..v-1
        self.rows = [-1] * (pp * v * lc)
        for c in range(n_st):
            r, j = c % pp, c // pp
            for l, u in enumerate(self.stage_units[c]):
                self.rows[r * v * lc + j * lc + l] = u
        self.valid = np.array(self.rows).reshape(pp, v, lc) >= 0
        self.fsdp, self.n_fsdp = pm.fsdp, (pm.mesh.size(pm.fsdp) if pm.fsdp else 0)
        self._pm = pm
        self.plan = self._make_plan(pm.mesh, pm.pp)
        self.calls = UnitCalls(self, pm.module)  # the unit calls of the last ``record``ed micro-batch shapes
        self._recorded: dict[tuple, UnitCalls] = {}  # ... and of each one recorded, by ``record``'s key
        # what one unit's trace shows (``traced``): by an immutable key naming the question and what was traced
        self._traced: dict[tuple, Any] = {}

    def traced(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` (hashable: the question's name, then every input its answer reads beyond
        this layout: the sequence length, the unit's activation and side arrays' shapes, the mesh dims of its
        styles), for what one unit's trace shows (``spmd.parallel.pipelining._cp.unit_gathered``, ``unit_rings``;
        ``_tp.unit_whole_heads``). The answer must be an immutable value."""
        if key not in self._traced:
            self._traced[key] = compute()
        return self._traced[key]

    # --- the stored tree ----------------------------------------------------------------------------
    def logical(self) -> Any:
        """The model's parameter tree as ``ShapeDtypeStruct`` leaves (what ``record`` traces with)."""
        return jax.tree_util.tree_unflatten(self.treedef, [self.shapes[p] for p in self.paths])

    def stored_shapes(self) -> dict:
        n = len(self.rows)
        st = {r: jax.ShapeDtypeStruct((n, *self.unit_shapes[r].shape), self.unit_shapes[r].dtype) for r in self.rel}
        return {STAGES: st, REST: {p: self.shapes[p] for p in self.rest}}

    def stack(self, params: Any) -> dict:
        flat = dict(zip(self.paths, jax.tree_util.tree_leaves(params)))
        st = {}
        if self.scanned:  # the layer axis to the front, its layers in the rows' order (every row a layer)
            for r in self.rel:
                st[r] = jnp.take(jnp.moveaxis(flat[f"{self.scanned}/{r}"], self.axis[r], 0), np.asarray(self.rows), 0)
            return {STAGES: st, REST: {p: flat[p] for p in self.rest}}
        for r in self.rel:
            proto = flat[f"{self.units[0]}/{r}"]
            st[r] = jnp.stack([flat[f"{self.units[u]}/{r}"] if u >= 0 else jnp.zeros_like(proto) for u in self.rows])
        return {STAGES: st, REST: {p: flat[p] for p in self.rest}}

    def unstack(self, stored: dict) -> Any:
        flat = dict(stored[REST])
        if self.scanned:
            order = np.argsort(self.rows)  # row of each layer
            for r in self.rel:
                flat[f"{self.scanned}/{r}"] = jnp.moveaxis(jnp.take(stored[STAGES][r], order, 0), 0, self.axis[r])
        else:
            for i, u in enumerate(self.rows):
                if u >= 0:
                    for r in self.rel:
                        flat[f"{self.units[u]}/{r}"] = stored[STAGES][r][i]
        return jax.tree_util.tree_unflatten(self.treedef, [flat[p] for p in self.paths])

    def module_of(self, unit: int) -> str:
        """The module path unit ``unit`` runs as: its own, or a scanned stack's (each layer runs as the stack)."""
        return self.scanned or self.units[unit]

    def own_param(self, rel: str, dim: int) -> tuple[str, int]:
        """The model's own parameter pattern (a regex) and dim that ``dim`` of stacked stage parameter ``rel``
        is (a unit's, or the scanned stack's: past its layer axis, one more)."""
        d = dim - 1
        if self.scanned:
            return re.escape(f"{self.scanned}/{rel}"), d + (d >= self.axis[rel])
        return "(" + "|".join(re.escape(u) for u in self.units) + ")/" + re.escape(rel), d

    def fsdp_dim(self, rel: str) -> int | None:
        """The dim of stacked stage parameter ``rel`` cut over the fsdp dim: its largest dim after the stacked
        one that the fsdp size divides and tp does not cut (None: kept whole, as a vector too short to cut)."""
        if self.n_fsdp <= 1:
            return None
        shape = self.unit_shapes[rel].shape
        tp_cut = tp_placements(self._pm, self)[0].get(rel)  # fsdp cuts another dim than tp (stacked: one later)
        ep_cut = ep_placements(self._pm, self).get(rel)  # and than the experts dim over ep
        ok = [d for d in range(len(shape)) if shape[d] % self.n_fsdp == 0
              and not any(isinstance(c, Shard) and c.dim == d + 1 for c in (tp_cut, ep_cut))]
        return 1 + max(ok, key=lambda d: shape[d]) if ok else None

    def _make_plan(self, mesh: DeviceMesh, pp: str) -> ParamPlan:
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        tps, tpr = tp_placements(self._pm, self)  # the tp cuts (spmd.parallel.pipelining._tp); none without tp
        tp = {self._pm.tp.tp.mesh_dim: None} if tps else {}
        eps = ep_placements(self._pm, self)  # a unit's experts cut over ep on their experts dim (stacked: one later)
        ep = self._pm.ep.ep.mesh_dim if self._pm.ep else None
        rules = []
        for rel in self.rel:
            d = self.fsdp_dim(rel)
            pl = {pp: Shard(0), **({self.fsdp: Shard(d)} if d is not None else {}), **{t: tps[rel] for t in tp},
                  **({ep: eps[rel]} if rel in eps else {})}
            rules.append(Rule(re.escape(f"{STAGES}/{rel}"), pl, name="pipeline stages" + (" + fully_shard" if d else "")
                              + (" + tp" if tp else "") + (" + experts" if rel in eps else "")))
        rules += [Rule(re.escape(f"{REST}/{p}"), {t: tpr[p]}, name="tp") for p in self.rest for t in tp]
        return plan_params(self.stored_shapes(), sizes, rules, fsdp="")

    def full_params(self, rest: dict) -> Any:
        """The user's parameter tree from the rest: units get zeros (never read: their calls are intercepted)."""
        leaves = [rest[p] if p in rest else jnp.zeros(self.shapes[p].shape, self.shapes[p].dtype) for p in self.paths]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def unit_tree(self, leaves: list) -> Any:
        """One unit's parameters (the first unit's subtree structure) from its leaves in ``rel`` order."""
        tree: dict = {}
        for r, x in zip(self.rel, leaves):
            node = tree
            *head, last = r.split("/")
            for h in head:
                node = node.setdefault(h, {})
            node[last] = x
        return tree

    # --- the model's calls (spmd.parallel.pipelining._calls) ------------------------------------------------
    @property
    def act(self):
        return self.calls.act

    def record(self, loss_fn, params, mb) -> None:
        """The unit calls of ``loss_fn`` on micro-batches shaped as ``mb`` made ``calls`` (their activation and side
        arrays' shapes): traced once per loss, parameter and micro-batch shapes, each kept, so that a step built
        for one batch shape and then another reads each build's own (its table, its lowering)."""
        key = (loss_fn, *(_shape_key(t) for t in (params, mb)))
        if key not in self._recorded:
            calls = UnitCalls(self, self._pm.module)
            calls.record(loss_fn, params, mb)
            self._recorded[key] = calls
        self.calls = self._recorded[key]

    def pre(self, loss_fn, rest, mb):
        """``(the first unit's input, the units' side arrays)``."""
        return self.calls.pre(loss_fn, rest, mb)

    def post(self, loss_fn, rest, mb, h):
        return self.calls.post(loss_fn, rest, mb, h)

    def apply_unit(self, leaves: list, x, side: list = (), kind: int = 0, unit=0):
        return self.calls.apply_unit(leaves, x, side, kind, unit)

    @property
    def kind_rows(self) -> np.ndarray:
        """``[pp, v, lc]``: the kind (``UnitCalls.kind_of``) of each stored unit slot, -1 for a skipped one."""
        kind_of = self.calls.kind_of
        return np.array([kind_of[u] if u >= 0 else -1 for u in self.rows]).reshape(self.valid.shape)


def _drop(x: jax.ShapeDtypeStruct, axis: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape[:axis] + x.shape[axis + 1:], x.dtype)


def _scan_length(lay: StageLayout, stack: str, n_st: int, pm: PipelineModule, stages_text: str) -> int:
    """The layer count ``L`` of scanned stack ``stack``: the stages are its slices, ``L / S`` layers each."""
    where = "pipeline"
    lengths = {lay.shapes[f"{stack}/{r}"].shape[lay.axis[r]] for r in lay.rel}
    if len(lengths) != 1:
        raise ValueError(f"{where}: the parameters of the scanned stack {stack!r} hold {sorted(lengths)} layers on "
                         "their layer axes; a stack's parameters hold one count.")
    (n,) = lengths
    if pm.split_points is not None:
        raise ValueError(f"{where}: split_points={ {k.replace('/', '.'): str(v) for k, v in pm.split_points.items()} } "
                         f"with a scanned stack ({stack!r}: {n} layers); its stages are equal slices of the layer axis "
                         "(each a scan over its slice): leave split_points out.")
    if n % n_st:
        raise ValueError(f"{where}: the scanned stack {stack!r} holds L={n} layers, which {stages_text} = {n_st} "
                         f"stages do not divide; each stage runs an equal slice of the layer axis: use a layer count "
                         f"that is a multiple of {n_st}, or pp x stages_per_rank dividing {n}.")
    return n


def pipeline(model: Any, mesh: DeviceMesh, *, units: str = "layers_*", num_microbatches: int,
             schedule: str = "1f1b", stages_per_rank: int = 1, unroll: bool = True,
             split_points: dict[str, SplitPoint | str] | None = None) -> PipelineModule:
    """Split ``model``'s ``units`` into pipeline stages over the 1-D ``mesh`` (``mesh["pp"]``); see the module doc.

    ``num_microbatches``: the per-replica batch is cut into this many micro-batches (it must divide it);
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``stages_per_rank`` chunks per rank, Megatron's
    interleaved 1F1B; ``num_microbatches`` a multiple of pp) or ``"looped_bfs"`` (``stages_per_rank`` chunks
    per rank run GPipe-like, torch's ``ScheduleLoopedBFS``). ``unroll=True``: the ticks unrolled, each
    tick's collective-permute over exactly its sends (the compiled program moves each micro-batch once per
    boundary each way); ``False``: one loop over the ticks, the sends picked per tick from the schedule's
    distinct pair sets (a program the size of one tick: faster to compile for long schedules).
    ``split_points``: ``{unit name: SplitPoint.BEGINNING | SplitPoint.END}`` where stages begin instead of the
    even split (the module doc's rule); a name that is no unit is refused with the units listed.
    """
    where = "pipeline"
    if isinstance(model, PipelineModule):
        raise ValueError(f"{where}: model={model!r} is already pipelined; pipeline the plain model once.")
    model, fsdp, tp, ep = unwrap_layouts(model, mesh, where)  # fully_shard / parallelize_module under the pipeline
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh={mesh!r} must be a spmd.DeviceMesh, the pipeline dim of the mesh (mesh['pp']).")
    if mesh.ndim != 1:
        raise ValueError(f"{where}: mesh={mesh!r} must be 1-D, the pipeline dim (mesh['pp']); the mesh has no single "
                         "pipeline dim.")
    kind = model_kind(model)
    if kind is None:
        raise TypeError(f"{where}: model={type(model).__name__} must be a flax.linen Module, a Hugging Face Flax model "
                        "or a flax.nnx Module.")
    if not isinstance(units, str) or not units:
        raise TypeError(f"{where}: units={units!r} must be one module fqn glob, e.g. 'layers_*'.")
    if schedule not in SCHEDULES:
        raise ValueError(f"{where}: schedule={schedule!r} is not offered; use one of {', '.join(SCHEDULES)}.")
    pp = mesh.shape[0]
    for arg, v in (("num_microbatches", num_microbatches), ("stages_per_rank", stages_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {arg}={v!r} must be an int >= 1.")
    if schedule not in CHUNKED and stages_per_rank != 1:
        raise ValueError(f"{where}: stages_per_rank={stages_per_rank!r} needs schedule='interleaved' or "
                         f"'looped_bfs' (got {schedule!r}); leave it 1 or use one of those.")
    if schedule != "gpipe" and num_microbatches < pp:
        raise ValueError(f"{where}: num_microbatches={num_microbatches} is below {mesh.mesh_dim_names[0]}={pp}; "
                         f"{schedule} needs at least one micro-batch per stage: use num_microbatches >= {pp}.")
    if schedule == "interleaved" and num_microbatches % pp:
        raise ValueError(f"{where}: num_microbatches={num_microbatches} is not a multiple of "
                         f"{mesh.mesh_dim_names[0]}={pp}; the interleaved schedule runs micro-batches in groups of "
                         f"pp: use {pp * -(-num_microbatches // pp)}.")
    if not isinstance(unroll, bool):
        raise TypeError(f"{where}: unroll={unroll!r} must be a bool.")
    points = check_split_points(split_points)
    sched = build_schedule(schedule, pp, num_microbatches, stages_per_rank)
    return PipelineModule(model, mesh.root_mesh, mesh.mesh_dim_names[0], units.replace(".", "/"), sched, unroll, fsdp,
                          points, tp, ep)
