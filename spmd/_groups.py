"""Groups of mesh dims: naming them, and resolving them inside an SPMD region.

The bottom of ``spmd``'s collectives: the mesh, the process group and the
functional collectives all resolve groups here, so none of them imports another
to do it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax

__all__ = ["MeshGroup", "resolve_mesh_dims", "region_mesh", "group_axes"]


class MeshGroup:
    """The ranks along some mesh dims of a mesh (what ``ProcessGroup`` is, without its collectives)."""

    __slots__ = ("_mesh", "_dims")

    def __init__(self, mesh, dims: Sequence[str]):
        self._mesh = mesh
        self._dims = tuple(dims)

    @property
    def mesh(self):
        return self._mesh

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dim names this group runs along."""
        return self._dims

    @property
    def size(self) -> int:
        return math.prod(self._mesh.size(d) for d in self._dims)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dims={self._dims!r}, size={self.size}, mesh={self._mesh!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshGroup) and (self._mesh, self._dims) == (other._mesh, other._dims)

    def __hash__(self) -> int:
        return hash((self._mesh, self._dims))


def resolve_mesh_dims(group: Any, names: Sequence[str], *, where: str, arg: str = "group") -> tuple[int, ...]:
    """Mesh dim indices for a name, an int, or a tuple of them; clear errors otherwise."""
    items = group if isinstance(group, (tuple, list)) else (group,)
    if not items:
        raise ValueError(f"{where}: {arg}={group!r} is empty; name at least one mesh dim of {tuple(names)}.")
    dims = []
    for g in items:
        if isinstance(g, str):
            if g not in names:
                raise ValueError(
                    f"{where}: {arg}={group!r} names {g!r}, which is not a mesh dim; the mesh has dims {tuple(names)}: "
                    "use one of them, or a tuple of them."
                )
            dims.append(list(names).index(g))
        elif isinstance(g, int) and not isinstance(g, bool):
            if not -len(names) <= g < len(names):
                raise ValueError(
                    f"{where}: {arg}={group!r} holds mesh dim {g}, out of range for a {len(names)}-D mesh "
                    f"with dims {tuple(names)}."
                )
            dims.append(g % len(names))
        else:
            raise TypeError(
                f"{where}: {arg}={group!r} must be a mesh dim name, an int, or a tuple of them; "
                f"the mesh has dims {tuple(names)}."
            )
    if len(set(dims)) != len(dims):
        raise ValueError(f"{where}: {arg}={group!r} repeats a mesh dim; name each at most once.")
    return tuple(dims)


def region_mesh(where: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """The current SPMD region's mesh axis names (in mesh order) and their sizes."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())
    names = tuple(n for n in getattr(mesh, "axis_names", ()) if n in manual)
    if not names:
        raise ValueError(
            f"{where}: called outside an SPMD region; call it inside a function decorated with "
            "@spmd(mesh, ...) (or jax.shard_map), or use mesh.get_group(dim) for eager per-rank arrays."
        )
    return names, dict(zip(mesh.axis_names, mesh.axis_sizes))


def group_axes(group: Any, where: str) -> tuple[tuple[str, ...], int]:
    """Mesh axis names and size of ``group`` inside the current SPMD region.

    ``group``: a mesh dim name, an int mesh dim, a tuple of them, a group
    (``mesh.get_group(...)``), or None for every mesh dim of the region.
    """
    names, sizes = region_mesh(where)
    if isinstance(group, MeshGroup):
        group = group.dims
    if group is None:
        axes = names
    else:
        axes = tuple(names[d] for d in resolve_mesh_dims(group, names, where=where, arg="group"))
    return axes, math.prod(sizes[a] for a in axes)
