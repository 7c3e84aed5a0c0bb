"""Running one collective: this rank's tensor in, this rank's result out.

Every collective is one program from :func:`spmd._program.collective_program`
(the project's one ``jit(shard_map)`` builder) over a 1-D mesh of the group's
ranks (each rank's first device), running a functional collective of
:mod:`spmd._collectives`. This rank's tensor is its block of a global array
concatenated on dim 0 (``stacked=False``: no reshape on the way in or out; a
scalar is stacked on a new leading axis instead).

A program is lowered and compiled once per (group, collective, options,
shape, dtype) and the compiled executable is called directly afterwards. It is
compiled BEFORE any communication, so a wrong argument (``op="avg"`` on
integers) raises the same TypeError/ValueError as in one process, on the rank
that passed it, and never reaches the other ranks. The call itself runs under
:mod:`spmd.distributed._guard` (timeout on every rank; cross-rank signature
check with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). With ``check_collectives`` (the
default) the compiled program first all-gathers every rank's fingerprint of the
call (:mod:`spmd.distributed._fingerprint`) and runs the collective only where
they all agree: a mismatch moves no data and raises on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src.interpreters.pxla import batched_device_put
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd import _collectives
from spmd._arrays import as_array  # the one coercion rule (torch tensors, bfloat16 included)
from spmd._debug import record
from spmd._program import collective_program
from spmd._x64 import x64_for
from spmd.distributed import _fingerprint, _guard
from spmd.distributed._errors import PeerError
from spmd.distributed._state import state
from spmd.distributed._work import buffer_of

__all__ = ["rank_devices", "as_array", "run_on"]

_AXIS = "ranks"


@functools.lru_cache(maxsize=8)
def _devices_by_rank(world: int, multiprocess: bool) -> tuple:
    if not multiprocess:
        return (jax.local_devices()[0],)
    by: dict[int, list] = {}
    for d in jax.devices():
        by.setdefault(d.process_index, []).append(d)
    return tuple(min(by[p], key=lambda d: d.id) for p in range(world))


def rank_devices() -> tuple:
    """The device each rank's c10d collectives run on (its first device), by rank."""
    st = state("rank_devices")
    return _devices_by_rank(st.world_size, st.multiprocess)


@dataclasses.dataclass(frozen=True)
class _Program:
    """A compiled collective for one (group, options, block shape, dtype)."""

    sharding: NamedSharding
    device: Any  # this rank's device
    aval: core.ShapedArray  # the global array's type: a NumPy block is put straight into one
    stacked: bool  # a scalar's layout: blocks stacked on a new axis; else concatenated on dim 0
    global_shape: tuple[int, ...]  # one block per rank
    out_shape: tuple[int, ...]  # this rank's result
    jitted: Callable  # what CommDebugMode inspects
    compiled: Callable  # what runs: (block,) -> result; checked: (block, fingerprints) -> (result, fingerprints)
    fingerprint: np.ndarray | None  # the call's fingerprint (call number 0) when the program checks it


def _checked_body(name: str, kwargs: dict, stacked: bool, n: int) -> Callable:
    """The per-device body of a checked program: gather every rank's fingerprint first, then run the
    collective only if they all agree (every rank sees the same fingerprints, so all decide alike)."""

    def collective(block):
        if not stacked:
            return getattr(_collectives, name)(block, group=_AXIS, **kwargs)
        out = getattr(_collectives, name)(block.reshape(block.shape[1:]), group=_AXIS, **kwargs)
        return out.reshape((1,) + out.shape)

    def body(block, fp):
        seen = lax.all_gather(fp, _AXIS, tiled=True)
        agree = jnp.all(seen == jnp.tile(seen[: _fingerprint.WIDTH], n))
        out = jax.eval_shape(collective, block)
        return lax.cond(agree, collective, lambda b: jnp.zeros(out.shape, out.dtype), block), seen

    return body


@functools.lru_cache(maxsize=64)
def _mesh(devices: tuple) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (_AXIS,))


_FP_AVALS: dict[int, core.ShapedArray] = {}


def _fp_aval(n: int) -> core.ShapedArray:
    return _FP_AVALS.setdefault(n, core.ShapedArray((n * _fingerprint.WIDTH,), np.dtype(np.int32)))


@functools.lru_cache(maxsize=1024)
def _program(devices: tuple, me: int, name: str, opts: tuple, shape: tuple, dtype: np.dtype,
             where: str | None = None) -> _Program:
    """Trace, lower and compile (no communication), once per (group, collective, options,
    shape, dtype): argument errors surface here, on the rank that made them. With ``where``
    (the public name) the program checks the ranks' fingerprints of the call first."""
    mesh = _mesh(devices)
    n, stacked = len(devices), not shape  # concatenated blocks need no reshape: only a scalar is stacked
    kwargs = {k: v for k, _, v in opts}
    jitted = collective_program(mesh, name, _AXIS, stacked=stacked, **kwargs)
    sharding = NamedSharding(mesh, P(_AXIS))
    gshape = (n,) + tuple(shape) if stacked else (n * shape[0],) + tuple(shape[1:])
    spec = jax.ShapeDtypeStruct(gshape, dtype, sharding=sharding)
    if where is None:
        compiled = jitted.lower(spec).compile()
        out, fp = tuple(compiled.out_info.shape), None
    else:  # the same collective (the same argument errors, raised while tracing), behind the check
        body = _checked_body(name, kwargs, stacked, n)
        checked = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(_AXIS), P(_AXIS)), out_specs=(P(_AXIS), P(_AXIS)),
                                        check_vma=False), out_shardings=(sharding, sharding))
        compiled = checked.lower(spec, jax.ShapeDtypeStruct(_fp_aval(n).shape, np.int32, sharding=sharding)).compile()
        out, fp = tuple(compiled.out_info[0].shape), _fingerprint.fingerprint(where, tuple((k, v) for k, _, v in opts),
                                                                             shape, dtype)
    out_shape = out[1:] if stacked else (out[0] // n,) + out[1:]
    device = mesh.devices[me]
    return _Program(sharding, device, core.ShapedArray(gshape, dtype), stacked, gshape, out_shape, jitted, compiled, fp)


def run_on(ranks: Sequence[int], name: str, x: jax.Array, *, where: str | None = None, into: Any = None, **kwargs):
    """Run collective ``name`` over ``ranks`` with this rank's block ``x``; this rank's result.

    ``where`` is the public name the errors and the cross-rank check use (default ``name``).
    ``into``: the caller's tensor torch would write the result into; when it is a writable buffer
    of the result's shape and dtype (:func:`spmd.distributed._work.buffer_of`) the result is copied
    there straight from the device buffer and ``into`` itself is returned (NumPy in, NumPy out: no
    device-side reshape, no 64-bit value turned into a 32-bit JAX array later); otherwise a JAX array.
    """
    with x64_for(x):  # a 64-bit block runs in JAX's x64 mode (spmd/_x64.py); a no-op otherwise
        return _run(tuple(ranks), name, x, where or name, kwargs, into)


def _run(ranks: tuple, name: str, x: jax.Array, where: str, kwargs: dict, into: Any):
    st = state(where)
    devs = rank_devices()
    opts = tuple(sorted(kwargs.items()))
    typed = tuple((k, type(v), v) for k, v in opts)  # keyed like collective_program: src=False is not src=0
    checked = st.multiprocess and st.check_collectives and name != "permute"  # a send and its recv differ in name
    prog = _program(tuple(devs[r] for r in ranks), ranks.index(st.rank), name, typed, tuple(x.shape), np.dtype(x.dtype),
                    where if checked else None)
    # This rank's block of the global array: the tensor as it is (a scalar gets a leading axis).
    # NumPy goes to the device with one synchronous copy, straight into the global array (XLA's batched
    # put; jnp.asarray + make_array_from_single_device_arrays cost more per call, and their copy is
    # asynchronous, which the collective then waited for).
    if isinstance(x, np.ndarray):
        garr = batched_device_put(prog.aval, prog.sharding, [x[None] if prog.stacked else x], [prog.device])
    else:
        local = jax.device_put(x.reshape((1,)) if prog.stacked else x, prog.device)
        garr = jax.make_array_from_single_device_arrays(prog.global_shape, prog.sharding, [local])
    record(where, prog.jitted, garr)
    if not st.multiprocess:
        out = prog.compiled(garr)
    else:
        call = _guard.enter(st, where, ranks, opts, x.shape, x.dtype)
        fp = seen = None
        try:
            if prog.fingerprint is None:
                out = prog.compiled(garr).block_until_ready()
            else:
                fp = _fingerprint.set_seq(prog.fingerprint.copy(), call.seq)
                fps = batched_device_put(_fp_aval(len(ranks)), prog.sharding, [fp], [prog.device])
                out, seen = prog.compiled(garr, fps)
                seen = np.asarray(seen.addressable_shards[0].data)
                out.block_until_ready()
        except Exception as e:
            raise PeerError(_guard.broken_message(st, call, e)) from e
        finally:
            _guard.leave(call)
        if fp is not None:
            _fingerprint.check(seen, fp, len(ranks), where, ranks, call.group, st.rank)
    local_out = out.addressable_shards[0].data  # this rank's block, as it is unless stacked (cheaper than addressable_data)
    buf = None if into is None else buffer_of(into)
    if buf is not None and buf.shape == prog.out_shape and buf.dtype == local_out.dtype:
        np.copyto(buf, np.asarray(local_out).reshape(prog.out_shape))  # a host view of the device buffer
        return into
    return local_out.reshape(prog.out_shape) if prog.stacked else local_out


def stack(arrays: list) -> jax.Array | np.ndarray:
    """The arrays stacked on a new leading axis (on the host when they all are)."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.stack(arrays)
    with x64_for(*arrays):
        return jnp.stack(arrays)


def zeros(shape: tuple, dtype: Any) -> np.ndarray:
    """A receiver's placeholder block (on the host: copied to the device with the call)."""
    return np.zeros(shape, dtype)
