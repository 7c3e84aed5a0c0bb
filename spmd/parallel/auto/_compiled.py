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
cost) is read on the model at 3 and 4 repeated blocks (``slice_depths``; the model's own count and one less for
a model of fewer than 4) and carried to the model's own count affinely, ``x(L) = x(3) + (L - 3) (x(4) - x(3))``
(``carried``): exact for what one more block adds (its state, its residuals, its collectives), and for what does
not grow with the depth (a unit's gathered parameters, the work buffers of one block's backward pass) constant.
The flops, bytes and table are affine from one block on, but the peak is steady only once the block added is a
middle one: the first block takes the embedding's output, the last hands its own to the loss, and XLA
schedules, fuses and keeps their buffers otherwise (the peak's step 1 -> 2 is the last block's, 2 -> 3 the first
middle block's). Measured: a Transformer (d_model 32, 16 x 16 tokens) under fsdp=8 re-gathering, the peak's
step 141,600 B from 1 to 2 blocks, 106,464 from 2 to 3, 122,912 from 3 to 4 and every step after (8 blocks:
+12.2% carried from 1 and 2, -7.8% from 2 and 3, exact from 3 and 4); Llama 3 70B, fsdp=32,tp=8, sequence
parallel, full checkpointing saving nothing else: 0.91 GiB from 1 to 2 layers, 0.163 from 2 to 3 (83 GiB
carried to 80 layers from 1 and 2, 24.9 from 2 and 3). The two slices compile side by side (``auto_layout``):
wall time that of the 4-block one.
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

__all__ = ["compile_figures", "extrapolated", "carried", "slice_depths", "bf16_memory", "buffer_assignment_memory"]


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


def slice_depths(blocks: int) -> tuple[int, int]:
    """The two block counts ``auto_layout(depth=)`` compiles a model of ``blocks`` repeated blocks at (see the
    module doc): 3 and 4, where the block added is a middle one; a model of fewer than 4 at its own count and
    one less (1 and 2 for 1 block): nothing carried past a count it has, none compiled deeper than it."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"slice_depths: blocks={blocks!r} must be an int >= 1 (the model's repeated blocks).")
    lo = max(1, min(3, blocks - 1))
    return lo, lo + 1


def carried(lo: Any, hi: Any, blocks: int, at: int) -> Any:
    """``x(blocks) = x(at) + (blocks - at) (x(at + 1) - x(at))`` of figures ``lo`` (at ``at`` blocks) and ``hi``
    (at ``at + 1``): numbers, and dicts of them key by key; a flag or other value is ``lo``'s."""
    if isinstance(lo, dict):
        return {k: carried(lo[k], hi[k], blocks, at) if k in hi else lo[k] for k in lo}
    if isinstance(lo, bool) or not isinstance(lo, (int, float)):
        return lo
    if not (math.isfinite(lo) and math.isfinite(hi)):  # an untraced candidate's time: none
        return max(lo, hi)
    got = lo + (blocks - at) * (hi - lo)
    return int(round(got)) if isinstance(lo, int) and isinstance(hi, int) else got


def extrapolated(lo: Any, hi: Any, blocks: int, budget: int | None, roofline: Callable | None = None, *,
                 at: int) -> Any:
    """The ``Candidate`` of a model of ``blocks`` repeated blocks from its candidates ``lo`` and ``hi`` at ``at``
    and ``at + 1`` blocks (``slice_depths``; see the module doc); ``fits`` judged again under ``budget``.
    ``roofline(layout, flops, bytes) -> seconds``: where both were compiled (their ``bytes_accessed`` known), the
    compute is the roofline of the carried flops and bytes (the roofline of the deep program, not the carried
    rooflines of the slices, which a slice bound by its bytes and the other by its flops would bend)."""
    def affine(x, y):
        return carried(x, y, blocks, at)

    mem = affine(lo.memory, hi.memory)
    peak = None if lo.measured_peak is None else affine(lo.measured_peak, hi.measured_peak)
    fits = budget is None or (peak if peak is not None else mem["peak"]) <= budget
    comm_s = affine(lo.comm_s, hi.comm_s)
    flops = affine(lo.flops, hi.flops)
    compute, nbytes = affine(lo.compute_s, hi.compute_s), None
    predicted = affine(lo.predicted_s, hi.predicted_s)
    if roofline is not None and lo.bytes_accessed is not None and hi.bytes_accessed is not None:
        nbytes = affine(lo.bytes_accessed, hi.bytes_accessed)
        compute = roofline(lo.layout, flops, nbytes)
        predicted = compute + sum(comm_s.values()) + affine(lo.dispatch_s, hi.dispatch_s)
    return replace(lo, predicted_s=predicted, compute_s=compute, comm_s=comm_s,
                   communication=affine(lo.communication, hi.communication), memory=mem,
                   flops=flops, measured_peak=peak, fits=fits, bytes_accessed=nbytes)
