"""torch's activation checkpointing as a module transform: ``activation_checkpointing``, on any flax model.

torch wraps submodules (``apply_activation_checkpointing(model, checkpoint_wrapper_fn, check_fn)``;
torchtitan's ``apply_ac`` with mode ``"full"`` or ``"selective"`` op); here the units are module fqn globs
(``"layers_*"``, ``"transformer.h.*"``) and the model's code is unchanged. In the train step each call of a
matching submodule runs under ``jax.checkpoint`` (``spmd.parallel.styles._hooks``) with the unit's policy:

- ``"full"``: the backward pass keeps only the unit's inputs and recomputes its forward pass;
- ``"dots"``: it keeps the matmul outputs too (``jax.checkpoint_policies.dots_saveable``: torchtitan's
  selective op AC) and recomputes the rest (norms, activations, softmax).

Both keep the results of the tensor-parallel collectives (``checkpoint_name`` ``TP_COMM``), so the
recomputation repeats no tp collective, and an FSDP unit's gathers are what ``fully_shard`` says: resharded
after forward, the unit is gathered again for its backward pass as without checkpointing; kept, its
gathered parameters are the recomputation's inputs (no second gather). The step's communication is the
same with or without checkpointing, and so is every number it computes.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from spmd.parallel.styles._tp_calls import TP_COMM, split_arrays
from spmd.parallel.styles._transforms import ParallelModule, _no_match, _unwrap, ep_of, glob_regex

__all__ = ["RematSpec", "RematCalls", "activation_checkpointing", "POLICIES", "checkpoint_policy"]

POLICIES = {
    "full": "keep each unit's inputs, recompute its forward pass in the backward pass",
    "dots": "keep the matmul outputs too (torchtitan's selective op AC), recompute the rest",
}


_FULL = jax.checkpoint_policies.save_only_these_names(TP_COMM)
_DOTS = jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _FULL)


def checkpoint_policy(policy: str) -> Callable:
    """The ``jax.checkpoint`` policy of ``policy``: its residuals and the tp collectives' results. One object
    per policy (``"dots"`` is also what a re-gathering FSDP unit saves): equal layouts trace equal programs."""
    return _FULL if policy == "full" else _DOTS


@dataclass(frozen=True)
class RematSpec:
    """``activation_checkpointing``'s layout: the units (module fqn globs) and the policy they run under."""

    units: tuple[str, ...]
    policy: str

    def matches(self, fqn: str) -> bool:
        return any(re.fullmatch(glob_regex(u, "."), fqn) for u in self.units)

    def check(self, modules: list[str]) -> None:
        """Every unit matches a module of ``modules`` (the model's, read off its parameters)."""
        for u in self.units:
            if not any(re.fullmatch(glob_regex(u, "."), m) for m in modules):
                raise _no_match("activation_checkpointing", "unit", u, modules)


def activation_checkpointing(module: Any, *, units: Sequence[str] = ("layers_*",), policy: str = "full"
                             ) -> ParallelModule:
    """torch's ``apply_activation_checkpointing``: each submodule matching ``units`` recomputes its forward
    pass in the backward pass instead of keeping its activations.

    ``units``: module fqn globs (``["layers_*"]``, ``["block_*"]``, ``["transformer.h.*"]``), as
    ``fully_shard``'s. ``policy``: ``"full"`` (keep only each unit's inputs) or ``"dots"`` (keep its matmul
    outputs too). Composes in any order with ``parallelize_module`` and ``fully_shard``; on a plain model
    it trains data-parallel over ``make_train_step``'s ``mesh=`` (DDP). The results of the tensor-parallel
    collectives are always kept, so a step communicates what it does without checkpointing.
    """
    where = "activation_checkpointing"
    inner, mesh, tp, fsdp, remat = _unwrap(module, where)
    if remat is not None:
        raise ValueError(f"{where}: the model already checkpoints activations (units {list(remat.units)}, policy "
                         f"{remat.policy!r}); call {where} once with every unit.")
    if not isinstance(policy, str):
        raise TypeError(f"{where}: policy={policy!r} must be a string: "
                        + "; ".join(f"{k!r} ({v})" for k, v in POLICIES.items()) + ".")
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy={policy!r} is not a policy; use "
                         + " or ".join(f"{k!r} ({v})" for k, v in POLICIES.items()) + ".")
    if isinstance(units, str) or not all(isinstance(u, str) and u for u in units):
        raise TypeError(f"{where}: units={units!r} must be a list of module fqn globs, e.g. ['layers_*'] or "
                        "['transformer.h.*'].")
    if not units:
        raise ValueError(f"{where}: units=[] checkpoints nothing; name the modules to recompute, e.g. ['layers_*'].")
    return ParallelModule(inner, mesh, tp, fsdp, remat=RematSpec(tuple(u.replace("/", ".") for u in units), policy),
                          ep=ep_of(module))


class RematCalls:
    """Mixed into ``Hooks``: the activation-checkpointing units' calls. Needs ``remat``, ``regather``,
    ``prefix``, ``active``, ``in_remat`` and ``gather`` from it."""

    def remat_policy(self, fqn: str) -> Callable | None:
        """The ``jax.checkpoint`` policy of the module ``fqn`` if it is an activation-checkpointing unit."""
        return checkpoint_policy(self.remat.policy) if self.remat and self.remat.matches(fqn) else None

    @contextlib.contextmanager
    def entered(self, spath: str, path: tuple | None = None, remat: bool = False):
        """Inside unit ``spath``'s own apply: its calls are not hooked again; linen: submodule paths under ``path``."""
        saved = self.prefix
        self.prefix = path if path is not None else saved
        self.active.add(spath)
        if remat:
            self.in_remat.append(spath.replace("/", "."))
        try:
            yield
        finally:
            self.prefix = saved
            self.active.discard(spath)
            if remat:
                self.in_remat.pop()

    def gathering(self, apply: Callable, mine: list[int], entries: list, spath: str, policy: Callable | None):
        """An FSDP unit's ``run(shards, arrays)``: gather its own parameters, then ``apply(full, arrays)``,
        under ``jax.checkpoint`` when it is an activation-checkpointing unit that keeps its gathers (one that
        re-gathers runs all of ``run`` under its policy: ``Hooks.call_unit``)."""
        if self.in_remat:
            raise ValueError(
                f"activation_checkpointing: unit {self.in_remat[-1]!r} holds the fully_shard unit "
                f"{spath.replace('/', '.')!r}; recomputing it would gather that unit's parameters again in the "
                "backward pass. Checkpoint the fully_shard units themselves, or modules inside them.")

        def run(shards, arrays):
            full = list(shards)
            for i, y in zip(mine, self.gather([shards[i] for i in mine], [entries[i] for i in mine])):
                full[i] = y
            if policy is not None and not self.regather:
                return jax.checkpoint(apply, policy=policy)(full, arrays)
            return apply(full, arrays)

        return run

    def linen_remat(self, spath: str, path: tuple, mod, method: str, args, kwargs, policy: Callable):
        """A linen unit that gathers nothing: its own apply (a pure function of its variables and array inputs)
        under ``jax.checkpoint``."""
        variables = mod.variables
        others = {k: v for k, v in variables.items() if k != "params"}
        arrays, rebuild = split_arrays((args, kwargs))
        clone = mod.clone(parent=None)
        mutable = mutable_collections(mod, others)

        def apply(params, arrays):
            a, k = rebuild(list(arrays))
            with self.entered(spath, path, remat=True):
                return clone.apply({"params": params, **others}, *a, method=method, **k,
                                   **({"mutable": mutable} if mutable else {}))

        out = jax.checkpoint(apply, policy=policy)(variables.get("params", {}), arrays)
        return put_back(mod, out) if mutable else out

    def nnx_remat(self, spath: str, sub: Any, orig: Callable, args, kwargs, policy: Callable):
        """An nnx unit that gathers nothing: ``orig`` on a copy of it holding the traced parameter values."""
        from spmd.parallel.styles._nnx import nnx_unit_params, with_values

        params = nnx_unit_params(sub)
        arrays, rebuild = split_arrays((args, kwargs))

        def apply(vals, arrays):
            local = with_values(sub, {rel: x for (rel, _), x in zip(params, vals)})
            with self.entered(spath, remat=True):
                a, k = rebuild(list(arrays))
                return orig(local, *a, **k)

        return jax.checkpoint(apply, policy=policy)([v[...] for _, v in params], arrays)


def mutable_collections(mod: Any, others: dict) -> list[str]:
    """The collections besides ``params`` a linen unit holds that its caller may update (``batch_stats`` under
    ``model.apply(..., mutable=["batch_stats"])``): the unit, applied as a function of its variables, returns
    their updates and ``put_back`` writes them into the caller's scope."""
    return [c for c in others if mod.is_mutable_collection(c)]


def put_back(mod: Any, out: tuple) -> Any:
    """``out = (y, updates)`` of a unit applied with ``mutable=``: each updated collection written into ``mod``'s
    own variables (as if the unit had run in place); ``y``."""
    y, updates = out
    for col, tree in updates.items():
        for name, value in tree.items():
            mod.put_variable(col, name, value)
    return y
