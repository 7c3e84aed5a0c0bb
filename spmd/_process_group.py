"""ProcessGroup: the seed's eager collectives on per-rank arrays.

An eager input holds one block per rank: its leading axes are the mesh shape
(``x[i, j]`` is the block of the rank at coordinate ``(i, j)``). The collective
runs along the group's mesh dims, independently for each coordinate of the
other dims, and the result comes back per rank the same way.
"""

from __future__ import annotations

from typing import Any

from placements import ReduceOp, as_reduce_op
from spmd._arrays import as_array
from spmd._collectives import _check_axis, _check_rank
from spmd._debug import run
from spmd._groups import MeshGroup
from spmd._program import collective_program

__all__ = ["ProcessGroup"]


class ProcessGroup(MeshGroup):
    """The ranks along some mesh dims (``mesh.get_group("dp")``), with torch's methods.

    ``pg.size`` is the number of ranks in one group. Every method takes and
    returns per-rank arrays whose leading axes are the mesh shape.
    """

    __slots__ = ()

    def _run(self, name: str, t: Any, **kwargs):
        where = f"ProcessGroup.{'allreduce' if name == 'all_reduce' else name}"
        t = as_array(t, where, "t")
        shape = self._mesh.shape
        if tuple(t.shape[: len(shape)]) != shape:
            raise ValueError(
                f"{where}: the input t has shape {tuple(t.shape)}; its leading axes must be the mesh shape {shape} "
                f"(one block per rank): stack the ranks' tensors, e.g. t of shape {shape + tuple(t.shape)} for a "
                f"block of shape {tuple(t.shape)}."
            )
        options = self._check_options(where, len(t.shape) - len(shape), kwargs)
        return run(where, collective_program(self._mesh.jax_mesh, name, self._dims, **options), t)

    def _check_options(self, where: str, block_ndim: int, kwargs: dict) -> dict:
        """The options checked and normalised (a rank or an axis an int, an op a ReduceOp) before they key
        the program cache: a list is refused with the project's error, not Python's 'unhashable'."""
        out = {}
        for arg, v in kwargs.items():
            if arg == "op":
                out[arg] = as_reduce_op(v, where=f"{where}: op")
            elif arg in ("src", "dst"):
                out[arg] = _check_rank(v, self.size, where, arg, self._dims)
            else:  # scatter_dim, split_axis, concat_axis: an axis of one rank's block
                out[arg] = _check_axis(v, block_ndim, where, arg)
        return out

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
