"""The DTensor class: a global tensor laid out over a DeviceMesh by a placement list.

Storage and padding are ``_storage.py``'s; constructors live in ``_distribute.py``
(``distribute_tensor``) and ``_local.py`` (``from_local``); ``redistribute`` runs
the plan's program from ``_dispatch.py``. Semantics follow
``torch.distributed.tensor`` with two documented choices:
``Replicate -> Partial(sum)`` (and ``distribute_tensor`` onto ``Partial(sum)``)
keeps the value on mesh coordinate 0 of the Partial dims and zeros elsewhere,
which is exact (torch 2.13 divides by the group size instead), and
``Replicate -> Partial(product)`` keeps it on coordinate 0 with ones elsewhere
(torch refuses it). ``Shard -> Partial`` is local for sum/max/min/product (the
block at its offset, the op's identity elsewhere); torch refuses it.

Internal functions for the rest of ``spmd`` (never reach into the class's slots):
:func:`physical` (the storage), :func:`from_physical` (a DTensor around a storage).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from placements import Placement, Replicate, format_placements, rank_to_coord
from placements._plan import Plan, plan as make_plan
from spmd._debug import run
from spmd._mesh import DeviceMesh
from spmd.tensor import _dispatch
from spmd.tensor._checks import check_mesh, check_target, is_tracer
from spmd.tensor._local import from_local_storage
from spmd.tensor._ops_crossmesh import redistribute_cross_mesh
from spmd.tensor._ops_methods import DTensorOps
from spmd.tensor._storage import block_of
from spmd.tensor._visualize import visualize

__all__ = ["DTensor", "physical", "from_physical"]

_WHERE = "DTensor.redistribute"  # what CommDebugMode logs for a redistribute's program


@jax.tree_util.register_pytree_node_class
class DTensor(DTensorOps):
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
        ``shape`` for uneven ones. A Replicate mesh dim holds one value: with
        ``run_check=True`` coordinate 0's is copied along it (as torch); without,
        the replicas must be equal (one process: checked, bit for bit).
        """
        mesh, storage, pl, gshape = from_local_storage(locals, device_mesh, placements, shape, run_check)
        return DTensor(storage, mesh, pl, gshape)

    # --- local views ----------------------------------------------------------------------
    def _blocks_by_coord(self, where: str) -> dict:
        if is_tracer(self._physical):
            raise TypeError(f"DTensor.{where}: called inside jax.jit on a traced DTensor; call it outside jit.")
        if not self._physical.is_fully_addressable:
            raise ValueError(
                f"DTensor.{where}: this DTensor spans several processes; use .to_local() for this process's tensor."
            )
        return dict(block_of(s, self._mesh, self._placements, self._shape) for s in self._physical.addressable_shards)

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
        return block_of(shards[0], self._mesh, self._placements, self._shape)[1]

    def full_tensor(self):
        """The logical global tensor: Partial reduced, shards gathered (uneven ones too)."""
        phys = self.redistribute(placements=[Replicate()] * self._mesh.ndim)._physical
        if is_tracer(phys):
            return phys.reshape(self._shape)  # Replicate is stored once (_storage.py): no collective
        return phys.addressable_shards[0].data.reshape(self._shape)

    # --- redistribute ---------------------------------------------------------------------
    def _target(self, device_mesh, placements, where: str):
        if device_mesh is not None:
            check_mesh(device_mesh, where)  # another mesh went to redistribute_cross_mesh
        if placements is None:
            raise ValueError(
                f"{where}: placements is needed, e.g. placements=[Replicate()] * {self._mesh.ndim} (one per mesh dim)."
            )
        return check_target(placements, self._mesh.ndim, self.ndim, self.dtype, where)

    def _plan(self, dst, where: str) -> Plan:
        return make_plan(
            self._mesh.shape, self._shape, np.dtype(self.dtype).itemsize, self._placements, dst, where=where
        )

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None):
        """This tensor with new ``placements`` on the same mesh (one jitted program).

        The plan it runs is :func:`plan_redistribute`'s. Another ``device_mesh`` (other shape or
        devices; torch refuses it) runs ``spmd.ops.plan_cross_mesh``'s plan, eagerly.
        """
        key = None
        if (
            device_mesh is None
            and isinstance(placements, (list, tuple))
            and all(isinstance(p, Placement) for p in placements)
        ):
            # The hot path of a repeated redistribute: one look-up and the jitted call.
            key = (self._placements, self._shape, self.dtype, tuple(placements))
            hit = _dispatch.lookup(self._mesh, key)
            if hit is not None:
                dst, fn = hit
                return self if fn is None else DTensor(run(_WHERE, fn, self._physical), self._mesh, dst, self._shape)
        where = "DTensor.redistribute"
        if isinstance(device_mesh, DeviceMesh) and device_mesh != self._mesh:  # spmd/tensor/_ops_crossmesh.py
            return redistribute_cross_mesh(self, device_mesh, placements)
        dst = self._target(device_mesh, placements, where)
        plan = self._plan(dst, where)
        fn = _dispatch.program(self._mesh, plan) if plan.steps else None
        if key is not None:
            _dispatch.remember(self._mesh, key, (dst, fn))
        return self if fn is None else DTensor(run(_WHERE, fn, self._physical), self._mesh, dst, self._shape)

    # --- display --------------------------------------------------------------------------
    def visualize(self, *, print_out: bool = True) -> str:
        """A text table of which ranks hold which block (as torch's ``visualize_sharding``)."""
        text = visualize(self._shape, self._mesh, self._placements, repr(self))
        if print_out:
            print(text)
        return text


def physical(dt: DTensor) -> jax.Array:
    """The storage of ``dt``: one padded block per device, ``Replicate`` stored once (``_storage.py``)."""
    return dt._physical


def from_physical(storage, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    """A DTensor around ``storage`` (laid out as :func:`physical` describes, checked placements)."""
    return DTensor(storage, mesh, placements, shape)
