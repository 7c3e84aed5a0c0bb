"""What one device of a layout holds at its peak, estimated without compiling the layout's step (what it
computes: ``spmd.parallel.cost._compute_cost``; both read the user's model measured on one device: ``Profile``).

Memory (per device, bytes), as XLA's ``compiled.memory_analysis()`` counts a step that does not donate its
state (``argument + output + temp``):

- ``state``: the stored parameter shards plus the optimizer state (``ParamPlan`` local shapes), in the
  arguments and again in the outputs;
- ``batch``: the device's slice of the batch (an argument);
- ``gathered``: the gathered parameters alive at once (``ParamPlan.peak_gathered_bytes``: the root unit and
  the largest other unit when re-gathering for the backward pass, every unit when kept or accumulating);
- ``gathered_grads``: under FSDP, the unit gradients alive before their reduce-scatters, x (1 - 1/fsdp):
  re-gathering, ``REGATHERED_GRADS`` x the largest unit's (its backward pass runs between its re-gather and
  its reduce-scatters, one unit at a time: ``Hooks.call_unit``; XLA reduce-scatters each gradient as soon as
  it is computed, so few are alive at once); keeping, or under accumulation (the reduce-scatters follow the
  loop), 0.4 x the gathered bytes of every unit;
- ``accumulated_grads``: under gradient accumulation with FSDP, the loop's carry of the gradients FSDP
  cuts, whole (every unit's gathered bytes), reduce-scattered once after the last micro-batch (a carry of
  the stored shape, without FSDP or for a parameter FSDP leaves whole, XLA keeps in an output's buffer);
- ``work``: XLA's temp bytes of the user's whole step (gradient and optimizer update; under accumulation
  the gradient alone, the loop's body) on one device and one micro-batch (activations, work buffers); under
  tensor parallelism those of the layout's tensor-parallel part compiled on its own group
  (``spmd.parallel.auto._tp_profile``; without it, the one-device step's times the square root of the
  activations' tensor-parallel share). Where units are re-gathered for their backward pass (each under
  ``jax.checkpoint`` saving its matmul outputs), what that schedule holds in place of the step's temp: the
  saved matmul outputs of every unit (the one-device residuals under ``dots_saveable``, cut over tp as
  below), less those XLA's buffer assignment parks in the step's output buffers before their final values
  are written (``parked_bytes``: one saved output in each output buffer at least as large), plus
  ``RECOMPUTED`` x one unit's other residuals, which its backward pass recomputes. A sequence-parallel or
  weight-stationary layout's layers compute the plain plan's matmul outputs on each device (the input
  gathered first), so they are counted as the plain plan's;
- ``activations`` (reported, inside ``work``): the residuals the backward pass reads (the ``jax.vjp``
  closure of the user's loss on one micro-batch, one device, parameters taken out), the tensor-parallel
  part divided by ``tp``: a residual holding a dim a tensor-parallel cut splits (heads, the MLP's hidden
  features), every batch- and sequence-shaped residual under sequence parallelism.

FSDP keeping its units (``reshard_after_forward=False``, no accumulation): the one-device step's temp bytes
are not all its activations. Its state is not donated, so its outputs (the new parameters and optimizer
state) are buffers of their own, and XLA's buffer assignment parks activations in them before their final
values are written. A layout whose outputs are as large (``dp``, and ``tp``'s part on its group) parks the
same; an FSDP layout's outputs are ``1/fsdp`` of them, so its activations go to temp. So a keeping layout's
work and unit gradients together are at least the donated gradient's temp bytes times the activations'
tensor-parallel share, less ``PARKED_IN_OUTPUTS`` of the layout's own outputs. Re-gathering layouts save
the matmul outputs alone and are not given the term, nor is a step under a checkpointing policy (measured
as its own step).

``REGATHERED_GRADS``, ``RECOMPUTED``, ``PARKED_IN_OUTPUTS`` and the 0.4 above are empirical factors of XLA's
buffer assignment and scheduling; the compiled peaks they are checked against: docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from placements import Shard

from spmd.parallel.cost._calibrate import program_ops

__all__ = ["Profile", "memory_breakdown", "activation_bytes", "parked_bytes", "READ_ONLY"]

# the compiler options of a program compiled only to read its memory_analysis, cost analysis or optimized HLO:
# XLA's HLO passes and buffer assignment run before LLVM generates the code, which such a program never runs
# (the same numbers, compiled faster)
READ_ONLY = {"xla_backend_optimization_level": 0}

# FSDP keeping its units: the share of the layout's own outputs (its parameter and optimizer-state shards) XLA
# still parks activations in: an empirical factor of XLA's buffer assignment (docs/benchmarks.md)
PARKED_IN_OUTPUTS = 0.6

# units re-gathered for their backward pass: the share of one unit's recomputed residuals (those other than its
# matmul outputs) alive at once in its backward pass, and of its gathered gradients before their
# reduce-scatters: empirical factors of XLA's scheduling and buffer assignment (docs/benchmarks.md)
RECOMPUTED = 0.6
REGATHERED_GRADS = 0.1


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled program (XLA's ``cost_analysis``)."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def _median_seconds(fn: Callable, args: tuple, rounds: int) -> float:
    """The median wall seconds of ``fn(*args)`` over ``rounds`` calls after two warm-up calls (compile)."""
    import statistics
    import time

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    got = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        got.append(time.perf_counter() - t0)
    return statistics.median(got)


def _update(opt: Any, grads: Any, state: Any, params: Any) -> tuple:
    """The optimizer's step: ``(params + updates, new state)``."""
    u, state = opt.update(grads, state, params)
    return jax.tree.map(jnp.add, params, u), state


def _on_every_device(fn: Callable, devices: list, args: tuple, rounds: int, batch_args: int = 1) -> float:
    """The median seconds of ``fn`` (one device's program) run on every device of ``devices`` at once: a
    ``shard_map`` over them, the last ``batch_args`` of ``args`` (shape structs) cut on their leading dim,
    the others whole on each device, zeros."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("_profile",))
    specs = tuple(P() if i < len(args) - batch_args else P("_profile") for i in range(len(args)))
    out = jax.eval_shape(fn, *[jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (x.shape[0] // len(devices), *x.shape[1:]) if s != P() else x.shape, x.dtype), a) for a, s in zip(args, specs)])
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=jax.tree.map(lambda _: P(), out),
                              check_vma=False))
    zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)  # noqa: E731
    vals = tuple(jax.device_put(jax.jit(lambda a=a: zeros(a))(), NamedSharding(mesh, s)) for a, s in zip(args, specs))
    return _median_seconds(f, vals, rounds)


def _scalar_loss(loss_fn: Callable) -> Callable:
    def f(p, b):
        out = loss_fn(p, b)
        return out[0] if isinstance(out, tuple) else out

    return f


class Profile:
    """The user's model on one device, measured once per micro-batch size (shared by every candidate)."""

    def __init__(self, loss_fn: Callable, params: Any, optimizer: Any, step_loss: Callable | None = None):
        self.loss = _scalar_loss(loss_fn)
        # the loss as the model's train step takes it (an nnx model's: loss(model, batch)); default loss_fn
        self.step_loss = _scalar_loss(step_loss) if step_loss is not None else self.loss
        self.params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        self.optimizer = optimizer
        self._grad: dict = {}
        self._res: dict = {}
        self._opt: tuple | None = None
        self._timed: dict = {}
        self.param_bytes = _nbytes(self.params)

    @staticmethod
    def _key(batch: Any) -> tuple:
        return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))

    def _fn(self) -> Callable:
        opt, loss = self.optimizer, self.loss

        def step(p, s, b):
            g = jax.grad(loss)(p, b)
            return _update(opt, g, s, p)

        return step

    def _step(self, batch: Any) -> tuple[float, float, int, int]:
        """(flops, bytes accessed, XLA temp bytes, operations) of the whole step (loss, gradient, optimizer
        update) on ``batch``, one device, compiled once per batch shape."""
        k = self._key(batch)
        if k not in self._grad:
            with jax.default_device(jax.devices()[0]):
                comp = jax.jit(self._fn()).lower(self.params, jax.eval_shape(self.optimizer.init, self.params),
                                                 batch).compile(READ_ONLY)
            temp = int(getattr(comp.memory_analysis(), "temp_size_in_bytes", 0) or 0)
            self._grad[k] = (*_cost(comp), temp, program_ops(comp.as_text()))
        return self._grad[k]

    def ops(self, batch: Any) -> int:
        """The operations the one-device gradient on ``batch`` launches (``program_ops`` of the step less of
        the optimizer's update)."""
        return max(self._step(batch)[3] - self._optimizer()[2], 0)

    def grad_seconds(self, batch: Any, devices: list, *, rounds: int = 9) -> float:
        """Seconds of the loss's gradient on ``batch``, one device's, run on every device of ``devices`` at
        once (see the module doc): a ``shard_map`` over them, no collective, the median of ``rounds`` timed
        calls after a warm-up; measured once per batch shape and device set."""
        k = ("grad", self._key(batch), tuple(d.id for d in devices))
        if k not in self._timed:
            n = len(devices)
            data = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n * x.shape[0], *x.shape[1:]), x.dtype), batch)
            self._timed[k] = _on_every_device(jax.grad(self.loss), devices, (self.params, data), rounds)
        return self._timed[k]

    def optimizer_seconds(self, shards: Any, devices: list, *, rounds: int = 5) -> float:
        """Seconds of the optimizer's update of parameters shaped ``shards`` (a tree of shape structs like the
        parameters': a layout's shards on one device), one device's, run on every device of ``devices`` at
        once (see the module doc); measured once per shapes and device set."""
        shards = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), shards)
        k = ("optimizer", self._key(shards), tuple(d.id for d in devices))
        if k not in self._timed:
            opt = self.optimizer
            state = jax.eval_shape(opt.init, shards)
            self._timed[k] = _on_every_device(lambda p, g, s: _update(opt, g, s, p), devices,
                                              (shards, shards, state), rounds, batch_args=0)
        return self._timed[k]

    def grad_cost(self, batch: Any) -> tuple[float, float]:
        """(flops, bytes accessed) of the loss and its gradient on ``batch``, one device (the step's less the
        optimizer's)."""
        f, b = self._step(batch)[:2]
        of, ob = self.optimizer_cost()
        return max(f - of, 0.0), max(b - ob, 0.0)

    def temp_bytes(self, batch: Any) -> int:
        """XLA's temp bytes of the whole step on ``batch``, one device: the activations and work buffers."""
        return self._step(batch)[2]

    def grad_temp_bytes(self, batch: Any, *, donated: bool = False) -> int:
        """XLA's temp bytes of the loss's gradient alone on ``batch``, one device (the body of an accumulating
        step's loop over its micro-batches, the optimizer's update outside it); ``donated``: the parameters
        donated, the gradient written over them (no output buffer free to park activations in)."""
        k = ("grad", self._key(batch), donated)
        if k not in self._grad:
            with jax.default_device(jax.devices()[0]):
                comp = jax.jit(jax.grad(self.loss), donate_argnums=(0,) if donated else ()).lower(
                    self.params, batch).compile(READ_ONLY)
            self._grad[k] = int(getattr(comp.memory_analysis(), "temp_size_in_bytes", 0) or 0)
        return self._grad[k]

    def optimizer_cost(self) -> tuple[float, float]:
        """(flops, bytes accessed) of one optimizer update on the whole (unsharded) parameters."""
        return self._optimizer()[:2]

    def _optimizer(self) -> tuple[float, float, int]:
        """(flops, bytes accessed, operations) of one optimizer update on the whole parameters, one device."""
        if self._opt is None:
            opt = self.optimizer
            state = jax.eval_shape(opt.init, self.params)
            with jax.default_device(jax.devices()[0]):
                comp = jax.jit(lambda p, g, s: _update(opt, g, s, p)).lower(self.params, self.params, state).compile(
                    READ_ONLY)
            self._opt = (*_cost(comp), program_ops(comp.as_text()))
        return self._opt

    def residuals(self, batch: Any, *, dots_only: bool = False) -> list:
        """The activations the backward pass reads (shape structs), parameters taken out; ``dots_only``: under
        ``jax.checkpoint`` saving the matmul outputs alone (the policy of a unit re-gathered for its backward
        pass, ``spmd.parallel.styles._hooks``)."""
        k = (self._key(batch), dots_only)
        if k not in self._res:
            loss = self.loss
            if dots_only:
                loss = jax.checkpoint(loss, policy=jax.checkpoint_policies.dots_saveable)
            res = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b), p)[1], self.params, batch)
            params = Counter(tuple(x.shape) for x in jax.tree.leaves(self.params))
            b = jax.tree.leaves(batch)[0].shape[0]
            out = []
            for x in jax.tree.leaves(res):
                s = tuple(x.shape)
                if params.get(s):
                    params[s] -= 1
                    continue
                if len(s) >= 1 and s[0] == b:
                    out.append(x)
            self._res[k] = out
        return self._res[k]


def _tp_sizes(plan, tp: str | None) -> set[int]:
    """The sizes of the dims a tensor-parallel cut splits (heads, hidden features, vocabulary)."""
    if tp is None or tp not in plan.mesh_dim_names:
        return set()
    ti = plan.mesh_dim_names.index(tp)
    return {e.shape[e.placements[ti].dim] for e in plan.entries if isinstance(e.placements[ti], Shard)}


def _split_sizes(residuals: list, plan, tp: str | None, n_tp: int, sequence_parallel: bool) -> list[int]:
    """Each residual's bytes on one device: divided by ``tp`` where a tensor-parallel cut splits it."""
    cut = _tp_sizes(plan, tp)
    out = []
    for x in residuals:
        nb = _nbytes(x)
        split = n_tp > 1 and ((sequence_parallel and len(x.shape) >= 3) or any(d in cut for d in x.shape[1:]))
        out.append(nb // n_tp if split else nb)
    return out


def activation_bytes(residuals: list, plan, tp: str | None, n_tp: int, sequence_parallel: bool) -> int:
    return sum(_split_sizes(residuals, plan, tp, n_tp, sequence_parallel))


def parked_bytes(buffers: list[int], outputs: list[int]) -> int:
    """The bytes of ``buffers`` (alive at once) that XLA's buffer assignment can place in the step's output
    buffers before their final values are written: each buffer in one output at least as large, the largest
    buffers first, each in the smallest free output that holds it."""
    free = sorted(outputs)
    parked = 0
    for nb in sorted(buffers, reverse=True):
        i = bisect.bisect_left(free, nb)
        if i < len(free):
            free.pop(i)
            parked += nb
    return parked


def memory_breakdown(profile: Profile, plan, model, micro_batch: Any, local_batch_bytes: int, *, accum_steps: int,
                     sequence_parallel: bool, tp_temp: int | None = None) -> dict:
    """Peak bytes per device by kind (see the module doc) and ``"peak"``, their sum. ``tp_temp``: the temp bytes
    of the layout's tensor-parallel part measured on its group (``spmd.parallel.auto._tp_profile``), the work's
    base in place of the one-device step's scaled by the activations' share."""
    local = [jax.ShapeDtypeStruct(e.local_shape, e.dtype) for e in plan.entries]
    params = plan.bytes_per_device
    opt_state = jax.tree.leaves(jax.eval_shape(profile.optimizer.init, local))
    opt = _nbytes(opt_state)
    fsdp = model.fsdp
    n_fsdp = plan.mesh_size(fsdp.shard_dim) if fsdp else 1
    regather = bool(fsdp and fsdp.reshard_after_forward)
    gathered = plan.peak_gathered_bytes(regather=regather, accum_steps=accum_steps) if fsdp and n_fsdp > 1 else 0
    tp = model.tp.mesh_dim if model.tp else None
    n_tp = plan.mesh_size(tp) if tp else 1
    res = profile.residuals(micro_batch)
    full = _nbytes(res)
    split = activation_bytes(res, plan, tp, n_tp, sequence_parallel)
    total_gathered = sum(plan.gathered_bytes(u) for u in plan.units) if fsdp and n_fsdp > 1 else 0
    one_unit = max((plan.gathered_bytes(u) for u in plan.units), default=0) if fsdp and n_fsdp > 1 else 0
    if regather and n_fsdp > 1 and accum_steps == 1 and getattr(profile, "policy", None) is None:
        # the units run under jax.checkpoint, matmul outputs saved (under a policy: measured in its profile);
        # their layers compute the plain plan's matmul outputs (sequence-parallel and weight-stationary too)
        saved = _split_sizes(profile.residuals(micro_batch, dots_only=True), plan, tp, n_tp, False)
        every = activation_bytes(res, plan, tp, n_tp, False)
        outputs = [_nbytes(x) for x in local] + [_nbytes(x) for x in opt_state]
        blocks = max(len(plan.units) - 1, 1)
        work = int(sum(saved) - parked_bytes(saved, outputs) + RECOMPUTED * (every - sum(saved)) / blocks)
        unit_grads = int(REGATHERED_GRADS * one_unit * (1 - 1 / n_fsdp))
    else:
        if tp_temp is not None:
            work = float(tp_temp)
        else:
            temp = profile.temp_bytes(micro_batch) if accum_steps == 1 else profile.grad_temp_bytes(micro_batch)
            work = temp * math.sqrt(split / full if full else 1.0)
        work = int(work)
        unit_grads = int((one_unit if regather and accum_steps == 1 else 0.4 * total_gathered) * (1 - 1 / n_fsdp))
    if fsdp and n_fsdp > 1 and not regather and accum_steps == 1 and getattr(profile, "policy", None) is None:
        # kept units: the activations XLA parks in the one-device step's outputs go to temp (the module doc)
        unparked = profile.grad_temp_bytes(micro_batch, donated=True) * (split / full if full else 1.0)
        work = max(work, int(unparked - PARKED_IN_OUTPUTS * (params + opt)) - unit_grads)
    out = {"state": 2 * (params + opt), "batch": local_batch_bytes, "work": work, "gathered": gathered,
           "gathered_grads": unit_grads,
           "accumulated_grads": total_gathered if accum_steps > 1 else 0}
    out["peak"] = sum(out.values())
    out["params"], out["optimizer"], out["activations"] = params, opt, split
    return out
