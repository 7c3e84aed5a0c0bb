"""What one device of a layout computes per step, estimated without compiling the layout's step.

Per device and step: the flops and bytes accessed of the user's loss and gradient on one
micro-batch on one device (XLA's ``cost_analysis`` of the compiled single-device step less its optimizer
update's), the matmuls that read a tensor-parallel cut parameter (their forward flops read off the loss's
traced program, ``param_matmul_flops``, times 3 for the backward's two) divided by ``tp``,
times the micro-batches, and the operations the gradient launches (``program_ops``); the optimizer's update
apart (``optimizer_compute_s``). ``Profile.grad_seconds``: the gradient on one micro-batch timed on every
device at once (a ``shard_map`` of it with no collective: on a host whose fake devices share the cores, the
sum over the devices' programs divided by what the host runs at once, as it really runs; on one
accelerator per device, one device's time), which ``auto_layout`` anchors the gradient's estimate on when
the calibration was measured; ``Profile.optimizer_seconds``: the update of a layout's own shards timed so
(its cost is far from the shard's share of the whole update's: docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import jax
from placements import Shard

from spmd.parallel.cost._flops import param_matmul_flops
from spmd.parallel.cost._memory import Profile, _nbytes

__all__ = ["compute_cost", "param_matmul_flops", "tp_matmul_flops", "reference_cost", "optimizer_compute_s", "optimizer_flops", "update_seconds"]


def tp_matmul_flops(profile: Profile, plan, tp: str | None, micro_batch: Any) -> float:
    """Forward and backward flops (3 x the forward's) of the matmuls on ``plan``'s parameters cut over ``tp``."""
    if tp is None or tp not in plan.mesh_dim_names:
        return 0.0
    ti = plan.mesh_dim_names.index(tp)
    per = profile.param_matmul_flops(micro_batch)
    if len(per) != len(plan.entries):
        raise ValueError(f"auto_layout: profile= holds {len(per)} parameter leaves and the layout's plan "
                         f"{len(plan.entries)}: the profile was built on other parameters than the model's; build "
                         "it as Profile(loss_fn, params, optimizer) on the same params= auto_layout gets, or leave "
                         "profile= out (auto_layout then builds it).")
    return 3.0 * sum(f for f, e in zip(per, plan.entries) if isinstance(e.placements[ti], Shard))


def compute_cost(profile: Profile, plan, model, micro_batch: Any, *, accum_steps: int) -> tuple[float, float, int]:
    """(flops, bytes accessed, operations) of one step's gradients on one device, its micro-batches' (see the
    module doc; the optimizer's update apart: ``optimizer_compute_s``)."""
    flops, nbytes = profile.grad_cost(micro_batch)
    tp = model.tp.mesh_dim if model.tp else None
    n_tp = plan.mesh_size(tp) if tp else 1
    if n_tp > 1 and flops > 0:
        cut = min(tp_matmul_flops(profile, plan, tp, micro_batch), flops)
        local = flops - cut * (1 - 1 / n_tp)
        nbytes, flops = nbytes * local / flops, local
    return accum_steps * flops, accum_steps * nbytes, accum_steps * profile.ops(micro_batch)


def optimizer_flops(profile: Profile, plan) -> float:
    """The flops of the optimizer's update of ``plan``'s shards on one device: the whole update's, by share."""
    return profile.optimizer_cost()[0] * plan.bytes_per_device / max(profile.param_bytes, 1)


def optimizer_compute_s(profile: Profile, plan, cal, devices: list, *, timed: bool = True) -> float:
    """Seconds of the optimizer's update of ``plan``'s shards on one device: measured
    (``Profile.optimizer_seconds``, less dispatch) under a measured calibration; else the whole update's
    flops and bytes by the shard's share, and its operations, at ``cal``'s rates."""
    shards = jax.tree_util.tree_unflatten(plan.treedef, [jax.ShapeDtypeStruct(e.local_shape, e.dtype)
                                                        for e in plan.entries])  # the optimizer sees the tree
    return update_seconds(profile, shards, cal, devices, timed=timed)


def update_seconds(profile: Profile, shards: Any, cal, devices: list, *, timed: bool = True) -> float:
    """Seconds of the optimizer's update of parameters shaped ``shards`` (shape structs) on one device, as
    ``optimizer_compute_s`` takes them: measured on every device at once, or by the bytes' share (also under
    a measured calibration with ``timed=False``: the one-device update's cost analysis, nothing run)."""
    if cal.measured and len(devices) > 1 and timed:
        return max(profile.optimizer_seconds(shards, devices) - cal.dispatch_s, 0.0)
    of, ob, ops = profile._optimizer()
    share = _nbytes(shards) / max(profile.param_bytes, 1)
    return cal.compute_s(of * share, ob * share, ops)


def reference_cost(profile: Profile, micro_batch: Any) -> tuple[float, float, int]:
    """(flops, bytes accessed, operations) of the one-device gradient ``Profile.grad_seconds`` times."""
    return (*profile.grad_cost(micro_batch), profile.ops(micro_batch))
