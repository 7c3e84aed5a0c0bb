"""Run one op on DTensors: redistribute the inputs as the strategy asks, then the local op on
every device's block, as one jitted program per (op, placements, shapes, dtypes).

The strategy (``placements/_strategy.py``) is pure placement logic; this module only
executes it. Storage is the DTensor's (one padded block per device, a ``Replicate`` value
stored once, see ``_storage.py``), read and rebuilt through the DTensor pytree (no import of
the class). The program runs with ``check_vma``: an input ``Replicate`` on a mesh dim is
invariant there, so its gradient is reduced as torch's autograd reduces it, and a
``Replicate`` output is checked by JAX. An elementwise op runs on the padded block and leaves garbage
in the padding (never read); a reduction or contraction along a sharded dim first fills
that dim's padding with the op's identity, from a static per-device table of local sizes.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from placements import Partial, format_placements, padded_local_shape
from placements._strategy import STRATEGIES, Operand, OpStrategy, check_strategy
from spmd._debug import run as run_program
from spmd._x64 import x64_for
from spmd.tensor import _dispatch
from spmd.tensor._lower import fill_padding
from spmd.tensor._storage import of as storage_of, op_identity, sharding, spec

__all__ = [
    "DTensorBase", "run", "operand", "is_dtensor", "check_operands", "recording", "placement_strategy",
    "current_strategy",
]


class DTensorBase:
    """Base of ``DTensor`` that the op executor knows (it builds results with ``type(x)``),
    so this module needs no import of the DTensor class."""

    __slots__ = ()
    __array_ufunc__ = None  # NumPy defers `ndarray + DTensor` to DTensor.__radd__


#: While ``spmd.ops.explain`` traces a function: a list that every op appends its strategy to.
_RECORD: contextvars.ContextVar = contextvars.ContextVar("spmd_ops_record", default=None)


class recording:
    """Context manager: collect the strategy of every op run inside it (``explain``)."""

    def __enter__(self) -> list:
        self._log: list = []
        self._token = _RECORD.set(self._log)
        return self._log

    def __exit__(self, *exc) -> None:
        _RECORD.reset(self._token)


#: The strategy setting of the ops run inside ``placement_strategy(...)``; outside it, torch's.
_STRATEGY: contextvars.ContextVar = contextvars.ContextVar("spmd_ops_strategy", default=STRATEGIES[0])


class placement_strategy:
    """How DTensor ops inside the ``with`` block choose their output placements.

    ``"torch"`` (the default, also outside any block): torch 2.13's placements, so a ported
    program's ``.placements`` and ``.to_local()`` shapes are the ones it had under torch.
    ``"cheapest"``: the strategy with the fewest communicated bytes in spmd's planner, e.g. a
    nonlinear op on ``P(sum)`` reduce-scatters to ``S(0)`` (torch all-reduces to ``R``) and
    ``S(0) @ S(0)`` gives ``P(sum)`` (torch all-gathers the right operand and gives ``S(0)``).
    docs/placements.md lists where the two differ. The setting is scoped: it holds for the
    calls made inside the block (in this thread or task) and ends with it. An op traced by
    ``jax.jit`` reads it when traced: enter the block inside the jitted function.

        with spmd.ops.placement_strategy("cheapest"):
            y = spmd.ops.exp(x)
    """

    def __init__(self, strategy: str) -> None:
        self.strategy = check_strategy(strategy)
        self._tokens: list = []

    def __enter__(self) -> "placement_strategy":
        self._tokens.append(_STRATEGY.set(self.strategy))
        return self

    def __exit__(self, *exc) -> None:
        _STRATEGY.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"placement_strategy({self.strategy!r})"


def current_strategy() -> str:
    """The strategy setting ops use here: the innermost ``placement_strategy`` block's, else ``"torch"``."""
    return _STRATEGY.get()


def is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensorBase)


def operand(x) -> Operand:
    return Operand(tuple(x.shape), np.dtype(x.dtype).itemsize, tuple(x.placements))


def check_operands(op: str, tensors: list) -> Any:
    """All DTensor operands on one mesh; returns that mesh."""
    mesh = tensors[0].device_mesh
    for t in tensors[1:]:
        if t.device_mesh != mesh:
            raise ValueError(
                f"{op}: operands live on different meshes ({mesh!r} placed {format_placements(tensors[0].placements)} "
                f"and {t.device_mesh!r} placed {format_placements(t.placements)}); redistribute one onto the other's "
                "mesh first (x.full_tensor() and distribute_tensor)."
            )
    return mesh


def _program(mesh, fn: Callable, params: tuple, strat: OpStrategy, kinds: tuple, shapes: tuple, fill: str | None):
    """The jitted ``(physical inputs..., scalars...) -> physical output`` of one op call, kept in the
    one DTensor program cache (``_dispatch.py``: per mesh, weakly held, bounded)."""
    key = ("op", fn, params, strat, kinds, shapes, fill)
    prog = _dispatch.lookup(mesh, key)
    if prog is None:
        prog = _build(mesh, fn, params, strat, kinds, shapes, fill)
        _dispatch.remember(mesh, key, prog)
    return prog


def _build(mesh, fn: Callable, params: tuple, strat: OpStrategy, kinds: tuple, shapes: tuple, fill: str | None):
    names = mesh.mesh_dim_names
    nd = mesh.ndim
    mesh_shape = tuple(mesh.shape)
    n_t = sum(k == "t" for k in kinds)

    def body(*flat):
        blocks, scalars = list(flat[:n_t]), list(flat[n_t:])
        locs = []
        for b, dims, shape, pl in zip(blocks, strat.masks, shapes, strat.inputs, strict=True):
            x = b.reshape(b.shape[nd:])
            if dims:
                x = fill_padding(x, shape, pl, dims, op_identity(fill, x.dtype), names, mesh_shape)
            locs.append(x)
        args, it_t, it_s = [], iter(locs), iter(scalars)
        for k in kinds:
            args.append(next(it_t) if k == "t" else next(it_s))
        y = fn(*args, *params)
        return y.reshape((1,) * nd + y.shape)

    n_s = len(kinds) - n_t
    in_specs = tuple(spec(mesh, pl) for pl in strat.inputs) + (P(),) * n_s
    sm = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=in_specs, out_specs=spec(mesh, strat.output), check_vma=True)

    def f(*flat):
        phys = [_dispatch.program(mesh, p)(x) if p.steps else x for p, x in zip(strat.plans, flat[:n_t])]
        return sm(*phys, *flat[n_t:])

    # out_shardings: XLA would lay out a zero-size result replicated, not one block per device.
    return jax.jit(f, out_shardings=sharding(mesh, strat.output))


def _scalar(x):
    """A Python/NumPy scalar or 0-d array as a jit argument (Python scalars stay weakly typed)."""
    if isinstance(x, (bool, int, float, complex)):
        return x
    return jnp.asarray(x)


def run(strat: OpStrategy, fn: Callable, args: list, *, params: tuple = (), fill: str | None = None):
    """Execute ``strat`` with local op ``fn(*args, *params)``; ``args`` mixes DTensors and scalars."""
    log = _RECORD.get()
    if log is not None:
        log.append(strat)
    kinds = tuple("t" if is_dtensor(a) else "s" for a in args)
    tensors = [a for a in args if is_dtensor(a)]
    mesh = tensors[0].device_mesh
    shapes = tuple(tuple(t.shape) for t in tensors)
    prog = _program(mesh, fn, params, strat, kinds, shapes, fill)
    storages = [storage_of(t) for t in tensors]
    with x64_for(*storages):  # a 64-bit DTensor keeps its dtype and values (spmd/_x64.py)
        out = run_program(strat.op, prog, *storages, *[_scalar(a) for a in args if not is_dtensor(a)])
    want = padded_local_shape(strat.out_shape, mesh.shape, strat.output)
    if tuple(out.shape[mesh.ndim:]) != want:
        raise RuntimeError(
            f"{strat.op}: internal error, local result {tuple(out.shape[mesh.ndim:])} is not the padded block {want} "
            f"of {strat.out_shape} placed {format_placements(strat.output)}."
        )
    if out.dtype == jnp.bool_ and any(isinstance(p, Partial) for p in strat.output):
        raise TypeError(
            f"{strat.op}: the result would be a bool tensor placed {format_placements(strat.output)}, and a Partial "
            "needs a numeric dtype; cast the input first, e.g. x.astype('int32')."
        )
    return type(tensors[0]).tree_unflatten((mesh, strat.output, strat.out_shape), (out,))
