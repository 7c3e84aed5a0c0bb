"""The parameter placement plan: data saying where every parameter lives.

``plan_params(params, mesh, rules)`` maps each parameter path to one placement
per mesh dim: the first rule whose pattern matches the path decides the mesh
dims it names; the others take the default, ``fully_shard``'s ``Shard(0)`` on
the fsdp dim (``Replicate`` for 0-d parameters, which have no dim to cut) and
``Replicate`` elsewhere. Shards are uneven like ``torch.chunk``; a device
stores its block padded to the chunk size. Parameters are grouped into
*units*, torch's ``fully_shard(module)`` granularity: the unit's parameters
are all-gathered before it runs, their gradients reduce-scattered, one
collective per buffer (:func:`gather_buffers`: each matrix alone, the
vectors together).

The plan prints as a table (path, global shape, placements, local shape,
bytes per device) and says what a train step communicates
(:meth:`ParamPlan.communication`), before anything runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from placements import Placement, Replicate, Shard, format_placements, padded_local_shape
from spmd._mesh import DeviceMesh
from spmd.parallel.plan._rules import Rule

__all__ = ["PlanEntry", "ParamPlan", "plan_params", "path_str", "gather_buffers", "ROOT"]

ROOT = "root"


def path_str(path: tuple) -> str:
    """``(DictKey('block_0'), DictKey('fc'), ...)`` -> ``"block_0/fc/..."``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclass(frozen=True)
class PlanEntry:
    """One parameter: where it lives and what a device stores."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[Placement, ...]
    local_shape: tuple[int, ...]  # padded to the chunk size: what every device stores
    unit: str
    rule: str  # the rule that placed it, or "default"
    stacked: tuple[str, int] | None = None  # (the nn.scan module, the layer axis) it is stacked along: never cut

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def local_nbytes(self) -> int:
        return math.prod(self.local_shape) * self.itemsize

    def shard_dim(self, mesh_dim: int) -> int | None:
        p = self.placements[mesh_dim]
        return p.dim if isinstance(p, Shard) else None


def gather_buffers(entries: Sequence[PlanEntry], fsdp_index: int) -> tuple[tuple[int, ...], ...]:
    """How a unit's parameters travel over the fsdp dim: index tuples into ``entries``, one per
    all-gather (and per reduce-scatter of the gradients), in first-seen order.

    Each sharded parameter of two or more dims is a buffer of its own (no copy in or out); the
    sharded vectors (1-D: biases, norm scales) of one dtype share one flat buffer. Parameters
    replicated on the fsdp dim are in none.
    """
    out: list[list[int]] = []
    flat: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        if e.shard_dim(fsdp_index) is None:
            continue
        if len(e.shape) == 1:
            if e.dtype not in flat:
                flat[e.dtype] = []
                out.append(flat[e.dtype])
            flat[e.dtype].append(i)
        else:
            out.append([i])
    return tuple(tuple(b) for b in out)


@dataclass(frozen=True)
class ParamPlan:
    """Placements of every parameter on a mesh: ``entries`` in pytree-leaf order."""

    mesh_dim_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    fsdp: str
    entries: tuple[PlanEntry, ...]
    units: tuple[str, ...]  # gather units, in first-use order of the leaves
    treedef: Any  # the parameters' jax PyTreeDef (immutable)
    keep: tuple[str, ...] = (ROOT,)  # regexes of the units gathered once and held for the backward pass
    # the 2-D parameters whose gradient is a dot's output transposed, read off the model's backward pass when the
    # plan was built with example inputs (fsdp cuts them on dim 1 where it can; the step gathers them
    # transposed); None: not read (the step reads its own backward pass once instead)
    out_cut: tuple[str, ...] | None = None

    @property
    def scans(self) -> tuple[tuple[str, int], ...]:
        """``(module path, length)`` of each ``nn.scan`` over stacked parameters."""
        return tuple(sorted({(e.stacked[0], e.shape[e.stacked[1]]) for e in self.entries if e.stacked}))

    # --- lookup -------------------------------------------------------------------------
    def entry(self, path: str) -> PlanEntry:
        for e in self.entries:
            if e.path == path:
                return e
        raise KeyError(f"ParamPlan.entry: no parameter {path!r}; the plan holds {[e.path for e in self.entries]}.")

    def unit_entries(self, unit: str) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.unit == unit)

    def gather_buffers(self, entries: Sequence[PlanEntry]) -> tuple[tuple[PlanEntry, ...], ...]:
        """``entries`` grouped as they travel over the fsdp dim, one group per all-gather
        (see the module function :func:`gather_buffers`); none without an fsdp dim."""
        if self.fsdp not in self.mesh_dim_names:
            return ()
        fi = self.mesh_dim_names.index(self.fsdp)
        return tuple(tuple(entries[i] for i in b) for b in gather_buffers(entries, fi))

    def mesh_size(self, name: str) -> int:
        return dict(zip(self.mesh_dim_names, self.mesh_shape)).get(name, 1)

    def placements_tree(self) -> Any:
        """The parameters' pytree with each leaf's placement list (``@spmd``'s in_placements)."""
        return jax.tree_util.tree_unflatten(self.treedef, [list(e.placements) for e in self.entries])

    def padded_shape(self, e: PlanEntry) -> tuple[int, ...]:
        """The global shape of ``e`` as stored: each device's padded block times the shards per dim."""
        shape = list(e.local_shape)
        for size, p in zip(self.mesh_shape, e.placements):
            if isinstance(p, Shard):
                shape[p.dim] *= size
        return tuple(shape)

    def check_params(self, params: Any, where: str, *, sharded: bool = False) -> None:
        """Refuse parameters the plan was not built for (other paths or shapes); ``sharded``:
        ``params`` are stored by this plan (padded shapes)."""
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        got = [(path_str(p), tuple(np.shape(x))) for p, x in leaves]
        want = [(e.path, self.padded_shape(e) if sharded else e.shape) for e in self.entries]
        if got != want:
            diff = sorted(set(got) ^ set(want), key=str)[:4]
            what = "sharded parameters (padded shapes)" if sharded else "parameters"
            raise ValueError(
                f"{where}: the {what} do not match the plan (first differences, path and shape: {diff}); build "
                "the plan from these parameters with plan_params(params, mesh, rules), and the state with "
                "shard_train_state(state, plan, mesh, optimizer)."
            )

    # --- sizes --------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def bytes_per_device(self) -> int:
        return sum(e.local_nbytes for e in self.entries)

    def gathered_bytes(self, unit: str) -> int:
        """Bytes of ``unit``'s parameters once all-gathered over fsdp (padded chunks)."""
        i = self.mesh_dim_names.index(self.fsdp) if self.fsdp in self.mesh_dim_names else None
        if i is None:
            return 0
        n = self.mesh_shape[i]
        return sum(e.local_nbytes * n for e in self.unit_entries(unit) if e.shard_dim(i) is not None)

    def replicated_bytes(self, unit: str | None = None) -> int:
        """Bytes of parameters kept whole on the fsdp dim (their gradients are all-reduced)."""
        i = self.mesh_dim_names.index(self.fsdp) if self.fsdp in self.mesh_dim_names else None
        return sum(e.local_nbytes for e in self.entries
                   if (unit is None or e.unit == unit) and (i is None or e.shard_dim(i) is None))

    # --- communication ------------------------------------------------------------------
    def communication(self, *, dp: str | None = "dp", regather: bool = True, keep: Sequence[str] | None = None,
                      accum_steps: int = 1) -> dict:
        """What one train step communicates, per device (the nccl-tests byte convention of
        ``spmd.collectives``): ``{"units": [row, ...], "total": {kind: {"count", "bytes"}}}``.

        Per unit, for each of its buffers (:meth:`gather_buffers`: each
        sharded parameter of 2+ dims, and one flat buffer of its sharded
        vectors per dtype): one all-gather before the unit runs in the forward
        pass, one more before its backward pass when ``regather`` (not for the
        units matching a ``keep`` regex, gathered once and held like torch's
        root module (default: the plan's ``keep``), nor with
        ``accum_steps > 1``, which holds every unit's gathered parameters
        across the micro-batches), and one reduce-scatter of its gradient.
        With a ``dp`` dim: one all-reduce of all sharded gradient bytes.
        Parameters replicated on fsdp: one all-reduce of their gradients over
        the data-parallel dims. Scalars (loss, metrics, norms) are not
        counted here.
        """
        keep = self.keep if keep is None else tuple(keep)
        rows = []
        total = {k: {"count": 0, "bytes": 0} for k in ("all-gather", "reduce-scatter", "all-reduce")}

        def add(kind: str, nbytes: int, count: int = 1) -> None:
            if nbytes:
                total[kind]["count"] += count
                total[kind]["bytes"] += count * nbytes

        n_dp = self.mesh_size(dp) if dp else 1
        n_fsdp = self.mesh_size(self.fsdp)
        for u in self.units:
            bufs = [sum(e.local_nbytes * n_fsdp for e in b) for b in self.gather_buffers(self.unit_entries(u))]
            held = any(re.fullmatch(k, u) for k in keep)
            passes = 1 if (not regather or held or accum_steps > 1) else 2
            for nbytes in bufs:
                add("all-gather", nbytes, passes)
                add("reduce-scatter", nbytes)
            rows.append({"unit": u, "all-gather": passes * len(bufs), "gathered_bytes": self.gathered_bytes(u),
                         "reduce-scatter": len(bufs)})
        shard_bytes = sum(self.gathered_bytes(u) for u in self.units) // max(self.mesh_size(self.fsdp), 1)
        if n_dp > 1:
            add("all-reduce", shard_bytes)
        if self.mesh_size(self.fsdp) * n_dp > 1:
            add("all-reduce", self.replicated_bytes())
        return {"units": rows, "total": total}

    def peak_gathered_bytes(self, *, regather: bool = True, keep: Sequence[str] | None = None,
                            accum_steps: int = 1) -> int:
        """The most gathered parameter bytes alive at once: the kept units plus the largest
        other unit when re-gathering per block, else every unit (held for the backward pass)."""
        keep = self.keep if keep is None else tuple(keep)
        held = [any(re.fullmatch(k, u) for k in keep) for u in self.units]
        kept = sum(self.gathered_bytes(u) for u, h in zip(self.units, held) if h)
        others = [self.gathered_bytes(u) for u, h in zip(self.units, held) if not h]
        if regather and accum_steps == 1:
            return kept + max(others, default=0)
        return kept + sum(others)

    # --- printing -----------------------------------------------------------------------
    def table(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        head = ("path", "global shape", "placements", "local shape", "bytes/device", "unit", "rule")
        rows = [(e.path, str(e.shape), format_placements(e.placements), str(e.local_shape), f"{e.local_nbytes:,}",
                 e.unit, e.rule) for e in self.entries]
        rows.append(("total", "", "", "", f"{self.bytes_per_device:,}", "", f"of {self.total_bytes:,} ({mesh})"))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        lines = [f"ParamPlan on mesh ({mesh}), fsdp dim {self.fsdp!r}", fmt(head), fmt(tuple("-" * w for w in widths))]
        lines += [fmt(r) for r in rows]
        comm = self.communication()
        lines.append("communication per step (per device): " + ", ".join(
            f"{k} x{v['count']} = {v['bytes']:,} B" for k, v in comm["total"].items()))
        lines += [f"  {r['unit']}: {r['gathered_bytes']:,} B gathered in {r['reduce-scatter']} "
                  f"buffer{'' if r['reduce-scatter'] == 1 else 's'}: "
                  f"all-gather x{r['all-gather']}, reduce-scatter x{r['reduce-scatter']}" for r in comm["units"]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --- building -----------------------------------------------------------------------------
def _mesh_dims(mesh: Any, where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if isinstance(mesh, DeviceMesh):
        return tuple(mesh.mesh_dim_names), tuple(mesh.shape)
    if isinstance(mesh, Mapping) and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                         and v >= 1 for k, v in mesh.items()) and mesh:
        return tuple(mesh), tuple(mesh.values())  # a mesh described by its dims (e.g. a saved run's)
    raise TypeError(
        f"{where}: mesh={mesh!r} must be a spmd.DeviceMesh (e.g. init_device_mesh('cpu', (8,), "
        "mesh_dim_names=('fsdp',))) or a dict of mesh dim sizes such as {'dp': 2, 'fsdp': 4}."
    )


def _default(is_fsdp: bool, gshape: tuple[int, ...], rule: Rule | None, stacked: int | None = None) -> Placement:
    """``Shard(0)`` on the fsdp dim; when the rule cuts dim 0 on another mesh dim (tensor parallel's row-wise
    and vocab cuts), the first dim no other mesh dim cuts (``Replicate`` if none): each device's block stays
    one contiguous block of the other dim's shard, which an fsdp all-gather makes whole."""
    if not is_fsdp or not gshape:
        return Replicate()
    taken = {p.dim % len(gshape) for _, p in (rule.placements if rule else ()) if isinstance(p, Shard)} | {stacked}
    return next((Shard(d) for d in range(len(gshape)) if d not in taken), Replicate())


def _unit_of(path: str, units: tuple[str, ...]) -> str:
    """The longest proper prefix of ``path`` (``"/"``-joined components) that a unit regex matches in full."""
    comps = path.split("/")
    for i in range(len(comps) - 1, 0, -1):
        prefix = "/".join(comps[:i])
        if any(re.fullmatch(pat, prefix) for pat in units):
            return prefix
    return ROOT


def plan_params(
    params: Any,
    mesh: DeviceMesh | Mapping[str, int],
    rules: Sequence[Rule] = (),
    *,
    fsdp: str = "fsdp",
    units: Sequence[str] = (),
    keep: Sequence[str] = (ROOT,),
    stacked: Mapping[str, tuple[str, int]] | None = None,
) -> ParamPlan:
    """Place every leaf of ``params`` (arrays or ``jax.ShapeDtypeStruct``) on ``mesh``.

    ``rules``: first match wins, per parameter; every rule must match some
    parameter path (a rule that only ever loses to an earlier one is allowed).
    ``fsdp``: the mesh dim that ``fully_shard``'s default cuts (a mesh without
    it keeps every parameter ``Replicate``: plain DDP).
    ``units``: regexes over the first path component; each matching
    component (``block_0``, ``block_1``, ...) is a gather unit, everything
    else belongs to the ``"root"`` unit. ``keep``: regexes of the units whose
    gathered parameters are held for the backward pass rather than gathered
    again (torch keeps the root). ``stacked``: ``{path: (scan module, axis)}``
    of the parameters ``nn.scan`` stacks (``spmd.parallel.plan._scan.find_stacked``).
    """
    where = "plan_params"
    names, shape = _mesh_dims(mesh, where)
    if not isinstance(fsdp, str):
        raise TypeError(f"{where}: fsdp={fsdp!r} must be a mesh dim name (str), e.g. 'fsdp'.")
    rules = tuple(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise TypeError(
                f"{where}: rules[{i}]={r!r} must be a spmd.parallel.Rule (or fully_shard(...), replicate(...)).")
        for dim, _ in r.placements:
            if dim not in names:
                raise ValueError(
                    f"{where}: rules[{i}] ({r}) places mesh dim {dim!r}, which the mesh {dict(zip(names, shape))} "
                    f"lacks; use one of {names} or build a mesh with a {dim!r} dim."
                )
    if isinstance(units, str) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"{where}: units={units!r} must be a sequence of regex strings, e.g. (r'block_\\d+',).")
    units = tuple(units)
    if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
        raise TypeError(f"{where}: keep={keep!r} must be a sequence of regex strings, e.g. ('root',).")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves:
        raise ValueError(f"{where}: params={params!r} holds no arrays; pass the model's parameter pytree.")
    used = [False] * len(rules)
    entries = []
    order: list[str] = []
    for kp, x in leaves:
        path = path_str(kp)
        gshape = tuple(int(d) for d in np.shape(x))
        dtype = np.dtype(getattr(x, "dtype", np.float32)).name
        rule_i = next((i for i, r in enumerate(rules) if r.matches(path)), None)
        scan = (stacked or {}).get(path)
        plist: list[Placement] = []
        for dim in names:
            p = rules[rule_i].placement_for(dim) if rule_i is not None else None
            if p is None:
                p = _default(dim == fsdp, gshape, rules[rule_i] if rule_i is not None else None,
                             scan and scan[1])
            if isinstance(p, Shard) and not -len(gshape) <= p.dim < len(gshape):
                src = f"rules[{rule_i}] ({rules[rule_i]})" if rule_i is not None else "the default"
                raise ValueError(
                    f"{where}: {src} puts {p!r} on mesh dim {dim!r} for parameter {path!r} of shape {gshape}, "
                    f"which has no dim {p.dim}; use a dim in [{-len(gshape)}, {len(gshape) - 1}] or a rule that "
                    "keeps it Replicate()."
                )
            if isinstance(p, Shard) and p.dim < 0:
                p = Shard(p.dim + len(gshape))
            plist.append(p)
        for i, r in enumerate(rules):
            used[i] = used[i] or r.matches(path)
        unit = _unit_of(path, units)
        if unit not in order:
            order.append(unit)
        entries.append(PlanEntry(path, gshape, dtype, tuple(plist), padded_local_shape(gshape, shape, plist), unit,
                                 rules[rule_i].name if rule_i is not None else "default", scan))
    for i, ok in enumerate(used):
        if not ok:
            raise ValueError(
                f"{where}: rules[{i}] ({rules[i]}) matches no parameter; the paths look like "
                f"{[e.path for e in entries[:3]]}: fix the pattern or drop the rule."
            )
    return ParamPlan(names, shape, fsdp, tuple(entries), tuple(order), treedef, tuple(keep))
