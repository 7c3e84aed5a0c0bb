"""Hardware as data: a device's rates and memory, and the links between devices, from published figures.

A plan for 64 GPUs is made on a machine that has none. What it needs of the hardware is a handful of
numbers: the matmul rate per dtype, the memory and its bandwidth, how many devices share a node's fast
links, and those links' bandwidth and latency inside and across nodes. ``Hardware`` holds them;
``Hardware.named("h100")`` gives the built-ins (``HARDWARE``), each from its vendor's datasheet (cited in
docs/training/layouts.md).

A collective's time follows from them, as the algorithm moves its bytes (per device, in the nccl-tests
convention of ``spmd.collectives``: the all-reduce's buffer, the all-gather's result, the reduce-scatter's
input): a ring of ``g`` devices sends ``(g - 1) / g`` of its bytes per pass and pays one link latency per
step, two passes for an all-reduce; an all-reduce may instead take a tree (``2 log2 g`` latencies, two passes
of the bytes), whichever is faster, as NCCL chooses. A group whose devices all sit in one node uses the
node's links; a group that spans nodes is as fast as its slowest hop, the inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hardware", "Link", "HARDWARE", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_RING_PASSES = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}


@dataclass(frozen=True)
class Link:
    """One device's link to its peers: ``bandwidth`` in bytes per second each way, ``latency`` in seconds
    per message (one step of a ring)."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"Link: bandwidth={self.bandwidth!r} must be > 0 (bytes per second) and "
                             f"latency={self.latency!r} >= 0 (seconds).")


@dataclass(frozen=True)
class Hardware:
    """A device kind and its interconnect, as data (see the module doc).

    ``matmul_flops``: peak dense matmul flop/s per dtype name (``"bfloat16"``, ``"float32"``, ...);
    ``memory_bytes`` and ``memory_bandwidth``: one device's memory and its bytes per second;
    ``devices_per_node``: how many devices share the fast ``intra`` links; ``inter``: the links across nodes
    (per device); ``fused_attention``: ``jax.nn.dot_product_attention(implementation="cudnn")`` runs there as a
    fused flash-attention kernel (cuDNN on NVIDIA GPUs from Ampere on; ``spmd.parallel.auto._fused``).
    """

    name: str
    matmul_flops: dict = field(default_factory=dict)
    memory_bytes: float = 0.0
    memory_bandwidth: float = 0.0
    devices_per_node: int = 1
    intra: Link = Link(1.0, 0.0)
    inter: Link = Link(1.0, 0.0)
    fused_attention: bool = False

    def __post_init__(self):
        if not self.matmul_flops or any(not v > 0 for v in self.matmul_flops.values()):
            raise ValueError(f"Hardware({self.name!r}): matmul_flops={self.matmul_flops!r} must map each dtype name "
                             "to a peak flop/s > 0, e.g. {'bfloat16': 989e12}.")
        for attr in ("memory_bytes", "memory_bandwidth"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"Hardware({self.name!r}): {attr}={getattr(self, attr)!r} must be > 0.")
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise ValueError(f"Hardware({self.name!r}): devices_per_node={self.devices_per_node!r} must be an int >= 1.")
        object.__setattr__(self, "matmul_flops", dict(self.matmul_flops))

    @staticmethod
    def named(name: Any, *, where: str = "Hardware.named", arg: str = "name") -> "Hardware":
        """A built-in by one of ``HARDWARE``'s names (``"h100"``, ``"h200"``, ``"a100-80g"``, ``"tpu-v5p"``), or
        a ``Hardware`` as it is (``where`` / ``arg``: the caller and argument its errors name)."""
        if isinstance(name, Hardware):
            return name
        if not isinstance(name, str):
            raise TypeError(f"{where}: {arg}={name!r} must be a built-in's name (one of {sorted(HARDWARE)}) or a "
                            f"spmd.parallel.Hardware, not {type(name).__name__}.")
        if name.lower() not in HARDWARE:
            raise ValueError(f"{where}: {arg}={name!r} is not a built-in; use one of {sorted(HARDWARE)} or build a "
                             "spmd.parallel.Hardware(...) with your device's figures.")
        return HARDWARE[name.lower()]

    def matmul_s(self, flops: float, dtype: str = "bfloat16") -> float:
        """Seconds for ``flops`` of matmul in ``dtype`` at the peak rate."""
        name = getattr(dtype, "name", None) or str(dtype)
        if name not in self.matmul_flops:
            raise ValueError(f"Hardware({self.name!r}).matmul_s: dtype={name!r} has no rate; the rates given are "
                             f"for {sorted(self.matmul_flops)}.")
        return flops / self.matmul_flops[name]

    def memory_s(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` through one device's memory."""
        return nbytes / self.memory_bandwidth

    def spans_nodes(self, group: int, stride: int = 1) -> bool:
        """Whether a group of ``group`` devices, ``stride`` apart in the device order (a mesh dim's stride: the
        product of the later dims' sizes), spans more than one node."""
        return group > 1 and stride * group > self.devices_per_node

    def link(self, group: int, stride: int = 1) -> Link:
        """The link a group's collective runs at: the node's, or the inter-node one if the group spans nodes."""
        return self.inter if self.spans_nodes(group, stride) else self.intra

    def collective_s(self, kind: str, nbytes: float, group: int, stride: int = 1) -> float:
        """Seconds for one collective of ``kind`` of ``nbytes`` (per device, nccl-tests convention) over
        ``group`` devices ``stride`` apart (see the module doc)."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"Hardware.collective_s: kind={kind!r} is not one of {COLLECTIVE_KINDS}.")
        if group <= 1:
            return 0.0
        link = self.link(group, stride)
        if kind == "collective-permute":
            return link.latency + nbytes / link.bandwidth
        passes = _RING_PASSES[kind]
        ring = passes * ((group - 1) * link.latency + (group - 1) / group * nbytes / link.bandwidth)
        if kind != "all-reduce":
            return ring
        tree = 2 * math.ceil(math.log2(group)) * link.latency + 2 * nbytes / link.bandwidth
        return min(ring, tree)


_GB = 1e9
_T = 1e12
# Latencies are not on the datasheets: one message's latency per ring step, a commonly quoted order of
# magnitude for NVLink / ICI (a few microseconds) and InfiniBand / DCN (about ten).
_NVLINK_LATENCY = 3e-6
_IB_LATENCY = 10e-6

HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: dense BF16/FP16 tensor 989.5 TFLOPS (1,979 with sparsity), TF32 494.7,
    # FP32 67; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s per GPU (both directions: 450 each way); DGX H100:
    # 8 GPUs a node, one 400 Gb/s ConnectX-7 NDR port per GPU (50 GB/s each way). cuDNN's fused attention
# (flash attention, sm80 and later: cuDNN's developer guide, "Fused Flash Attention") on the three GPUs.
    "h100": Hardware("h100", {"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float32": 67 * _T},
                     80 * _GB, 3.35e12, 8, Link(450 * _GB, _NVLINK_LATENCY), Link(50 * _GB, _IB_LATENCY), True),
    # NVIDIA H200 SXM datasheet: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200
    # as DGX H100 (8 GPUs, 400 Gb/s NDR per GPU).
    "h200": Hardware("h200", {"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float32": 67 * _T},
                     141 * _GB, 4.8e12, 8, Link(450 * _GB, _NVLINK_LATENCY), Link(50 * _GB, _IB_LATENCY), True),
    # NVIDIA A100 80GB SXM datasheet: dense BF16/FP16 tensor 312 TFLOPS, FP32 19.5; 80 GB HBM2e at
    # 2,039 GB/s; NVLink 3 600 GB/s (300 each way); DGX A100: 8 GPUs, one 200 Gb/s HDR port per GPU (25 GB/s).
    "a100-80g": Hardware("a100-80g", {"bfloat16": 312 * _T, "float16": 312 * _T, "float32": 19.5 * _T},
                         80 * _GB, 2.039e12, 8, Link(300 * _GB, _NVLINK_LATENCY), Link(25 * _GB, _IB_LATENCY), True),
    # Google Cloud TPU v5p: 459 TFLOPS BF16 per chip, 95 GB HBM2e at 2,765 GB/s, ICI 4,800 Gbps per chip
    # (600 GB/s: 300 each way) in a 3-D torus of up to 8,960 chips (the ICI domain: a "node" here); across
    # slices the data-center network, 100 Gb/s per chip's share taken as 12.5 GB/s (an assumption). float32:
    # JAX's default matmul precision on TPU runs an f32 matmul as one bf16 pass, at the bf16 rate.
    "tpu-v5p": Hardware("tpu-v5p", {"bfloat16": 459 * _T, "float32": 459 * _T},
                        95 * _GB, 2.765e12, 8960, Link(300 * _GB, _NVLINK_LATENCY), Link(12.5 * _GB, _IB_LATENCY)),
}
