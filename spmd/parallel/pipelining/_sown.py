"""A loss that reads what the pipeline's units sow: refused when the step is built.

Under a pipeline the units run on their stages apart from ``loss_fn`` (``_step._Pass``: ``loss_fn`` runs with
the units' calls routed to the stages), so what a unit sows (linen's ``self.sow("intermediates", ...)``, nnx's
``nnx.Intermediate``: an MoE block's load-balancing term) never reaches the loss: a loss adding it would train
without it. The step reports those values in its metrics (``metrics["intermediates/<unit>/<name>"]``; a scanned
stack's by layer, ``<stack>/<i>``); a ``loss_fn`` that reads them is refused. ``sown_names`` lists what a unit
sowed where ``loss_fn`` could read it (in the trace ``UnitCalls.record`` makes); ``check_sown_read`` traces
``loss_fn`` once more with a probe added to each of those values: a loss that depends on one is refused, an aux
metric that does is warned about (the step's own metrics carry those values). Both read and write a linen unit's
values through flax's public ``Module`` API (``variables``, ``is_mutable_collection``, ``put_variable``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp


def _linen_sown(mod) -> dict | None:
    """The unit's part of the ``intermediates`` collection (``Module.variables``), where ``loss_fn``'s ``apply``
    made it mutable and the unit sowed, else None."""
    if getattr(mod, "scope", None) is None or not mod.is_mutable_collection("intermediates"):
        return None
    return mod.variables.get("intermediates") or None


def _mapped(v: Any, name: str, fn: Callable) -> Any:
    """``v`` (a sown value, or a dict of them by name) with ``fn(name, value)`` in place of each value."""
    if not isinstance(v, Mapping):
        return fn(name, v)
    return {k: _mapped(x, f"{name}/{k}" if name else str(k), fn) for k, x in v.items()}


def _nnx_sown(mod) -> list:
    """``[(name, nnx.Intermediate)]`` of the unit and its submodules."""
    from flax import nnx

    return [("/".join(str(p) for p in path), v) for path, v in nnx.iter_graph(mod) if isinstance(v, nnx.Intermediate)]


def _visit(kind: str, mod, fn: Callable, put: bool = True) -> None:
    """``fn(name, value)`` for each value the unit ``mod`` sowed where ``loss_fn`` can read it, its result put
    back in place (``put``; else only read)."""
    if kind == "nnx":
        for name, var in _nnx_sown(mod):
            if hasattr(var, "get_value"):
                var.set_value(fn(name, var.get_value()))
            else:
                var.value = fn(name, var.value)
        return
    for k, v in (_linen_sown(mod) or {}).items():  # each top-level entry put back whole (Module.put_variable)
        new = _mapped(v, str(k), fn)
        if put:
            mod.put_variable("intermediates", k, new)


def sown_names(kind: str, mod) -> list[str]:
    """The names of what unit ``mod`` sowed (just called) where ``loss_fn`` can read it."""
    names: list[str] = []
    _visit(kind, mod, lambda n, v: names.append(n) or v, put=False)
    return names


def check_sown_read(calls: Any, loss_fn: Callable, params: Any, mb: Any, sown: dict,
                    shown: Callable[[str], str] = str) -> None:
    """Refuse ``loss_fn`` if its loss depends on what a unit sows, warn if an aux metric does (``sown``:
    ``{unit: [names]}``, from ``sown_names``): one trace of ``loss_fn`` with the units run in place and a scalar
    probe added to each sown value, then which probes the loss (each aux metric) uses (dead-code elimination,
    through nested programs). ``shown(unit)``: the unit as the metrics name it (a scanned stack: by layer)."""
    probes = [(u, n) for u, names in sown.items() for n in names]
    if not probes:
        return
    from jax._src.interpreters import partial_eval as pe

    index = {p: i for i, p in enumerate(probes)}

    def traced(p, b, eps):
        def on_unit(path, mod, call, args, kwargs):
            out = call(*args, **kwargs)
            _visit(calls.kind, mod, lambda n, v: v if (path, n) not in index else jax.tree.map(
                lambda a: a + eps[index[(path, n)]].astype(jnp.result_type(a)), v))
            return out

        return calls.run(loss_fn, p, b, on_unit)

    closed, shape = jax.make_jaxpr(traced, return_shape=True)(params, mb,
                                                              [jax.ShapeDtypeStruct((), jnp.float32)] * len(probes))
    n_out = len(closed.jaxpr.outvars)
    if isinstance(shape, tuple) and len(shape) == 2:  # (loss, aux): the loss's leaf first, then aux's (by path)
        n_loss = len(jax.tree.leaves(shape[0]))
        aux_keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(shape[1])]
    else:
        n_loss, aux_keys = n_out, []

    def read_by(outs: list[int]) -> list:
        _, used = pe.dce_jaxpr(closed.jaxpr, [i in outs for i in range(n_out)])
        return [probes[i] for i, u in enumerate(used[len(used) - len(probes):]) if u]

    read = read_by(list(range(n_loss)))
    if read:
        unit, name = read[0]
        more = f" (and {len(read) - 1} more: {[f'{u}/{n}' for u, n in read[1:]]})" if len(read) > 1 else ""
        raise ValueError(
            f"pipeline: loss_fn reads {name!r}, which unit {unit!r} sows{more} (linen's self.sow('intermediates', "
            "...), nnx's nnx.Intermediate), into its loss; under a pipeline the units run on their stages apart from "
            "loss_fn, so a value a unit sows cannot reach loss_fn across the stages (the loss would train without "
            f"that term). The step reports it in its metrics instead, as metrics['intermediates/{shown(unit)}/{name}']. "
            "Compute the term outside the units (in the head, from the last unit's output), leave it out of the "
            "loss (it stays in the metrics), or train without pp (fsdp, ep).")
    for j, key in enumerate(aux_keys):  # a metric only: warned (the step's own metrics carry the values)
        read = read_by([n_loss + j])
        if read:
            unit, name = read[0]
            warnings.warn(
                f"pipeline: loss_fn's aux{key} reads {name!r}, which unit {unit!r} sows; under a pipeline the units "
                "run on their stages apart from loss_fn, so that metric is computed without what the units sow. "
                f"The step reports it as metrics['intermediates/{shown(unit)}/{name}'] (each sown value by unit): read "
                "those instead.", stacklevel=2)
