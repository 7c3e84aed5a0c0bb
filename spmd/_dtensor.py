"""DTensor: a global tensor laid out over a DeviceMesh by a placement list.

Storage: one jax.Array of shape ``mesh.shape + padded_local_shape``, sharded so
that device ``(i, j, ...)`` holds exactly its own block ``[i, j, ...]``. Each
block is the rank's local tensor padded at the end of every dim to the largest
local extent (uneven torch.chunk shards); padding never leaves this module.
Replicate and Partial blocks are full-shape; Partial blocks are unreduced.

Semantics follow ``torch.distributed.tensor`` with two documented choices:
``Replicate -> Partial(sum)`` (and ``distribute_tensor`` onto ``Partial(sum)``)
keeps the value on mesh coordinate 0 of the Partial dims and zeros elsewhere,
which is exact (torch 2.13 divides by the group size instead), and
``Replicate -> Partial(product)`` keeps it on coordinate 0 with ones elsewhere
(torch refuses it). ``Shard -> Partial`` is local for sum/max/min/product (the
block at its offset, the op's identity elsewhere); torch refuses it.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    check_placements,
    coord_to_rank,
    format_placements,
    local_shape,
    local_shape_and_offset,
    padded_local_shape,
    rank_to_coord,
)
from placements._plan import Plan, check_partial_mix, plan as _make_plan
from spmd._mesh import DeviceMesh

__all__ = ["DTensor", "distribute_tensor", "plan_redistribute"]


# --- validation --------------------------------------------------------------------------
def _check_mesh(mesh: Any, where: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: device_mesh={mesh!r} must be a DeviceMesh; make one with "
            "spmd.init_device_mesh('cpu', (8,)) and pass it."
        )
    return mesh


def _check_dtype(placements, dtype, where: str) -> None:
    dtype = np.dtype(dtype)
    for i, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        if dtype == np.bool_:
            raise TypeError(
                f"{where}: placements[{i}]={p} on a bool tensor is refused; a Partial needs a numeric dtype: "
                "cast the tensor (e.g. to int32) first."
            )
        if p.reduce_op == "avg" and not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{where}: placements[{i}]={p} on a {dtype.name} tensor is refused (torch allows AVG only on "
                "floating dtypes); use Partial('sum') and divide, or cast to a float dtype."
            )


def _placements(placements: Any, mesh: DeviceMesh, ndim: int, dtype, where: str, arg: str = "placements"):
    pl = check_placements(placements, mesh_ndim=mesh.ndim, tensor_ndim=ndim, where=f"{where}: {arg}")
    check_partial_mix(pl, f"{where}: {arg}")
    _check_dtype(pl, dtype, where)
    return pl


def _identity(op: str, dtype):
    from spmd._redistribute import _identity as ident

    return ident(op, dtype)


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _pad_block(x, padded, xp):
    pad = [(0, p - s) for s, p in zip(x.shape, padded)]
    return xp.pad(x, pad) if any(b for _, b in pad) else x


def _partial_keep(placements, coord) -> str | None:
    """For a value partitioned from Replicate: the op whose identity this coord holds, if any."""
    for d, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op in ("sum", "product") and coord[d] != 0:
            return p.reduce_op
    return None


def _np_block(x: np.ndarray, shape, mesh_shape, placements, coord) -> np.ndarray:
    """The padded block of a global NumPy ``x`` at ``coord`` (Partial as ``Replicate -> Partial``)."""
    ls, off = local_shape_and_offset(shape, mesh_shape, placements, coord)
    block = x[tuple(slice(o, o + s) if s else slice(0, 0) for o, s in zip(off, ls))]
    op = _partial_keep(placements, coord)
    if op is not None:
        block = np.full_like(block, _identity(op, x.dtype))
    return _pad_block(block, padded_local_shape(shape, mesh_shape, placements), np)


# (id(mesh), placements, shape, dtype, requested placements) -> (mesh, dst, jitted program or None)
_DISPATCH: dict = {}


# --- the DTensor -------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class DTensor:
    """A tensor laid out over ``device_mesh`` by ``placements`` (one per mesh dim).

    Make one with :func:`distribute_tensor` or :meth:`DTensor.from_local`.
    """

    __slots__ = ("_physical", "_mesh", "_placements", "_shape")

    def __init__(self, physical, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]):
        # Private: use distribute_tensor or DTensor.from_local.
        self._physical = physical
        self._mesh = mesh
        self._placements = tuple(placements)
        self._shape = tuple(int(s) for s in shape)

    # --- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._physical,), (self._mesh, self._placements, self._shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    # --- properties -----------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._placements

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self):
        return self._physical.dtype

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={self._shape}, dtype={np.dtype(self.dtype).name}, "
            f"placements={format_placements(self._placements)}, mesh={self._mesh!r})"
        )

    # --- construction ---------------------------------------------------------------------
    @staticmethod
    def from_local(
        locals: Any,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shape: Sequence[int] | None = None,
        run_check: bool = False,
    ) -> "DTensor":
        """A DTensor from each rank's local tensor.

        ``locals``: a sequence of ``mesh.size`` arrays indexed by rank, or a callable
        ``rank -> array``; in a multi-process run, this process's local tensor.
        ``placements`` defaults to Replicate on every mesh dim (as torch).
        Without ``shape`` the global shape assumes even shards (as torch); give
        ``shape`` for uneven ones. ``run_check=True`` checks shapes and dtypes and,
        as torch, copies coordinate 0's value along Replicate mesh dims.
        """
        return _from_local(locals, device_mesh, placements, shape, run_check)

    # --- local views ----------------------------------------------------------------------
    def _blocks_by_coord(self, where: str) -> dict:
        if _is_tracer(self._physical):
            raise TypeError(f"DTensor.{where}: called inside jax.jit on a traced DTensor; call it outside jit.")
        if not self._physical.is_fully_addressable:
            raise ValueError(
                f"DTensor.{where}: this DTensor spans several processes; use .to_local() for this process's tensor."
            )
        return dict(self._local(s) for s in self._physical.addressable_shards)

    def _local(self, shard) -> tuple:
        """(mesh coordinate, unpadded local tensor) of one addressable shard of the storage."""
        nd = self._mesh.ndim
        coord = tuple(sl.start or 0 for sl in shard.index[:nd])
        ls = local_shape(self._shape, self._mesh.shape, self._placements, coord)
        b = shard.data
        return coord, b.reshape(b.shape[nd:])[tuple(slice(0, s) for s in ls)]

    def local_tensors(self) -> list:
        """Each rank's local tensor, indexed by rank, with its exact (unpadded) shape."""
        blocks = self._blocks_by_coord("local_tensors")
        return [blocks[rank_to_coord(r, self._mesh.shape)] for r in range(self._mesh.size())]

    def to_local(self):
        """This process's local tensor (multi-process runs). One process holding the whole
        mesh has ``mesh.size`` local tensors: use :meth:`local_tensors`."""
        if jax.process_count() == 1:
            raise ValueError(
                f"DTensor.to_local: this process holds all {self._mesh.size()} ranks of {self._mesh!r}, so there is "
                "no single local tensor; use .local_tensors()[rank] (or .full_tensor() for the global value)."
            )
        shards = self._physical.addressable_shards
        if len(shards) != 1:
            raise ValueError(
                f"DTensor.to_local: this process holds {len(shards)} devices of the mesh; use "
                ".local_tensors() or one device per process."
            )
        return self._local(shards[0])[1]

    def full_tensor(self):
        """The logical global tensor: Partial reduced, shards gathered (uneven ones too)."""
        rep = self.redistribute(placements=[Replicate()] * self._mesh.ndim)
        nd = self._mesh.ndim
        phys = rep._physical
        if _is_tracer(phys):
            # Every device holds the whole value now: read the local block (no collective),
            # as a replicated result, instead of indexing device 0's block (which would broadcast it).
            names = self._mesh.mesh_dim_names
            take = jax.shard_map(
                lambda b: b.reshape(b.shape[nd:]), mesh=self._mesh.jax_mesh, in_specs=P(*names), out_specs=P(),
                check_vma=False,
            )
            return take(phys)
        b = phys.addressable_shards[0].data
        return b.reshape(self._shape)

    # --- redistribute ---------------------------------------------------------------------
    def _target(self, device_mesh, placements, mesh, where: str):
        if mesh is not None and device_mesh is not None:
            raise TypeError(f"{where}: the mesh was given twice (device_mesh= and mesh=); give one.")
        device_mesh = mesh if device_mesh is None else device_mesh
        if device_mesh is not None:
            _check_mesh(device_mesh, where)
            if device_mesh != self._mesh:
                raise ValueError(
                    f"{where}: device_mesh={device_mesh!r} is not this DTensor's mesh {self._mesh!r}; redistributing "
                    "across meshes is not supported (nor in torch): redistribute on this mesh, then use "
                    ".full_tensor() and distribute_tensor onto the other mesh."
                )
        if placements is None:
            raise ValueError(
                f"{where}: placements is needed, e.g. placements=[Replicate()] * {self._mesh.ndim} (one per mesh dim)."
            )
        return _placements(placements, self._mesh, self.ndim, self.dtype, where)

    def _plan(self, dst) -> Plan:
        return _make_plan(
            self._mesh.shape, self._shape, np.dtype(self.dtype).itemsize, self._placements, dst,
            where="DTensor.redistribute",
        )

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        explain: bool = False,
        mesh: DeviceMesh | None = None,
    ):
        """This tensor with new ``placements`` on the same mesh (one jitted program).

        With ``explain=True`` returns the :class:`~placements.Plan` without running it.
        """
        fast = None
        if (
            device_mesh is None
            and mesh is None
            and not explain
            and isinstance(placements, (list, tuple))
            and all(isinstance(p, Placement) for p in placements)
        ):
            # A memo of the validated (dst, program) for this exact request: the hot path of a
            # cached redistribute is then one dict look-up and the jitted call.
            fast = (id(self._mesh), self._placements, self._shape, self.dtype, tuple(placements))
            hit = _DISPATCH.get(fast)
            if hit is not None and hit[0] is self._mesh:
                _, dst, fn = hit
                return self if fn is None else DTensor(fn(self._physical), self._mesh, dst, self._shape)
        dst = self._target(device_mesh, placements, mesh, "DTensor.redistribute")
        plan = self._plan(dst)
        if explain:
            return plan
        from spmd._redistribute import program

        fn = program(self._mesh, plan) if plan.steps else None
        if fast is not None:
            if len(_DISPATCH) > 4096:
                _DISPATCH.clear()
            _DISPATCH[fast] = (self._mesh, dst, fn)
        return self if fn is None else DTensor(fn(self._physical), self._mesh, dst, self._shape)

    # --- display --------------------------------------------------------------------------
    def visualize(self, *, print_out: bool = True) -> str:
        """A text table of which ranks hold which block (as torch's ``visualize_sharding``)."""
        text = _visualize(self._shape, self._mesh, self._placements, repr(self))
        if print_out:
            print(text)
        return text


def _visualize(shape, mesh: DeviceMesh, placements, title: str) -> str:
    blocks: dict = {}
    for r in range(mesh.size()):
        coord = rank_to_coord(r, mesh.shape)
        ls, off = local_shape_and_offset(shape, mesh.shape, placements, coord)
        key = tuple((o, o + s) if s else (None, None) for o, s in zip(off, ls))
        blocks.setdefault(key, []).append(r)
    partial = [f"{p} over mesh dim {i} ({mesh.mesh_dim_names[i]})" for i, p in enumerate(placements) if isinstance(p, Partial)]
    rows = []
    for key, ranks in blocks.items():
        if any(a is None for a, _ in key):
            blk = "(empty)"
        else:
            blk = "[" + ", ".join(f"{a}:{b}" for a, b in key) + "]" if key else "[] (scalar)"
        shp = str(tuple(0 if a is None else b - a for a, b in key))
        rows.append((blk, shp, ", ".join(str(r) for r in ranks)))
    w = max([len("block")] + [len(b) for b, _, _ in rows])
    v = max([len("shape")] + [len(s) for _, s, _ in rows])
    lines = [title, f"{'block':<{w}}  {'shape':<{v}}  ranks", f"{'-' * w}  {'-' * v}  -----"]
    lines += [f"{b:<{w}}  {s:<{v}}  {r}" for b, s, r in rows]
    if partial:
        lines.append("partial: " + "; ".join(partial) + " (each rank holds an unreduced value)")
    return "\n".join(lines)


# --- constructors --------------------------------------------------------------------------
def _sharding(mesh: DeviceMesh) -> NamedSharding:
    return NamedSharding(mesh.jax_mesh, P(*mesh.mesh_dim_names))


def distribute_tensor(x: Any, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None) -> DTensor:
    """Lay out a global tensor ``x`` (NumPy or JAX array) over ``device_mesh`` by ``placements``.

    ``placements`` defaults to Replicate on every mesh dim (as torch). A Partial
    placement partitions the value as ``Replicate -> Partial`` does.
    """
    where = "distribute_tensor"
    mesh = _check_mesh(device_mesh, where)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(
                f"{where}: x is a DTensor on {x.device_mesh!r}, not on {mesh!r}; distribute x.full_tensor() instead."
            )
        pl = _placements(placements, mesh, x.ndim, x.dtype, where)
        if pl != x.placements:
            raise ValueError(
                f"{where}: x is already a DTensor placed {format_placements(x.placements)}, not "
                f"{format_placements(pl)}; call x.redistribute(placements=...) instead."
            )
        return x
    if _is_tracer(x):
        return _distribute_traced(x, mesh, placements, where)
    try:
        arr = np.asarray(x)
    except Exception:
        raise TypeError(f"{where}: x={x!r} is not an array; pass a NumPy or JAX array.") from None
    if arr.dtype == object:
        raise TypeError(f"{where}: x={x!r} is not a numeric array; pass a NumPy or JAX array.")
    pl = _placements(placements, mesh, arr.ndim, arr.dtype, where)
    shape = arr.shape
    padded = padded_local_shape(shape, mesh.shape, pl)
    nd = mesh.ndim

    def cb(index):
        coord = tuple(sl.start or 0 for sl in index[:nd])
        return _np_block(arr, shape, mesh.shape, pl, coord).reshape((1,) * nd + padded)

    phys = jax.make_array_from_callback(tuple(mesh.shape) + padded, _sharding(mesh), cb)
    return DTensor(phys, mesh, pl, shape)


def _distribute_traced(x, mesh: DeviceMesh, placements, where: str) -> DTensor:
    """Inside jax.jit: replicate, then run the plan ``R... -> placements``."""
    from spmd._redistribute import execute_plan

    pl = _placements(placements, mesh, x.ndim, x.dtype, where)
    rep = (Replicate(),) * mesh.ndim
    phys = jnp.broadcast_to(x, tuple(mesh.shape) + tuple(x.shape))
    phys = jax.lax.with_sharding_constraint(phys, _sharding(mesh))
    plan = _make_plan(mesh.shape, x.shape, np.dtype(x.dtype).itemsize, rep, pl, where=where)
    return DTensor(execute_plan(mesh, plan, phys), mesh, pl, x.shape)


def _as_array(x, where: str, arg: str):
    if isinstance(x, jax.Array):
        return x
    try:
        a = np.asarray(x)
    except Exception:
        a = None
    if a is None or a.dtype == object:
        raise TypeError(f"{where}: {arg}={x!r} is not an array; pass NumPy or JAX arrays.")
    return a


def _check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in shape
    ):
        raise TypeError(f"{where}: shape={shape!r} must be a tuple of ints, the global shape, e.g. shape=(10, 4).")
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: shape={tuple(shape)!r} has a negative size; sizes are >= 0.")
    return tuple(int(s) for s in shape)


def even_global_shape(local, mesh_shape, pl) -> tuple[int, ...]:
    """The global shape whose even shards have shape ``local`` (as torch's from_local infers it)."""
    g = list(local)
    for m, p in enumerate(pl):
        if isinstance(p, Shard):
            g[p.dim] *= mesh_shape[m]
    return tuple(g)


def _from_local(locals, device_mesh, placements, shape, run_check) -> DTensor:
    where = "DTensor.from_local"
    mesh = _check_mesh(device_mesh, where)
    n = mesh.size()
    nd = mesh.ndim
    if placements is None:
        placements = [Replicate()] * nd
    multi = jax.process_count() > 1 and not callable(locals) and not isinstance(locals, (list, tuple))
    if multi:
        return _from_local_process(locals, mesh, placements, shape, where)
    if callable(locals) and not isinstance(locals, (jax.Array, np.ndarray)):
        fn = locals
        locals = [fn(r) for r in range(n)]
    elif not isinstance(locals, (list, tuple)):
        what = f"an array of shape {tuple(locals.shape)}" if hasattr(locals, "shape") else repr(locals)
        raise TypeError(
            f"{where}: locals={what} is not a sequence of local tensors; in a single-process run pass a list of "
            f"{n} arrays indexed by rank (or a callable rank -> array)."
        )
    if len(locals) != n:
        raise ValueError(
            f"{where}: locals has {len(locals)} tensor(s) but {mesh!r} has {n} ranks; pass exactly one local "
            "tensor per rank, indexed by rank."
        )
    arrs = [_as_array(x, where, f"locals[{r}]") for r, x in enumerate(locals)]
    dtypes = {np.dtype(a.dtype) for a in arrs}
    if len(dtypes) > 1:
        raise TypeError(
            f"{where}: locals have different dtypes {sorted(d.name for d in dtypes)}; cast them to one dtype."
        )
    ndims = {a.ndim for a in arrs}
    if len(ndims) > 1:
        raise ValueError(
            f"{where}: locals have different ranks {sorted(ndims)} (shapes {[tuple(a.shape) for a in arrs]}); "
            "every local tensor has the global tensor's rank."
        )
    dtype = arrs[0].dtype
    pl = _placements(placements, mesh, arrs[0].ndim, dtype, where)
    if shape is None:
        gshape = even_global_shape(arrs[0].shape, mesh.shape, pl)
        hint = f"give shape= (the global shape) for uneven shards; assuming even shards it is {gshape}"
    else:
        gshape = _check_shape(shape, where)
        if len(gshape) != arrs[0].ndim:
            raise ValueError(
                f"{where}: shape={gshape!r} has {len(gshape)} dim(s) but the local tensors have {arrs[0].ndim}; "
                "give the global shape of the same rank."
            )
        hint = "check shape= or the locals"
    for r, a in enumerate(arrs):
        want = local_shape(gshape, mesh.shape, pl, rank_to_coord(r, mesh.shape))
        if tuple(a.shape) != want:
            raise ValueError(
                f"{where}: locals[{r}] has shape {tuple(a.shape)} but placements {format_placements(pl)} of a global "
                f"shape {gshape} give rank {r} the shape {want}; {hint}."
            )
    if run_check:
        rep_dims = [d for d, p in enumerate(pl) if isinstance(p, Replicate)]
        src = []
        for r in range(n):
            c = list(rank_to_coord(r, mesh.shape))
            for d in rep_dims:
                c[d] = 0
            src.append(arrs[coord_to_rank(c, mesh.shape)])
        arrs = src
    return _assemble({rank_to_coord(r, mesh.shape): a for r, a in enumerate(arrs)}, mesh, pl, gshape)


def _assemble(blocks: dict, mesh: DeviceMesh, pl, gshape) -> DTensor:
    """A DTensor from the unpadded local tensors at mesh coordinates (this process's devices)."""
    padded = padded_local_shape(gshape, mesh.shape, pl)
    pieces = []
    for coord, a in blocks.items():
        xp = jnp if isinstance(a, jax.Array) else np
        b = _pad_block(a, padded, xp).reshape((1,) * mesh.ndim + padded)
        pieces.append(jax.device_put(b, mesh.devices[coord]))
    phys = jax.make_array_from_single_device_arrays(tuple(mesh.shape) + padded, _sharding(mesh), pieces)
    return DTensor(phys, mesh, pl, gshape)


def _from_local_process(local, mesh: DeviceMesh, placements, shape, where: str) -> DTensor:
    """Multi-process: ``local`` is this process's tensor (one device per process)."""
    a = _as_array(local, where, "local_tensor")
    pl = _placements(placements, mesh, a.ndim, a.dtype, where)
    gshape = even_global_shape(a.shape, mesh.shape, pl) if shape is None else _check_shape(shape, where)
    mine = [c for c in itertools.product(*(range(s) for s in mesh.shape)) if mesh.devices[c].process_index == jax.process_index()]
    split = [d for d, p in enumerate(pl) if not isinstance(p, Replicate) and len({c[d] for c in mine}) > 1]
    if split:
        # One tensor cannot fill several blocks of a Shard dim, and would be counted twice on a Partial one.
        raise ValueError(
            f"{where}: this process holds {len(mine)} devices of {mesh!r} that differ along mesh dim(s) "
            f"{[mesh.mesh_dim_names[d] for d in split]}, where placements {format_placements(pl)} do not replicate; "
            "one local tensor cannot fill them. Use one device per process, Replicate() on those dims, or "
            "distribute_tensor with the global value."
        )
    for coord in mine:
        want = local_shape(gshape, mesh.shape, pl, coord)
        if tuple(a.shape) != want:
            raise ValueError(
                f"{where}: this process's local tensor has shape {tuple(a.shape)} but placements "
                f"{format_placements(pl)} of a global shape {gshape} give coordinate {coord} the shape {want}; "
                "give shape= (the global shape) for uneven shards."
            )
    return _assemble({coord: np.asarray(a) for coord in mine}, mesh, pl, gshape)


def plan_redistribute(dt: DTensor, placements: Sequence[Placement]) -> Plan:
    """The plan ``dt.redistribute(placements=placements)`` would run, without running it."""
    if not isinstance(dt, DTensor):
        raise TypeError(
            f"plan_redistribute: dt={dt!r} must be a DTensor; make one with distribute_tensor(x, mesh, placements)."
        )
    return dt.redistribute(placements=placements, explain=True)
