"""DTensor <-> jax.Array with a NamedSharding (evenly placed; Partial(sum) as ``unreduced``).

A DTensor's storage already holds one block per device; a ``NamedSharding`` array
with the matching ``PartitionSpec`` holds the same blocks on the same devices. The
conversion is a per-device reshape in one ``shard_map`` (no communication, checked
in tests on the compiled HLO), eagerly or inside ``jax.jit``. ``Shard(d)`` on mesh
dims ``m1 < m2`` (torch's nesting: ``m1`` cuts first) is JAX's ``P((a1, a2))`` for dim
``d``: the major axis first, as in JAX. ``Partial(sum)`` mesh dims are JAX's ``unreduced``
axes, which JAX allows on ``Explicit`` mesh axes only: such an array lives on the
``Explicit`` twin of the DTensor's mesh (same devices and names); JAX reduces it when
it is resharded. Other Partial ops have no JAX counterpart and are refused.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from placements import Partial, Replicate, Shard, format_placements
from spmd.tensor import _dispatch
from spmd.tensor._checks import check_mesh
from spmd.tensor._ops_exec import is_dtensor
from spmd.tensor._storage import of as storage_of, spec as storage_spec

__all__ = ["to_jax", "from_jax", "partition_spec"]


def partition_spec(placements, names, ndim: int) -> P:
    """The ``PartitionSpec`` of a placement list; ``Partial`` mesh dims become ``unreduced`` axes."""
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for name, p in zip(names, placements):
        if isinstance(p, Shard):
            entries[p.dim].append(name)
    unreduced = frozenset(n for n, p in zip(names, placements) if isinstance(p, Partial))
    spec = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
    return P(*spec, unreduced=unreduced) if unreduced else P(*spec)


def _explicit(jax_mesh: Mesh) -> Mesh:
    """The same devices and axis names with ``Explicit`` axes (where JAX allows ``unreduced``)."""
    return Mesh(jax_mesh.devices, jax_mesh.axis_names, axis_types=(AxisType.Explicit,) * len(jax_mesh.axis_names))


def _cached(mesh, kind: str, build, spec: P, stored: P):
    """The program of ``kind`` for ``spec`` (the jax.Array's) and ``stored`` (the storage's) in the one
    DTensor program cache (``_dispatch.py``)."""
    key = ("interop", kind, spec, stored)
    prog = _dispatch.lookup(mesh, key)
    if prog is None:
        prog = build(mesh.jax_mesh, mesh.ndim, spec, stored)
        _dispatch.remember(mesh, key, prog)
    return prog


def _to_global(jax_mesh, nd: int, spec: P, stored: P):
    if spec.unreduced:
        em = _explicit(jax_mesh)
        sm = jax.shard_map(lambda b: b.reshape(b.shape[nd:]), mesh=em, in_specs=stored, out_specs=spec,
                           check_vma=False)
        f = lambda st: sm(jax.sharding.reshard(st, NamedSharding(em, stored)))  # noqa: E731 - same blocks
        return jax.jit(f, out_shardings=NamedSharding(em, spec))
    f = jax.shard_map(lambda b: b.reshape(b.shape[nd:]), mesh=jax_mesh, in_specs=stored, out_specs=spec,
                      check_vma=False)
    return jax.jit(f, out_shardings=NamedSharding(jax_mesh, spec))


def _to_storage(jax_mesh, nd: int, spec: P, stored: P):
    src = _explicit(jax_mesh) if spec.unreduced else jax_mesh
    f = jax.jit(jax.shard_map(lambda b: b.reshape((1,) * nd + b.shape), mesh=src, in_specs=spec,
                              out_specs=stored, check_vma=False))
    if not spec.unreduced:
        return f
    return lambda arr: jax.device_put(f(arr), NamedSharding(jax_mesh, stored))  # same blocks, the DTensor's mesh


def to_jax(x) -> jax.Array:
    """``x`` as a global ``jax.Array`` sharded by the matching ``NamedSharding`` (no communication).

    Needs even shards, and Partial only as ``sum`` (JAX's ``unreduced``, on the ``Explicit`` twin
    of the mesh): redistribute first otherwise (JAX's ``NamedSharding`` has no uneven shards and
    no avg/max/min/product partial values)."""
    where = "DTensor.to_jax"
    if not is_dtensor(x):
        raise TypeError(f"{where}: x={x!r} is not a DTensor.")
    pl, mesh = x.placements, x.device_mesh
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in pl):
        fix = [Replicate() if isinstance(p, Partial) else p for p in pl]
        raise ValueError(
            f"{where}: placements {format_placements(pl)} hold Partial values other than sums, which a NamedSharding "
            f"jax.Array cannot (JAX's unreduced is a sum); reduce them first: "
            f"x.redistribute(placements={fix!r}).to_jax()."
        )
    for d in sorted({p.dim for p in pl if isinstance(p, Shard)}):
        k = 1
        for s, p in zip(mesh.shape, pl):
            k *= s if p == Shard(d) else 1
        if x.shape[d] % k:
            raise ValueError(
                f"{where}: dim {d} of shape {x.shape} is cut into {k} uneven shards by {format_placements(pl)}; a "
                "NamedSharding needs even ones: pad that dim to a multiple of "
                f"{k}, or redistribute it to Replicate() first."
            )
    spec = partition_spec(pl, mesh.mesh_dim_names, x.ndim)
    return _cached(mesh, "to_jax", _to_global, spec, storage_spec(mesh, pl))(storage_of(x))


def _placements_of(arr, mesh, where: str):
    sh = getattr(arr, "sharding", None)
    if not isinstance(sh, NamedSharding):
        raise TypeError(
            f"{where}: arr has sharding {type(sh).__name__}, not a NamedSharding over {mesh!r}; "
            "lay it out with jax.device_put(arr, NamedSharding(mesh.jax_mesh, spec)) or use distribute_tensor."
        )
    if sh.mesh.axis_names != mesh.jax_mesh.axis_names or tuple(sh.mesh.devices.shape) != tuple(mesh.shape) or (
        [d.id for d in sh.mesh.devices.flat] != [d.id for d in mesh.devices.flat]
    ):
        raise ValueError(f"{where}: arr is sharded over mesh {dict(sh.mesh.shape)}, not over {mesh!r}; pass its mesh.")
    if sh.spec.reduced:
        raise ValueError(f"{where}: arr's PartitionSpec {sh.spec} has reduced axes, which have no placement; reshard first.")
    names = mesh.mesh_dim_names
    pl: list = [Partial("sum") if n in sh.spec.unreduced else Replicate() for n in names]
    parts = tuple(sh.spec.partitions)
    for d, entry in enumerate(parts + (None,) * (arr.ndim - len(parts))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        idx = [names.index(a) for a in axes]
        if idx != sorted(idx):
            raise ValueError(
                f"{where}: dim {d} is sharded over {axes} (minor mesh dim first); a DTensor nests mesh dims left to "
                f"right ({names}): reorder the spec entry."
            )
        for i in idx:
            pl[i] = Shard(d)
    return tuple(pl)


def from_jax(cls, arr, mesh):
    """A DTensor of ``cls`` holding ``arr`` (a ``jax.Array`` with a ``NamedSharding`` over ``mesh``);
    its placements come from the sharding's ``PartitionSpec`` (no communication)."""
    where = "DTensor.from_jax"
    check_mesh(mesh, where)
    if not isinstance(arr, jax.Array):
        raise TypeError(f"{where}: arr={arr!r} is not a jax.Array; use distribute_tensor for NumPy values.")
    pl = _placements_of(arr, mesh, where)
    spec = partition_spec(pl, mesh.mesh_dim_names, arr.ndim)
    storage = _cached(mesh, "from_jax", _to_storage, spec, storage_spec(mesh, pl))(arr)
    return cls.tree_unflatten((mesh, pl, tuple(arr.shape)), (storage,))
