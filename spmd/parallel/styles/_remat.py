"""Activation checkpointing as a parallel style: ``ActivationCheckpoint`` wraps its module's call in
``jax.checkpoint``, so the backward pass recomputes the module's forward pass instead of keeping its
activations (torch's ``checkpoint_wrapper`` / composable ``checkpoint(module)``; torchtitan's ``apply_ac``).

``activation_checkpointing(model, units=..., policy=...)`` (``spmd.parallel.styles._transforms``) names the
units; the hooks (``spmd.parallel.styles._hooks``) hand each unit's call to this style's ``run_call``, as they
hand a styled module's to its tensor-parallel style. The policies (``POLICIES``), each a ``jax.checkpoint``
policy over the unit's forward pass:

- ``"full"``: nothing saved but the unit's inputs (``jax.checkpoint_policies.nothing_saveable``; torch's full
  AC, ``checkpoint_wrapper`` / torchtitan's ``apply_ac`` mode ``"full"``, MaxText's ``full``): the backward pass
  recomputes the whole forward pass from them, its tensor-parallel collectives included (a sequence-parallel
  block gathers its inputs over tp again, a row-parallel output is all-reduced or reduce-scattered again;
  cp's ring permutes and ep's all-to-alls inside the unit run again too: the step's table counts them,
  ``spmd.parallel.cost._recompute``);
- ``"dots"``: every matmul output (``jax.checkpoint_policies.dots_saveable``), the rest recomputed (norms,
  activations, softmax);
- ``"selective"``: torchtitan's selective op AC (``_apply_op_sac``: ``_save_list`` = ``mm``, the
  ``scaled_dot_product_*attention`` kernels, ``reduce_scatter_tensor``; every second ``mm`` recomputed): the
  1st, 3rd, ... matmul without batch dims (the projections, torch's ``mm``) counted in the unit's order, the
  2nd, 4th, ... matmul with batch dims (an attention's ``probs @ v`` after its ``q @ k^T``: the output
  torch's sdpa keeps, not its scores) and every reduce-scatter's output;
- ``"minimal"``: MaxText's ``minimal`` (``checkpoint_dots_with_no_batch_dims``): every matmul without batch
  dims, the attention's recomputed;
- ``"save_dot_except_mlp"``, ``"save_dot_except_mlpwi"``, ``"save_qkv_proj"``: MaxText's named policies
  (``save_only_these_names``) over the tensors the model names with ``jax.ad_checkpoint.checkpoint_name``
  (``query_proj``, ``key_proj``, ``value_proj``, ``qkv_proj``, ``out_proj``, ``mlpwo``; ``models.Llama``,
  ``models.Transformer`` and ``models.MoE`` name theirs): a model that names none of them saves nothing
  under these but its inputs (``auto_layout`` weighs them only where the model names them);
- ``"offload"``: MaxText's ``minimal_offloaded`` (``offload_dot_with_no_batch_dims``): the matmuls without
  batch dims copied to the host's pinned memory in the forward pass and back in the backward pass. Only on
  a backend whose devices have a ``pinned_host`` memory apart from their own (refused by name on CPU, where
  host and device memory are one: ``offload_refusal``).

Every policy but ``"full"`` also keeps the results of the tensor-parallel collectives (``checkpoint_name``
``TP_COMM``), so its recomputation repeats no tp collective (torchtitan's selective AC saves the
reduce-scatters' outputs too). ``"full"`` keeps none of them: per block, a whole-over-tp all-reduce output (no
sequence parallelism) or the inputs gathered whole over the sequence (sequence parallelism) would be held per
layer beside the unit's input (at Llama 3 70B, tp=8 with sequence parallelism: 2.29 GiB a layer against
0.16 GiB), so it saves the unit's inputs alone, as torch's does. On a ``fully_shard`` unit the unit's style
applies the policy (``spmd.parallel.styles._fully_shard``), under either ``reshard_after_forward``: its
parameter gathers are what ``fully_shard`` says, with or without checkpointing, and so is every number it
computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

from spmd.parallel.styles._fully_shard import _tied_checkpoint
from spmd.parallel.styles._styles import ParallelStyle
from spmd.parallel.styles._tp_calls import TP_COMM, split_arrays

__all__ = ["ActivationCheckpoint", "POLICIES", "NAMED", "checkpoint_policy", "offload_refusal", "policy_names"]

POLICIES = {  # every one but "full" keeps the tp collectives' results too (TP_COMM: see the module doc)
    "full": "keep each unit's inputs only, recompute its forward pass in the backward pass, its tp collectives "
            "included (torch's full AC)",
    "dots": "keep every matmul output too, recompute the rest",
    "selective": "torchtitan's selective op AC: keep every other projection's output, the attention's output "
                 "and the reduce-scatters'",
    "minimal": "MaxText's minimal: keep the matmul outputs without batch dims (the projections)",
    "save_dot_except_mlp": "MaxText's: keep the tensors named query_proj, key_proj, value_proj, qkv_proj, out_proj",
    "save_dot_except_mlpwi": "MaxText's: save_dot_except_mlp's names and mlpwo",
    "save_qkv_proj": "MaxText's: keep the tensors named query_proj, key_proj, value_proj, qkv_proj",
    "offload": "MaxText's minimal_offloaded: the projections' outputs copied to host memory (not on CPU)",
}

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
NAMED = {"save_qkv_proj": _QKV, "save_dot_except_mlp": (*_QKV, "out_proj"),
         "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo")}  # MaxText's names, by policy


def policy_names(policy: str | None) -> tuple[str, ...]:
    """The ``checkpoint_name`` s a named policy keeps (``()`` for the others)."""
    return NAMED.get(policy, ())


def offload_refusal(devices: Any = None) -> str | None:
    """Why ``"offload"`` cannot run on ``devices`` (default: JAX's), or None where it can: their memories must
    hold a ``pinned_host`` kind apart from the device's own, which a CPU's are not."""
    devs = list(devices) if devices is not None else jax.devices()
    d = devs[0]
    kinds = {m.kind for m in d.addressable_memories()} if hasattr(d, "addressable_memories") else set()
    if d.platform == "cpu":
        return (f"policy 'offload' copies the saved matmul outputs from the device's memory to the host's, but on "
                f"{d.platform!r} devices they are one memory (kinds {sorted(kinds)}): nothing would leave the device")
    if "pinned_host" not in kinds:
        return (f"policy 'offload' needs a 'pinned_host' memory kind, and {d.platform!r} devices have "
                f"{sorted(kinds)}")
    return None


def _is_dot(prim, params) -> tuple[bool, bool]:
    """(a matmul, one with batch dims)."""
    if prim is not jax.lax.dot_general_p:
        return False, False
    (_, _), (lb, rb) = params["dimension_numbers"]
    return True, bool(lb or rb)


def _tp_comm(prim, params) -> bool:
    return prim.name == "name" and params.get("name") == TP_COMM


class _Selective:
    """torchtitan's op SAC as a ``jax.checkpoint`` policy (see the module doc): stateful, so one per unit call
    (``checkpoint_policy`` makes a fresh one), consulted in the forward pass's order."""

    def __init__(self):
        self.mm = self.bmm = 0

    def __call__(self, prim, *_, **params):
        dot, batched = _is_dot(prim, params)
        if dot and not batched:
            self.mm += 1
            return self.mm % 2 == 1
        if dot:
            self.bmm += 1
            return self.bmm % 2 == 0
        return prim.name in ("reduce_scatter", "psum_scatter") or _tp_comm(prim, params)


def _policy_of(policy: str) -> Callable:
    if policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if policy == "dots":
        return lambda prim, *_, **p: _is_dot(prim, p)[0] or _tp_comm(prim, p)
    if policy == "minimal":
        return lambda prim, *_, **p: _is_dot(prim, p) == (True, False) or _tp_comm(prim, p)
    if policy in NAMED:
        names = frozenset((*NAMED[policy], TP_COMM))
        return lambda prim, *_, **p: prim.name == "name" and p.get("name") in names
    if policy == "offload":
        moved = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
        return lambda prim, *a, **p: True if _tp_comm(prim, p) else moved(prim, *a, **p)
    raise ValueError(f"checkpoint_policy: policy={policy!r} is not a policy; use one of "
                     + ", ".join(repr(p) for p in POLICIES) + ".")


_CACHED = {p: _policy_of(p) for p in POLICIES if p != "selective"}


def checkpoint_policy(policy: str) -> Callable:
    """The ``jax.checkpoint`` policy of ``policy``: its residuals and (but under ``"full"``) the tp collectives'
    results. One object
    per stateless policy: equal layouts trace equal programs; ``"selective"`` counts its matmuls, a fresh one
    per call."""
    if policy == "selective":
        return _Selective()
    if policy not in _CACHED:
        _policy_of(policy)  # raises
    return _CACHED[policy]


@dataclass(frozen=True)
class ActivationCheckpoint(ParallelStyle):
    """The style of one activation-checkpointing unit: its call under ``jax.checkpoint`` with ``policy``'s
    residuals (one of ``POLICIES``); its parameters as they are."""

    policy: str = "full"

    def run_call(self, call) -> Any:
        params = call.params()
        arrays, rebuild = split_arrays((call.args, call.kwargs))

        def apply(vals, arrays):
            a, k = rebuild(list(arrays))
            return call.apply(vals, a, k, remat=True)

        # tied to the cotangent (``_fully_shard._tied_checkpoint``): else XLA:CPU runs the recomputation at the
        # end of the forward pass (under gradient accumulation, the units' parameters gathered up front, this
        # style runs every unit: each block's recomputed activations were live at once, ``ac="full"`` saving
        # nothing a layer)
        return _tied_checkpoint(call.hooks, apply, checkpoint_policy(self.policy), [v for _, v in params], arrays)
