"""The machine's costs, measured: per collective kind a latency and a bandwidth, matmul and elementwise throughput.

``calibrate()`` times, on every device at once (as a train step runs), each collective of
``spmd.parallel._comm.KINDS`` plus ``collective-permute`` over a few sizes and fits ``time = latency +
bytes / bandwidth`` (bytes in the nccl-tests convention of the cost model: the all-reduce's buffer, the
all-gather's result, the reduce-scatter's input); a matmul's flop rate and an elementwise kernel's byte
rate per device while all devices run (on a CPU host the fake devices share the cores: the rates are what
each gets); and the fixed cost of dispatching one program. The result is a ``Calibration``, cached per
machine as JSON under ``$SPMD_CACHE_DIR`` (default ``~/.cache/spmd``) and reused unless ``refresh=True``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["Calibration", "calibrate", "cache_path", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


@dataclass(frozen=True)
class Calibration:
    """What one device's step costs on this machine (see the module doc).

    ``collectives``: ``{kind: (latency_s, bandwidth_bytes_per_s)}`` measured over ``group_size`` devices;
    ``matmul_flops_per_s`` and ``elementwise_bytes_per_s``: per device, all devices busy;
    ``dispatch_s``: the fixed cost of one step's program.
    """

    collectives: dict = field(default_factory=dict)
    matmul_flops_per_s: float = 1e10
    elementwise_bytes_per_s: float = 1e10
    dispatch_s: float = 0.0
    group_size: int = 8
    machine: str = ""

    def __post_init__(self):
        for k in COLLECTIVE_KINDS:
            if k not in self.collectives:
                raise ValueError(f"Calibration: collectives={self.collectives!r} lacks {k!r}; give "
                                 f"{{kind: (latency_s, bandwidth_bytes_per_s)}} for each of {COLLECTIVE_KINDS}.")
        for name in ("matmul_flops_per_s", "elementwise_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Calibration: {name}={getattr(self, name)!r} must be > 0.")

    def collective_s(self, kind: str, nbytes: float, count: int, group: int) -> float:
        """Seconds for ``count`` collectives of ``kind`` moving ``nbytes`` in all over ``group`` devices.

        The bandwidth term scales with the ring's traffic per byte, ``(g - 1) / g``, from the calibrated
        group to ``group``; a group of one moves nothing."""
        if group <= 1 or not count:
            return 0.0
        lat, bw = self.collectives[kind]
        g0 = max(self.group_size, 2)
        scale = ((group - 1) / group) / ((g0 - 1) / g0)
        return count * lat + nbytes * scale / bw

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        d = dict(d)
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        return cls(**d)


def _machine_key(devices) -> str:
    import jax

    d = devices[0]
    return f"{platform.node()}|{d.platform}|{getattr(d, 'device_kind', '')}|{len(devices)}|jax {jax.__version__}"


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


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * bytes`` with ``a, b >= 0``: ``(latency, bandwidth)``."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    if len(x) > 1 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
    else:
        a, b = 0.0, y[0] / x[0]
    if b <= 0:
        b = max(float(np.max(y / x)), 1e-15)
        a = 0.0
    a = max(float(a), 0.0)
    return float(a), float(1.0 / b)


def _collective_fn(kind: str, mesh, reps: int):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def body(x):
        def one(y):
            if kind == "all-reduce":
                return lax.psum(y, "x") * (1.0 / n)
            if kind == "all-gather":
                return lax.all_gather(y, "x", tiled=True)[: y.shape[0]] * 0.5
            if kind == "reduce-scatter":
                z = lax.psum_scatter(jax.numpy.tile(y, (n,)), "x", tiled=True)
                return z * (1.0 / n)
            return lax.ppermute(y, "x", [(i, (i + 1) % n) for i in range(n)])

        return _repeat(one, x, reps)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


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
    colls = {}
    for kind in COLLECTIVE_KINDS:
        fn = _collective_fn(kind, mesh, reps)
        pts = []
        for nbytes in sizes:  # the table's bytes per device: all-gather's result, reduce-scatter's input
            elems = max(nbytes // 4 // (n if kind == "all-gather" else 1), 1)
            x = jax.device_put(jnp.ones((n * elems,), jnp.float32), sh)
            t = (_timed(fn, x, repeats=repeats) - dispatch) / reps
            pts.append((float(elems * 4 * (n if kind in ("all-gather", "reduce-scatter") else 1)), max(t, 1e-9)))
        colls[kind] = _fit(pts)
    m = 256
    a = jax.device_put(jnp.ones((n * m, m), jnp.float32), sh)
    mm = jax.jit(jax.shard_map(lambda x: _repeat(lambda y: jnp.tanh(y @ x[:m]), x[:m], reps),
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    t = max(_timed(mm, a, repeats=repeats) - dispatch, 1e-9)
    flops = reps * 2 * m ** 3 / t
    e = 1 << 18
    v = jax.device_put(jnp.ones((n * e,), jnp.float32), sh)
    ew = jax.jit(jax.shard_map(lambda x: _repeat(lambda y: y * 0.999 + x, x, reps), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))
    t = max(_timed(ew, v, repeats=repeats) - dispatch, 1e-9)
    bw = reps * 3 * e * 4 / t
    return Calibration(collectives=colls, matmul_flops_per_s=flops, elementwise_bytes_per_s=bw, dispatch_s=dispatch,
                       group_size=n, machine=_machine_key(devices))


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
        if quick or not got.get("quick", False):  # a quick measurement serves quick calls only
            return Calibration.from_json(got["calibration"])
    sizes = (1 << 12, 1 << 16) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 22)
    cal = _measure(devices, sizes, repeats=1 if quick else 5, reps=2 if quick else 8)
    if cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"quick": quick, "calibration": cal.to_json()}, f, indent=1)
        os.replace(path + ".tmp", path)
    return cal
