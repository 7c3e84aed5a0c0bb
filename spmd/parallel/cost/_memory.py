"""What one device of a layout holds at its peak: a lower bound from shapes, and the compiled step's own
figures (what it computes: ``spmd.parallel.cost._compute_cost``; both read the user's model on one device:
``Profile``).

The peak of a step is XLA's: ``argument + output + temp - alias`` of the compiled step's
``memory_analysis()`` (``StepMemory``), read by ``auto_layout`` for every candidate that survives the bound
(``spmd.parallel.auto._compiled``). Nothing here is fitted: the bound, ``memory_floor``, is what any
program of the layout must hold, from shapes alone:

- ``state``: the stored parameter shards plus the optimizer state (``ParamPlan`` local shapes), held once: the
  step the planner compiles donates its state (``make_train_step(donate=True)``, as a training loop runs it),
  so the new state is written into the old one's buffers (``alias`` of ``memory_analysis()``);
- ``batch``: the device's slice of the batch (an argument);
- ``activations``: the matmul outputs the backward pass reads (the ``jax.vjp`` closure of the user's loss on one
  micro-batch, one device, under ``jax.checkpoint`` saving the matmul outputs, parameters taken out): without
  a checkpointing policy or under ``"dots"`` (and in FSDP units re-gathered for their backward pass, which
  save them) every one is kept until its backward pass (XLA may fuse an elementwise residual into the
  backward pass that reads it, recomputing it there, so the others are no bound; a matmul it does not
  recompute); under ``"full"`` (and ``"offload"``, whose residuals leave the device) none counted (a unit's
  inputs only); under another policy what it saves applied to the whole loss. In the compute dtype (2 bytes a
  float under a bfloat16 mixed precision), divided by ``tp`` (a residual is cut at most ``tp`` ways). They
  are temporaries: the step's outputs are the donated state's own buffers, live from the start (the forward
  pass reads the parameters), so no residual can be placed in them.

``peak`` is that sum; it never exceeds the compiled peak (``tests/parallel/auto/test_auto_compiled.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spmd.parallel.cost._affine import InBatch
from spmd.parallel.cost._calibrate import program_ops
from spmd.parallel.cost._flops import param_matmul_flops
from spmd.parallel.cost._loops import loop_extra
from spmd.parallel.styles._remat import checkpoint_policy

__all__ = ["Profile", "memory_floor", "READ_ONLY", "BF16_READ_ONLY"]

# the compiler options of a program compiled only to read its memory_analysis, cost analysis or optimized HLO:
# XLA's HLO passes and buffer assignment run before LLVM generates the code, which such a program never runs
# (the same numbers, compiled faster)
READ_ONLY = {"xla_backend_optimization_level": 0,
             # XLA:CPU promotes a bfloat16 all-reduce to float32 (its runtime reduces in f32) and aborts the process
             # on one whose reduction is a copy (jax 0.10); a program only read is never run here, and a GPU's
             # collectives reduce bfloat16 as it is: the pass is left out
             "xla_disable_hlo_passes": "all-reduce-promotion"}

# READ_ONLY for hardware that runs bfloat16 as it is (a GPU, a TPU: ``auto_layout(hardware=)`` whose matmul rates
# include bfloat16; ``spmd.parallel.auto._compiled.bf16_memory``). XLA:CPU's FloatNormalization pass
# ("float-normalization-bf16", CpuFloatSupport) rewrites each bfloat16 op it cannot lower (every dot, and the
# elementwise ops and reductions around them) to float32 between converts, so a bfloat16 program compiled here
# holds float32 buffers twice the size of an accelerator's: its matmul outputs, the logits and the loss's
# [tokens, vocab] buffers. Left out here, the dots go to oneDNN one by one ("INDIVIDUAL_DOT": as a GPU's cuBLAS
# calls, nothing fused into them), which takes bfloat16; the program's buffers are then those of its own dtypes.
BF16_READ_ONLY = {**READ_ONLY, "xla_disable_hlo_passes": "all-reduce-promotion,float-normalization-bf16",
                  "xla_cpu_use_onednn": True,
                  "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def host_zeros(tree: Any) -> Any:
    """Zeros of ``tree``'s leaves' shapes and dtypes as numpy arrays: placed from the host, nothing compiled (a
    jitted zeros is one more compile), their pages mapped lazily."""
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)


def _cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled program: XLA's ``cost_analysis``, plus what its loops' other trips
    add (XLA counts a ``while`` body once: ``spmd.parallel.cost._loops``), so an ``nn.scan`` stack costs what
    its unrolled layers do."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    f, b = loop_extra(compiled.as_text())
    return float(c.get("flops", 0.0)) + f, max(float(c.get("bytes accessed", 0.0)) + b, 0.0)


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
    # zeros placed from the host, one buffer per leaf: a jitted zeros was one more compile per argument (3 of an
    # optimizer's update, 2 of the gradient)
    vals = tuple(jax.device_put(host_zeros(a), NamedSharding(mesh, s)) for a, s in zip(args, specs))
    return _median_seconds(f, vals, rounds)


def _rows(batch: Any) -> str:
    """A batch's shape as the progress names it: ``16x8 rows`` (its first leaf's)."""
    return "x".join(map(str, jax.tree.leaves(batch)[0].shape)) + " rows"


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
        self.in_batch = InBatch(self.loss, self.params)  # the step's cost at new rows from two compiled
        self.progress: Callable[[str], None] | None = None  # told what is compiled or timed, before it starts

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

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
        update) on ``batch``, one device, compiled once per batch shape, or derived from two compiles at other
        rows where that is exact (``spmd.parallel.cost._affine``: no temp bytes then)."""
        k = self._key(batch)
        if k not in self._grad and (got := self.in_batch.derived(batch)) is not None:
            self._grad[k] = got  # from two compiles at other rows (spmd.parallel.cost._affine)
        if k not in self._grad:
            self._say(f"compiling its one-device step at {_rows(batch)}")
            with jax.default_device(jax.devices()[0]):
                comp = jax.jit(self._fn()).lower(self.params, jax.eval_shape(self.optimizer.init, self.params),
                                                 batch).compile(READ_ONLY)
            temp = int(getattr(comp.memory_analysis(), "temp_size_in_bytes", 0) or 0)
            self._grad[k] = (*_cost(comp), temp, program_ops(comp.as_text()))
            self.in_batch.compiled(batch, self._grad[k])
        return self._grad[k]

    def param_matmul_flops(self, batch: Any) -> list[float]:
        """Per parameter leaf, the forward flops of the loss's matmuls that read it on ``batch``
        (``spmd.parallel.cost._flops.param_matmul_flops``), traced once per batch shape."""
        k = ("matmuls", self._key(batch))
        if k not in self._res:
            self._res[k] = param_matmul_flops(self.loss, self.params, batch)
        return self._res[k]

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
            self._say(f"timing the one-device gradient at {_rows(batch)} on {n} devices at once")
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

    def residuals(self, batch: Any, *, dots_only: bool = False, policy: str | None = None) -> list:
        """The activations the backward pass reads (shape structs), parameters taken out; ``dots_only``: under
        ``jax.checkpoint`` saving the matmul outputs alone (what a unit re-gathered for its backward pass keeps
        at least: ``spmd.parallel.styles._fully_shard._saved``); ``policy``: under that activation-checkpointing
        policy's (``spmd.parallel.styles._remat.POLICIES``), applied to the whole loss."""
        policy = "dots" if dots_only and policy is None else policy
        k = (self._key(batch), policy)
        if k not in self._res:
            loss = self.loss
            if policy is not None:
                loss = jax.checkpoint(loss, policy=checkpoint_policy(policy))
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




def _floats_at(xs: list, itemsize: int | None) -> int:
    """Bytes of the shape structs ``xs``, each floating one at ``itemsize`` bytes an element where given."""
    return sum(math.prod(x.shape) * (itemsize if itemsize and np.issubdtype(x.dtype, np.floating)
                                     else np.dtype(x.dtype).itemsize) for x in xs)


def memory_floor(profile: Profile, plan, micro_batch: Any, local_batch_bytes: int, *, tp: int = 1,
                 policy: str | None = None, compute_dtype: Any = None) -> dict:
    """The lower bound on a layout's peak bytes per device, by kind (see the module doc), and ``"peak"``, their
    sum. ``plan``: the layout's ``ParamPlan``; ``micro_batch``: one micro-batch on one device (shape structs);
    ``policy``: the checkpointing policy its blocks run under (``None`` or one of ``POLICIES``); ``compute_dtype``: the mixed
    precision's compute dtype (its activations' bytes), or None."""
    local = [jax.ShapeDtypeStruct(e.local_shape, e.dtype) for e in plan.entries]
    params = plan.bytes_per_device
    opt = _nbytes(jax.tree.leaves(jax.eval_shape(profile.optimizer.init, local)))
    size = jnp.dtype(compute_dtype).itemsize if compute_dtype is not None else None
    # a policy's own residuals (the whole loss under it: a unit's are no more than the code around it keeps);
    # none at all and "dots" both keep every matmul output at least; "full" none, "offload" none on the device
    res = [] if policy in ("full", "offload") else profile.residuals(
        micro_batch, policy="dots" if policy is None else policy)
    acts = _floats_at(res, size) // max(tp, 1)
    out = {"state": params + opt, "batch": local_batch_bytes, "activations": acts}  # the state donated: held once
    out["peak"] = sum(out.values())
    out["params"], out["optimizer"], out["compiled"] = params, opt, False
    return out
