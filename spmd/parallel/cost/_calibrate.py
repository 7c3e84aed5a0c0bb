"""The machine's costs, measured: per collective kind a latency and a bandwidth, matmul and elementwise throughput.

``calibrate()`` times, on every device at once (as a train step runs):

- each collective of ``spmd.parallel.cost._comm.KINDS`` plus ``collective-permute`` at sizes from 32 KiB to
  16 MiB, each between small kernels in a straight-line program, less the same program without it (a loop of
  back-to-back collectives misses what one between kernels costs), kept as the kind's ``(bytes, seconds)``
  points and interpolated between them (a line drawn through small sizes misses where the caches stop holding the
  buffers); bytes in the cost model's nccl-tests convention: the all-reduce's buffer, the all-gather's
  result, the reduce-scatter's input;
- a matmul's flop rate and an elementwise kernel's byte rate per device while all devices run (where fake
  devices share a host's cores, the rates are what each gets);
- ``op_s``, the cost of one more operation in a device's program (a chain of tiny dependent ops: the
  per-kernel launch and synchronisation a step's fusions pay);
- ``alone_speedup``, how much faster one device's program runs with the others idle (where devices share
  cores, the idle devices' cores go to the busy one: a pipeline's bubble costs less);
- the fixed cost of dispatching one program.

The result is a ``Calibration``, cached per machine as JSON under ``$SPMD_CACHE_DIR`` (default
``~/.cache/spmd``; ``Calibration.cache_path(devices)``) and reused unless ``refresh=True``.

A measured calibration (``measured=True``) also tells ``auto_layout`` to time the user's own one-device
gradient and each layout's optimizer update on every device at once (``spmd.parallel.cost._memory.Profile
.grad_seconds``, ``.optimizer_seconds``): the rates above are those of small kernels of one shape each, and a
model's step mixes shapes whose efficiency they do not predict. A hand-built calibration (tests) predicts
from its rates alone, deterministically. The measurements behind these choices: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["Calibration", "calibrate", "cache_path", "program_ops", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
VERSION = 3  # of the cached calibration: 2, the collectives' cost curves; 3, alone_speedup


@dataclass(frozen=True)
class Calibration:
    """What one device's step costs on this machine (see the module doc).

    ``collectives``: per kind its cost curve over ``group_size`` devices, ``((bytes, seconds), ...)`` measured
    (``collective_s`` interpolates, and extends the end segments' slopes), or ``(latency_s,
    bandwidth_bytes_per_s)``: the line ``latency + bytes / bandwidth`` (a hand-built calibration);
    ``matmul_flops_per_s`` and ``elementwise_bytes_per_s``: per device, all devices busy;
    ``dispatch_s``: the fixed cost of one step's program; ``op_s``: the cost of one more operation of a
    device's program, all devices busy; ``alone_speedup``: a device's program with the others idle over all
    devices busy (1: devices that do not share compute, as GPUs; up to the device count over the cores
    where fake devices share a host's); ``measured``: made by ``calibrate()`` on this machine (see the
    module doc: ``auto_layout`` then anchors its compute estimate on the model's measured step).
    """

    collectives: dict = field(default_factory=dict)
    matmul_flops_per_s: float = 1e10
    elementwise_bytes_per_s: float = 1e10
    dispatch_s: float = 0.0
    group_size: int = 8
    machine: str = ""
    op_s: float = 0.0
    measured: bool = False
    alone_speedup: float = 1.0

    def __post_init__(self):
        for k in COLLECTIVE_KINDS:
            if k not in self.collectives:
                raise ValueError(f"Calibration: collectives={self.collectives!r} lacks {k!r}; give "
                                 f"{{kind: (latency_s, bandwidth_bytes_per_s)}} or {{kind: ((bytes, seconds), ...)}} "
                                 f"for each of {COLLECTIVE_KINDS}.")
        object.__setattr__(self, "collectives", {k: _curve(k, v) for k, v in self.collectives.items()})
        for name in ("matmul_flops_per_s", "elementwise_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Calibration: {name}={getattr(self, name)!r} must be > 0.")
        if not self.op_s >= 0:
            raise ValueError(f"Calibration: op_s={self.op_s!r} must be >= 0 (seconds per operation).")
        if not 1 <= self.alone_speedup <= self.group_size:
            raise ValueError(f"Calibration: alone_speedup={self.alone_speedup!r} must be between 1 (devices that do "
                             f"not share compute) and group_size={self.group_size}.")

    @staticmethod
    def cache_path(devices=None) -> str:
        """Where ``calibrate`` keeps the calibration of ``devices`` (default ``jax.devices()``) on this
        machine: ``$SPMD_CACHE_DIR`` or ``~/.cache/spmd``."""
        return cache_path(devices)

    def compute_s(self, flops: float, nbytes: float, ops: float) -> float:
        """Seconds of one device's program of ``flops``, ``nbytes`` accessed and ``ops`` operations, all
        devices busy: ``flops / matmul rate + bytes / elementwise rate + ops x op_s``."""
        return flops / self.matmul_flops_per_s + nbytes / self.elementwise_bytes_per_s + ops * self.op_s

    def collective_s(self, kind: str, nbytes: float, count: int, group: int, stride: int = 1) -> float:
        """Seconds for ``count`` collectives of ``kind`` moving ``nbytes`` in all over ``group`` devices:
        ``count`` times the kind's curve at their mean size. ``stride`` (the group's spacing in the device
        order) is not used: a calibration has no topology (``Hardware`` has).

        The size scales with the ring's traffic per byte, ``(g - 1) / g``, from the calibrated group to
        ``group``; a group of one moves nothing."""
        if group <= 1 or not count:
            return 0.0
        g0 = max(self.group_size, 2)
        scale = ((group - 1) / group) / ((g0 - 1) / g0)
        return count * _at(self.collectives[kind], nbytes * scale / count)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        d = dict(d)
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        return cls(**d)


def _curve(kind: str, v) -> tuple:
    """``v`` as a cost curve: ``((bytes, seconds), ...)`` by size, the seconds never falling as the size grows
    (a noisy point of a measured curve); a ``(latency, bandwidth)`` pair as the two points of its line."""
    v = tuple(v)
    if len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        lat, bw = float(v[0]), float(v[1])
        if lat < 0 or bw <= 0:
            raise ValueError(f"Calibration: collectives[{kind!r}]=({lat!r}, {bw!r}) must be a latency >= 0 and a "
                             "bandwidth > 0 (seconds, bytes per second).")
        return ((0.0, lat), (float(1 << 20), lat + (1 << 20) / bw))
    pts = sorted((float(b), float(t)) for b, t in v)
    if len(pts) < 2 or pts[0][0] < 0 or any(t < 0 for _, t in pts) or len({b for b, _ in pts}) < len(pts):
        raise ValueError(f"Calibration: collectives[{kind!r}]={v!r} must be two or more (bytes, seconds) points of "
                         "distinct sizes >= 0 and seconds >= 0, or a (latency, bandwidth) pair.")
    t = np.maximum.accumulate([p[1] for p in pts])
    return tuple((b, float(x)) for (b, _), x in zip(pts, t))


def _at(curve: tuple, nbytes: float) -> float:
    """``curve``'s seconds at ``nbytes``: linear between its points, its end segments' slopes beyond them
    (never below 0)."""
    xs = [b for b, _ in curve]
    i = min(max(int(np.searchsorted(xs, nbytes)), 1), len(curve) - 1)
    (b0, t0), (b1, t1) = curve[i - 1], curve[i]
    return max(t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0), 0.0)


def _machine_key(devices) -> str:
    import jax

    d = devices[0]
    # the processes and the backend that carries their collectives change every figure (gloo across processes
    # is far slower than one process's devices), so each (machine, devices, processes, backend, jax) has its own
    backend = os.environ.get("SPMD_BACKEND") or ("" if jax.process_count() == 1 else "distributed")
    return (f"{platform.node()}|{d.platform}|{getattr(d, 'device_kind', '')}|{len(devices)}|"
            f"processes {jax.process_count()}|{backend}|jax {jax.__version__}")


def cache_path(devices=None) -> str:
    """Where ``calibrate`` keeps this machine's calibration (``$SPMD_CACHE_DIR`` or ``~/.cache/spmd``)."""
    import jax

    devices = list(devices if devices is not None else jax.devices())
    root = os.environ.get("SPMD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spmd")
    key = hashlib.sha1(_machine_key(devices).encode()).hexdigest()[:12]
    return os.path.join(root, f"calibration-{key}.json")


def _timed(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _in_step(kind: str | None, mesh, elems: int, segments: int):
    """A straight-line program of ``segments`` steps, each a little compute (four dependent 64x64 matmuls, as
    a layer's) then, unless ``kind`` is None, one collective of ``kind`` on the ``elems``-float buffer the
    compute updated: collectives as a train step runs them, between kernels, with every device's program
    sharing the host (back-to-back in a loop they cost a third as much on CPU fake devices)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def body(x, w):
        for _ in range(segments):
            h = x[: 64 * 64].reshape(64, 64)
            for _ in range(4):
                h = jnp.tanh(h @ w)
            x = x + jnp.pad(h.reshape(-1), (0, x.shape[0] - 64 * 64))
            if kind == "all-reduce":
                x = lax.psum(x, "x") * (1.0 / n)
            elif kind == "all-gather":  # the result is the buffer: each device gives 1/n of it
                x = lax.all_gather(x[: elems // n], "x", tiled=True) * 0.5 + x
            elif kind == "reduce-scatter":  # the input is the buffer
                x = jnp.tile(lax.psum_scatter(x, "x", tiled=True), n) * (1.0 / n) + x
            elif kind == "collective-permute":
                x = lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]) * 0.5 + x
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False))


def _collectives(mesh, sizes: Sequence[int], repeats: int, segments: int, passes: int = 2) -> dict:
    """``{kind: ((bytes, seconds), ...)}``: the in-step cost of one collective per size (``_in_step`` with the
    collective less without, over ``segments``, fewer above 1 MiB where one collective outlasts the
    dispatch's noise; the median of ``repeats`` interleaved rounds, the least of ``passes`` passes over the
    sizes: a load spike on a shared host inflates one pass's point)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    sh = NamedSharding(mesh, P("x"))
    w = jax.device_put(jnp.full((n * 64, 64), 0.01, jnp.float32), sh)
    progs = {}
    for nbytes in sizes:  # the table's bytes per device: all-gather's result, reduce-scatter's input
        elems = max(nbytes // 4 // n, 64 * 64 // n) * n
        x = jax.device_put(jnp.ones((n * elems,), jnp.float32), sh)
        segs = max(2, min(segments, segments * (1 << 20) // max(nbytes, 1)))
        progs[elems] = (x, segs, {k: _in_step(k, mesh, elems, segs) for k in (None, *COLLECTIVE_KINDS)})
        for f in progs[elems][2].values():
            jax.block_until_ready(f(x, w))  # compile and warm up
    best: dict = {}
    for _ in range(passes):
        for elems, (x, segs, fns) in progs.items():
            got: dict = {k: [] for k in fns}
            for _ in range(repeats):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x, w))
                    got[k].append(time.perf_counter() - t0)
            base = float(np.median(got[None]))
            for k in COLLECTIVE_KINDS:
                t = max((float(np.median(got[k])) - base) / segs, 1e-9)
                best[k, elems] = min(best.get((k, elems), t), t)
    return {k: tuple((float(e * 4), best[k, e]) for e in progs) for k in COLLECTIVE_KINDS}


def _measure(devices, sizes: Sequence[int], repeats: int, reps: int) -> Calibration:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("x",))
    n = len(devices)
    sh = NamedSharding(mesh, P("x"))
    empty = jax.jit(jax.shard_map(lambda x: x + 1.0, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    tiny = jax.device_put(jnp.zeros((n * 8,), jnp.float32), sh)
    dispatch = _timed(empty, tiny, repeats=repeats)
    colls = _collectives(mesh, sizes, repeats=max(repeats, 3), segments=2 * reps)
    m = 256
    t = max(_matmuls(devices, m, reps, repeats) - dispatch, 1e-9)
    flops = reps * 2 * m ** 3 / t
    alone = min(max(t / max(_matmuls(devices[:1], m, reps, repeats) - dispatch, 1e-9), 1.0), float(n))
    e = 1 << 18
    v = jax.device_put(jnp.ones((n * e,), jnp.float32), sh)
    ew = jax.jit(jax.shard_map(lambda x: _repeat(lambda y: y * 0.999 + x, x, reps), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))
    t = max(_timed(ew, v, repeats=repeats) - dispatch, 1e-9)
    bw = reps * 3 * e * 4 / t
    return Calibration(collectives=colls, matmul_flops_per_s=flops, elementwise_bytes_per_s=bw, dispatch_s=dispatch,
                       group_size=n, machine=_machine_key(devices), op_s=_op_seconds(mesh, repeats),
                       measured=True, alone_speedup=alone)


def _matmuls(devices, m: int, reps: int, repeats: int) -> float:
    """Seconds of ``reps`` dependent ``m``-cubed matmuls (and a tanh) on each of ``devices`` at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("x",))
    a = jax.device_put(jnp.ones((len(devices) * m, m), jnp.float32), NamedSharding(mesh, P("x")))
    mm = jax.jit(jax.shard_map(lambda x: _repeat(lambda y: jnp.tanh(y @ x[:m]), x[:m], reps),
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return _timed(mm, a, repeats=repeats)


def _op_seconds(mesh, repeats: int, k: int = 128) -> float:
    """Seconds per operation (``program_ops``) of a chain of ``k`` tiny dependent matmul+tanh links, all
    devices busy, less the same program with one link: the launch cost each op of a step pays."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def chain(m):
        def f(x):
            for _ in range(m):
                x = jnp.tanh(x @ x)
            return x

        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    n = mesh.devices.size
    x = jax.device_put(jnp.full((n * 8, 8), 0.01, jnp.float32), NamedSharding(mesh, P("x")))
    long, short = chain(k), chain(1)
    extra = program_ops(long.lower(x).compile().as_text()) - program_ops(short.lower(x).compile().as_text())
    diffs = [_timed(long, x, repeats=3) - _timed(short, x, repeats=3) for _ in range(max(repeats, 3))]
    return max(float(np.median(diffs)), 0.0) / max(extra, 1)  # interleaved pairs: the host's load varies


def program_ops(hlo_text: str) -> int:
    """The operations a compiled program launches: its entry computation's instructions less parameters,
    constants, tuples and bitcasts (which cost nothing at run time)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):] if "\nENTRY" in hlo_text else hlo_text
    body = entry[entry.index("{") + 1:]
    body = body[: body.index("\n}")] if "\n}" in body else body
    free = re.compile(r"\s(parameter|constant|get-tuple-element|tuple|bitcast)\(")  # the op after the shape
    return sum(1 for line in body.split("\n") if " = " in line and not free.search(line))


def _repeat(f, x, reps: int):
    """``f`` applied ``reps`` times in one program (a ``fori_loop``)."""
    from jax import lax

    return lax.fori_loop(0, reps, lambda _, y: f(y), x)


def calibrate(devices: Any = None, *, refresh: bool = False, quick: bool = False, cache: bool = True) -> Calibration:
    """This machine's ``Calibration`` (see the module doc): from the cache, else measured (a few seconds).

    ``devices``: the devices a step runs on (default ``jax.devices()``); ``refresh=True`` measures again;
    ``quick=True`` measures two small sizes with few repeats (tests); ``cache=False`` neither reads nor
    writes the cache.
    """
    import jax

    devices = list(devices if devices is not None else jax.devices())
    if not devices:
        raise ValueError("calibrate: devices=[] is empty; give the devices a step runs on (jax.devices()).")
    if len(devices) < 2:
        raise ValueError(f"calibrate: devices={devices!r} holds one device, which has no collectives to time; "
                         "give two or more, or build a Calibration by hand.")
    path = cache_path(devices)
    if cache and not refresh and os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        # a quick measurement serves quick calls only; one of an older version (before the cost curves)
        # is measured again
        if (quick or not got.get("quick", False)) and got.get("version") == VERSION:
            return Calibration.from_json(got["calibration"])
    sizes = (1 << 15, 1 << 18) if quick else (1 << 15, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    cal = _measure(devices, sizes, repeats=1 if quick else 5, reps=2 if quick else 8)
    if cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"version": VERSION, "quick": quick, "calibration": cal.to_json()}, f, indent=1)
        os.replace(path + ".tmp", path)
    return cal
