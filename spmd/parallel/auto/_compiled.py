"""A candidate's figures from its own compiled step: ``memory_analysis()`` and ``cost_analysis()``, nothing run.

``auto_layout`` compiles each candidate that survives the lower bound (``spmd.parallel.cost._memory
.memory_floor``) once, through the contract (``apply_layout`` + ``init_train_state`` + ``make_train_step``) on
shape structs: nothing is allocated, so a plan for 64 or 256 devices is compiled on CPU fake devices. Read from
the compiled step:

- **memory**: ``argument + output + temp - alias`` (``StepMemory``), XLA's own peak per device, of the step
  donating its state (``make_train_step(donate=True)``, as a training loop runs it and as torch updates in
  place): the new state written into the old one's buffers (``alias``), held once;
- **compute**: ``flops`` and ``bytes accessed`` of XLA's cost analysis of the partitioned (per-device)
  program. XLA counts a loop's body once, whatever its trip count: a loop of known trip count (an ``nn.scan``
  stack of blocks, and a step's gradient-accumulation loop) has its other trips added from the HLO
  (``spmd.parallel.cost._loops``): an accumulating step is costed as its own program, once compiled (its
  micro-batches' work, the accumulator's traffic each micro-batch, the optimizer's update once).

The program is compiled with LLVM's code generation unoptimized (``READ_ONLY``: XLA's HLO passes, buffer
assignment and cost analysis run before it, so the numbers are those of the optimized compile).

``hardware=`` with a bfloat16 matmul rate (``auto_layout(hardware=)``: a GPU, a TPU): the memory is
that of the program compiled once more without XLA:CPU's bfloat16 normalization (``BF16_READ_ONLY``: XLA:CPU
otherwise computes every bfloat16 dot, and what surrounds it, in float32, holding buffers twice an
accelerator's; Llama 3 8B dp=8,fsdp=8 bf16 at 1 layer: 18.97 GiB so, 11.16 without), read off its buffer
assignment (``bf16_memory``); the flops and bytes stay the first compile's.

``extrapolated``: with ``auto_layout(depth=)`` every figure of a candidate (its table, bounds, compiled peak and
cost) is read on the model at 1 and 2 repeated blocks and carried to the model's own count affinely,
``x(L) = x(1) + (L - 1) (x(2) - x(1))``: exact for what one more block adds (its state, its residuals, its
collectives), and for what does not grow with the depth (a unit's gathered parameters, the work buffers of one
block's backward pass) constant.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import tempfile
from dataclasses import replace
from typing import Any, Callable

from spmd.parallel.auto._layout import Layout
from spmd.parallel.auto._measure import _built
from spmd.parallel.cost._memory import BF16_READ_ONLY, READ_ONLY, _cost
from spmd.parallel.step._protocol import StepMemory

__all__ = ["compile_figures", "extrapolated", "bf16_memory", "buffer_assignment_memory"]


def compile_figures(model: Any, optimizer: Any, loss_of: Callable, params: Any, batch: Any, devices: list,
                    layout: Layout, *, keep: dict | None = None, built: tuple | None = None,
                    hardware: Any = None) -> dict:
    """``{"memory": StepMemory, "flops", "bytes"}`` of ``layout``'s step compiled on shape structs (see the
    module doc). ``keep``: a dict the fully optimized executable is kept in, by layout (to be timed after:
    ``auto_layout(measure=)``); otherwise compiled to be read only. ``built``: the ``(step, state, batch)``
    of this layout already traced (``evaluate_layout(built=)``), lowered from its trace. ``hardware``: the
    ``Hardware`` planned for; one with a bfloat16 matmul rate runs bfloat16 as it is (the memory of a program
    with bfloat16 is then ``bf16_memory``'s)."""
    step, state, b = built or _built(model, optimizer, loss_of, params, batch, devices, layout, abstract=True)
    lowered = step.lower(state, b)
    exe = lowered.compile() if keep is not None else lowered.compile(READ_ONLY)
    if keep is not None:
        keep[layout] = exe
    mem = StepMemory.from_compiled(exe)
    if hardware is not None and "bfloat16" in hardware.matmul_flops and "bf16" in lowered.as_text():
        mem = bf16_memory(lowered)
    flops, nbytes = _cost(exe)  # an accumulation loop's other trips added (cost._loops)
    return {"memory": mem, "flops": flops, "bytes": nbytes}


def buffer_assignment_memory(text: str) -> StepMemory:
    """The ``StepMemory`` of XLA's buffer assignment as its dump prints it (``*-buffer-assignment.txt``): each
    ``allocation N: size S, ...`` line an entry parameter's (argument), a maybe-live-out one's (output; both:
    alias) or another (temp; constants and thread-local ones aside), as ``memory_analysis()`` sums them."""
    arg = out = alias = temp = 0
    for line in text.splitlines():
        m = re.match(r"allocation \d+: size (\d+), (.*)", line)
        if not m:
            continue
        size, kind = int(m.group(1)), m.group(2)
        param, live = "parameter " in kind, "maybe-live-out" in kind or "output shape" in kind
        arg += size if param else 0
        out += size if live else 0
        alias += size if param and live else 0
        temp += size if not (param or live or "constant" in kind or "thread-local" in kind) else 0
    return StepMemory(arg, out, temp, alias)


def bf16_memory(lowered: Any) -> StepMemory:
    """The memory of ``lowered`` compiled as hardware running bfloat16 would hold it (``BF16_READ_ONLY``: see
    the module doc). XLA:CPU then has no code for some bfloat16 ops (a bfloat16 all-reduce: the loss's psum,
    tensor parallelism's activations) and refuses the program after its buffers are assigned: the figures are
    read off that buffer assignment, dumped (``xla_dump_to``), as ``memory_analysis()`` would sum them."""
    where = tempfile.mkdtemp(prefix="spmd_bf16_")
    try:
        try:
            return StepMemory.from_compiled(lowered.compile({**BF16_READ_ONLY, "xla_dump_to": where}))
        except Exception as e:  # noqa: BLE001 (XLA's runtime error: no code for a bfloat16 op)
            found = sorted(glob.glob(os.path.join(where, "*buffer-assignment.txt")))
            if not found:
                raise RuntimeError("auto_layout: the step compiled without XLA:CPU's bfloat16 normalization (to "
                                   "read the memory of hardware running bfloat16) failed before its buffers "
                                   f"were assigned: {e}") from e
            with open(found[-1]) as f:
                return buffer_assignment_memory(f.read())
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _affine(a: Any, b: Any, blocks: int) -> Any:
    if isinstance(a, dict):
        return {k: _affine(a[k], b[k], blocks) if k in b else a[k] for k in a}
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return a
    if not (math.isfinite(a) and math.isfinite(b)):  # an untraced candidate's time: none
        return max(a, b)
    got = a + (blocks - 1) * (b - a)
    return int(round(got)) if isinstance(a, int) and isinstance(b, int) else got


def extrapolated(one: Any, two: Any, blocks: int, budget: int | None, roofline: Callable | None = None) -> Any:
    """The ``Candidate`` of a model of ``blocks`` repeated blocks from its candidates ``one`` and ``two`` at 1
    and 2 blocks (see the module doc); ``fits`` judged again under ``budget``. ``roofline(layout, flops,
    bytes) -> seconds``: where both were compiled (their ``bytes_accessed`` known), the compute is the
    roofline of the carried flops and bytes (the roofline of the deep program, not the carried rooflines of
    the slices, which a slice bound by its bytes and the other by its flops would bend)."""
    mem = _affine(one.memory, two.memory, blocks)
    peak = None if one.measured_peak is None else _affine(one.measured_peak, two.measured_peak, blocks)
    fits = budget is None or (peak if peak is not None else mem["peak"]) <= budget
    comm_s = _affine(one.comm_s, two.comm_s, blocks)
    flops = _affine(one.flops, two.flops, blocks)
    compute, nbytes = _affine(one.compute_s, two.compute_s, blocks), None
    predicted = _affine(one.predicted_s, two.predicted_s, blocks)
    if roofline is not None and one.bytes_accessed is not None and two.bytes_accessed is not None:
        nbytes = _affine(one.bytes_accessed, two.bytes_accessed, blocks)
        compute = roofline(one.layout, flops, nbytes)
        predicted = compute + sum(comm_s.values()) + _affine(one.dispatch_s, two.dispatch_s, blocks)
    return replace(one, predicted_s=predicted, compute_s=compute, comm_s=comm_s,
                   communication=_affine(one.communication, two.communication, blocks), memory=mem,
                   flops=flops, measured_peak=peak, fits=fits, bytes_accessed=nbytes)
