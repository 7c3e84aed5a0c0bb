"""ProcessGroup: the seed's eager collectives on per-rank arrays.

An eager input holds one block per rank: its leading axes are the mesh shape
(``x[i, j]`` is the block of the rank at coordinate ``(i, j)``). The collective
runs along the group's mesh dims, independently for each coordinate of the
other dims, and the result comes back per rank the same way.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from placements import ReduceOp
from spmd import _collectives as C

__all__ = ["ProcessGroup"]


@functools.lru_cache(maxsize=256)
def _eager_program(jax_mesh, dims: tuple[str, ...], name: str, kwargs: tuple):
    nd = len(jax_mesh.axis_names)
    spec = P(*jax_mesh.axis_names)
    fn = getattr(C, name)
    kw = dict(kwargs)

    def body(block):
        out = fn(block.reshape(block.shape[nd:]), group=dims, **kw)
        return out.reshape((1,) * nd + out.shape)

    return jax.jit(jax.shard_map(body, mesh=jax_mesh, in_specs=spec, out_specs=spec, check_vma=False))


class ProcessGroup:
    """The ranks along some mesh dims (``mesh.get_group("dp")``), with torch's methods.

    ``pg.size`` is the number of ranks in one group. Every method takes and
    returns per-rank arrays whose leading axes are the mesh shape.
    """

    def __init__(self, mesh, dims: tuple[str, ...]):
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
        return int(np.prod([self._mesh.size(d) for d in self._dims]))

    def __repr__(self) -> str:
        return f"ProcessGroup(dims={self._dims!r}, size={self.size}, mesh={self._mesh!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessGroup) and (self._mesh, self._dims) == (other._mesh, other._dims)

    def __hash__(self) -> int:
        return hash((self._mesh, self._dims))

    def _run(self, name: str, t: Any, **kwargs):
        where = f"ProcessGroup.{'allreduce' if name == 'all_reduce' else name}"
        t = jnp.asarray(t)
        shape = self._mesh.shape
        if t.shape[: len(shape)] != shape:
            raise ValueError(
                f"{where}: the input t has shape {t.shape}; its leading axes must be the mesh shape {shape} "
                f"(one block per rank): stack the ranks' tensors, e.g. t of shape {shape + t.shape} for a block "
                f"of shape {t.shape}."
            )
        return _eager_program(self._mesh.jax_mesh, self._dims, name, tuple(sorted(kwargs.items())))(t)

    def allreduce(self, t, op: Any = ReduceOp.SUM):
        return self._run("all_reduce", t, op=op)

    def broadcast(self, t, src: int = 0):
        return self._run("broadcast", t, src=src)

    def all_gather(self, t):
        """Each rank gets every rank's block stacked on a new axis (torch's output list)."""
        return self._run("all_gather", t)

    def reduce(self, t, dst: int = 0, op: Any = ReduceOp.SUM):
        return self._run("reduce", t, dst=dst, op=op)

    def scatter(self, t, src: int = 0):
        """Rank ``i`` gets ``t[src][i]``: ``src``'s block has a leading axis of the group size."""
        return self._run("scatter", t, src=src)

    def gather(self, t, dst: int = 0):
        return self._run("gather", t, dst=dst)

    def reduce_scatter(self, t, op: Any = ReduceOp.SUM, scatter_dim: int = 0):
        return self._run("reduce_scatter", t, op=op, scatter_dim=scatter_dim)

    def all_to_all(self, t, split_axis: int = 0, concat_axis: int = 0):
        return self._run("all_to_all", t, split_axis=split_axis, concat_axis=concat_axis)
