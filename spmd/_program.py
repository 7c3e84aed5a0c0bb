"""The one ``jax.jit(jax.shard_map(...))`` builder for eager per-device programs.

An eager value here is a *stacked* global array: its leading axes are the
mesh shape and device ``(i, j, ...)`` holds exactly block ``[i, j, ...]``
(``ProcessGroup``'s per-rank arrays, a DTensor's storage, the c10d facade's
one block per rank). :func:`block_program` runs a per-block function on it;
``ProcessGroup``, the c10d facade and ``DTensor.redistribute`` all build their
programs here. :func:`collective_program` is the cached program of one
functional collective, shared by ``ProcessGroup`` and the c10d facade.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from spmd import _collectives as C

__all__ = ["block_program", "collective_program"]


def block_program(
    jax_mesh: jax.sharding.Mesh, body: Callable, *, stacked: bool = True, specs: tuple | None = None,
    check_vma: bool = False,
) -> Callable:
    """The jitted program that maps every device's block through ``body``.

    ``body`` takes one block (the leading mesh axes removed) inside the SPMD
    region, may call the functional collectives over the mesh's axes, and
    returns one block; the result is stacked the same way. ``specs``: the
    (input, output) ``PartitionSpec`` of the leading axes, for values stored
    once along a mesh dim (a DTensor's ``Replicate``; ``check_vma=True``
    checks it); by default every leading axis is sharded. ``stacked=False``
    (1-D meshes): the blocks are concatenated on dim 0 instead, so a device's
    block is ``body``'s argument and result as they are (no reshape on either
    side: the c10d facade's per-rank tensors).
    """
    nd = len(jax_mesh.axis_names)
    spec = P(*jax_mesh.axis_names)
    if not stacked:
        return jax.jit(jax.shard_map(body, mesh=jax_mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))
    in_spec, out_spec = specs or (spec, spec)

    def per_device(block):
        out = body(block.reshape(block.shape[nd:]))
        return out.reshape((1,) * nd + out.shape)

    sm = jax.shard_map(per_device, mesh=jax_mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
    # out_shardings: XLA would lay out a zero-size result replicated, not one block per device.
    return jax.jit(sm, out_shardings=jax.sharding.NamedSharding(jax_mesh, out_spec))


@dataclasses.dataclass(frozen=True)
class _Collective:
    """One functional collective with fixed options: a hashable program body."""

    name: str
    group: Any
    kwargs: tuple

    def __call__(self, block):
        return getattr(C, self.name)(block, group=self.group, **{k: v for k, _, v in self.kwargs})


def collective_program(jax_mesh: jax.sharding.Mesh, name: str, group: Any, *, stacked: bool = True, **kwargs) -> Callable:
    """The cached :func:`block_program` running collective ``name`` of ``spmd._collectives``.

    The cache key holds each option's type, so ``src=False`` or ``src=1.0`` never
    reuses the program built for ``src=0`` or ``src=1`` (their validation runs).
    """
    key = tuple(sorted((k, type(v), v) for k, v in kwargs.items()))
    return _cached(jax_mesh, _Collective(name, group, key), stacked)


@functools.lru_cache(maxsize=512)
def _cached(jax_mesh: jax.sharding.Mesh, body: _Collective, stacked: bool = True) -> Callable:
    return block_program(jax_mesh, body, stacked=stacked)
