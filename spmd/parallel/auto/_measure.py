"""``auto_layout(measure=k)``: the top ``k`` predicted candidates compiled and timed side by side.

The cost model ranks every candidate without compiling one; what it does not see, a few compiled steps do.
On a CPU host with fake devices that is much: the devices' threads share the cores, and a step whose buffers
pass glibc's mmap threshold (32 MiB) takes fresh pages every step. So ``auto_layout`` can time its top
candidates as a user would run them: each is built through the contract (``apply_layout`` +
``init_train_state`` on a fixed pattern of the parameters' shapes + ``make_train_step``), compiled once, warmed up, then timed
in ``rounds`` interleaved rounds of ``steps`` steps on the example batch (a load spike on a shared host then
falls on every candidate of its round). Then the race: the candidates whose median is within ``RACE`` (10%)
of the fastest's are timed in more rounds, the others dropped, until one is left or ``max_rounds``: on a
shared host one round of a step varies by several percent (docs/benchmarks.md), so a fixed median can put
the second best first, and two close contenders need more rounds to be told apart, a clear loser none. A
candidate's time is the median of its rounds, its peak memory per device its compiled step's
``memory_analysis()`` (``argument + output + temp - alias``). The ``k`` candidates are held at once while
they are timed, and let go after. ``compiled_peak``: the same step compiled on shape structs and not run,
its peak alone: under a memory budget ``auto_layout`` compiles so until its top ``k`` fit, and times those
``k`` on the executables compiled there.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.parallel.auto._layout import Layout, apply_layout
from spmd.parallel.step._protocol import StepMemory
from spmd.parallel.step._state import init_train_state
from spmd.parallel.step._step import make_train_step
from spmd.parallel.styles._nnx import is_nnx

__all__ = ["measure_layouts", "compiled_peak", "compiled_warm", "peak_bytes", "settled", "NOISE"]

RACE = 0.10  # a candidate within this share of the fastest's median is timed again (see the module doc)
# the least noise of a measured median (``settled``): the spread of one candidate's median from run to run on a
# quiet host (docs/benchmarks.md: a round varies by several percent); more where the rounds spread more
NOISE = 0.05


class _Timed:
    """One candidate's compiled step, its state and batch, timed in rounds."""

    def __init__(self, model: Any, optimizer: Any, loss_of: Callable, params: Any, batch: Any, devices: list,
                 layout: Layout, compiled: Any = None):
        step, state, self.batch = _built(model, optimizer, loss_of, params, batch, devices, layout)
        self.compiled, self.state, _ = compiled_warm(step, state, self.batch, compiled)
        self.seconds: list[float] = []
        self.peak = peak_bytes(self.compiled)

    def round(self, steps: int) -> None:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, m = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, m))
        self.seconds.append((time.perf_counter() - t0) / steps)


def measure_layouts(model: Any, optimizer: Any, loss_of: Callable, params: Any, batch: Any, devices: list,
                    layouts: Sequence[Layout], *, rounds: int = 5, steps: int = 2, max_rounds: int = 15,
                    compiled: dict | None = None, progress: Callable | None = None,
                    spreads: dict | None = None) -> list[tuple[float, int]]:
    """``(seconds per step, peak bytes per device)`` of each of ``layouts``, measured (see the module doc), in
    their order.

    ``loss_of(laid_model)``: the loss of a laid-out model; ``params`` and ``batch``: arrays or shape
    structs (the step runs on ``host_pattern`` parameters and ``timed_batch``); ``compiled``: the steps ``compiled_peak`` compiled, by layout
    (not compiled again); ``progress(layout)``: called before each is built and compiled, and ``progress(None)`` before the rounds; ``spreads``: a dict
    given the uncertainty of each layout's median (``median_error`` of its rounds, seconds: ``settled``)."""
    where = "auto_layout"
    if max_rounds < rounds:
        raise ValueError(f"measure_layouts: max_rounds={max_rounds} must be >= rounds={rounds} (the race's rounds "
                         "come after the first rounds); give max_rounds=rounds for no race.")
    if jax.process_count() > 1:
        raise ValueError(f"{where}: measure= times candidates on this process's view of the devices, but "
                         f"{jax.process_count()} processes run; measure on one process (every process would have "
                         "to time the same candidates in the same order), or give measure=0.")
    compiled = compiled or {}
    timed = []
    for lay in layouts:
        if progress is not None:
            progress(lay)
        timed.append(_Timed(model, optimizer, loss_of, params, batch, devices, lay, compiled.get(lay)))
    if progress is not None:
        progress(None)
    for _ in range(rounds):
        for t in timed:
            t.round(steps)
    _race(timed, max_rounds - rounds, steps)
    if spreads is not None:
        for lay, t in zip(layouts, timed):
            spreads[lay] = median_error(t.seconds)
    return [(statistics.median(t.seconds), t.peak) for t in timed]


def _race(timed: list, more: int, steps: int) -> None:
    """Up to ``more`` rounds more for the candidates within ``RACE`` of the fastest median (see the module doc);
    each round's contenders are chosen again from every candidate's rounds so far."""
    for _ in range(more):
        med = [statistics.median(t.seconds) for t in timed]
        contenders = [t for t, m in zip(timed, med) if m <= (1 + RACE) * min(med)]
        if len(contenders) < 2:
            return
        for t in contenders:
            t.round(steps)


def simplicity(c: Any) -> tuple:
    """How simple a candidate's layout is, simplest first: its mesh dims over 1 (``dp=8`` before
    ``dp=4,tp=2``), then its bytes moved per device and step (the step's exact table), then its name."""
    return (sum(s > 1 for _, s in c.layout.mesh_dims), c.comm_bytes, c.name)


def median_error(seconds: list) -> float:
    """The standard error of the median of ``seconds`` (one candidate's timed rounds): ``sqrt(pi / 2) sigma /
    sqrt(n)`` for ``n`` rounds of spread ``sigma`` (the median's asymptotic variance under a normal spread), with
    ``sigma`` read robustly off the rounds as their interquartile range over 1.349 (a normal's IQR in sigmas):
    0.929 IQR / sqrt(n). 0 for fewer than two rounds."""
    if len(seconds) < 2:
        return 0.0
    q = statistics.quantiles(seconds, n=4, method="inclusive")  # exclusive ones widen a few rounds' IQR
    return math.sqrt(math.pi / 2) * (q[2] - q[0]) / 1.349 / math.sqrt(len(seconds))


def tie_margin(a: Any, b: Any) -> float:
    """How far apart measured ``a`` and ``b``'s medians may be and still be the host's noise (seconds): the
    larger of ``NOISE`` of ``a``'s and the standard error of their difference (the root of the sum of the
    squares of each median's ``median_error``, ``measure_layouts(spreads=)``)."""
    return max(NOISE * a.measured_s, math.hypot(a.measured_spread or 0.0, b.measured_spread or 0.0))


def tied(a: Any, b: Any) -> bool:
    """Whether measured ``b`` is no slower than measured ``a`` beyond the measurement's noise (``tie_margin``)."""
    return b.measured_s - a.measured_s <= tie_margin(a, b)


def settled(timed: list) -> list:
    """``timed`` (candidates, fitting first, ranked by measured time) with the fitting measured ones tied with
    the fastest measured (``tied``: their order is the host's noise, not theirs) put first, simplest first
    (``simplicity``); the others after them in their order. Stable from run to run where the fastest's median
    alone is not."""
    meas = [c for c in timed if c.fits and c.measured_s is not None]
    if not meas:
        return timed
    fastest = min(meas, key=lambda c: c.measured_s)
    tie = sorted((c for c in meas if tied(fastest, c)), key=simplicity)
    return tie + [c for c in timed if not any(c is t for t in tie)]


def compiled_warm(step: Any, state: Any, batch: Any, compiled: Any = None) -> tuple:
    """``(compiled, state after one step, relaid)``: ``step`` (a jitted train step) compiled for ``state`` and
    ``batch`` (or ``compiled``, that compile given) and run once (the warm-up). A step that returns its state
    laid out otherwise than it took it (seen: a tensor-parallel mesh's optimizer moment of a tp-replicated
    parameter coming out cut on tp) is compiled again for the state it returns, once (``relaid``), so that
    every timed call runs one program; one returned in equivalent shardings (the same cuts, the spec spelled
    without its trailing Nones) runs the same program, not compiled again."""
    before = [(x.sharding, x.ndim) for x in jax.tree.leaves(state)]
    compiled = step.lower(state, batch).compile() if compiled is None else compiled
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    # the same layout spelled otherwise (P('fsdp', None) back as P('fsdp',): every candidate's moments) is the
    # same program: not compiled again
    relaid = any(not s.is_equivalent_to(x.sharding, n) for (s, n), x in zip(before, jax.tree.leaves(state)))
    if relaid:
        compiled = step.lower(state, batch).compile()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
    return compiled, state, relaid


def peak_bytes(compiled: Any) -> int:
    """Peak bytes per device of a compiled step: ``argument + output + temp - alias`` of its ``memory_analysis()``."""
    return StepMemory.from_compiled(compiled).peak


def example_inputs(model: Any, batch: Any, pp: int = 1) -> tuple:
    """A linen model's inputs in ``batch`` (``batch["inputs"]``, as the default loss applies it), for its plan to
    see its ``nn.scan`` blocks; an nnx model's only under a pipeline (``pp > 1``: its stages find a scanned
    stack's layers from them; elsewhere its modules are seen as they are); none for another batch."""
    if (is_nnx(getattr(model, "module", model)) and pp == 1) or not (isinstance(batch, Mapping) and "inputs" in batch):
        return ()
    return (batch["inputs"],)


def _built(model: Any, optimizer: Any, loss_of: Callable, params: Any, batch: Any, devices: list, layout: Layout,
           *, abstract: bool = False) -> tuple:
    """``(step, state, batch)`` of ``layout`` through the contract: its state (``host_pattern`` of the parameters)
    and batch (``timed_batch``) laid out as the step takes them, or (``abstract``) their shape structs so laid out, nothing allocated. The step donates its state
    (``make_train_step(donate=True)``): calling it deletes the state passed in."""
    laid, mesh = apply_layout(model, devices, layout)
    # donated, as a training loop runs it (``state = step(state, batch)[0]``): the state held once, not in the
    # arguments and again in the outputs (torch's optimizer updates the parameters in place)
    step = make_train_step(laid, loss_of(laid), optimizer, accum_steps=layout.accum_steps, mesh=mesh, donate=True)
    rows = tuple(n for n in mesh.mesh_dim_names if n not in ("tp", "pp", "cp"))
    cp = "cp" in mesh.mesh_dim_names  # the sequence (dim 1 of a leaf of rank 2 or more) cut over cp

    def data(x):
        return NamedSharding(mesh.jax_mesh, P(rows, "cp") if cp and len(x.shape) >= 2 else P(rows))

    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    if abstract:
        state = jax.eval_shape(lambda: init_train_state(laid, optimizer, *example_inputs(model, structs[1], layout.pp),
                                                        params=structs[0], mesh=mesh))
        return step, state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=data(x)),
                                         structs[1])
    values = (host_pattern(structs[0]), timed_batch(batch))
    state = init_train_state(laid, optimizer, *example_inputs(model, values[1], layout.pp), params=values[0], mesh=mesh)
    return step, state, jax.tree.map(lambda x: jax.device_put(x, data(x)), values[1])


_PATTERN = 251  # the pattern's length: a prime, so that no row of a power-of-two dim repeats the one before it


def host_pattern(tree: Any) -> Any:
    """Finite, non-degenerate values of ``tree``'s leaves' shapes and dtypes as numpy arrays, built on the host
    (nothing compiled): a floating leaf ``_PATTERN`` values in ``[-0.01, 0.01)`` tiled over it, an integer one
    ones, a bool one True. The timed step's parameters: on zeros (``host_zeros``) its gradients were all zero
    and, with a batch of zeros, a loss divided by a mask's sum NaN, unlike any step a run times."""
    base = ((np.arange(_PATTERN) * 97 % _PATTERN) / _PATTERN - 0.5) * 0.02

    def one(x):
        if np.issubdtype(np.dtype(x.dtype), np.inexact):
            return np.resize(base.astype(x.dtype), x.shape)
        return np.ones(x.shape, x.dtype)

    return jax.tree.map(one, tree)


def timed_batch(batch: Any) -> Any:
    """The batch the timed step takes, on the host: the example batch's own values where it gives arrays (copied
    to the host, placed from there: nothing compiled), ones of a shape struct's shape and dtype (a token id,
    target and mask of 1: a finite loss)."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, (np.ndarray, jax.Array)) else
                        np.ones(x.shape, x.dtype), batch)


def compiled_peak(model: Any, optimizer: Any, loss_of: Callable, params: Any, batch: Any, devices: list,
                  layout: Layout, *, compiled: dict | None = None) -> int:
    """Peak bytes per device of ``layout``'s step compiled on shape structs (nothing allocated, nothing run), as
    ``measure_layouts`` gives it without the time; the compiled step kept in ``compiled`` by layout, for
    ``measure_layouts`` to time."""
    step, state, b = _built(model, optimizer, loss_of, params, batch, devices, layout, abstract=True)
    exe = step.lower(state, b).compile()
    if compiled is not None:
        compiled[layout] = exe
    return peak_bytes(exe)
