"""flax.nnx models in the train step: parameters as an ``nnx.State``, hooks installed on a merged copy.

An nnx model holds its parameters; the step splits them off (``nnx.split(model, nnx.Param, ...)``), lays
them out like any pytree, and inside the region merges a fresh copy of the module from this device's
values. That copy's submodules are rewritten in place (each one's class swapped for a subclass whose
``__call__`` goes through ``spmd.parallel.styles._hooks.Hooks``), so the user's ``loss_fn(model, batch)``
runs the model's own code on it. The user's model object is never touched.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax

__all__ = ["is_nnx", "nnx_params", "nnx_loss", "nnx_trace_seen", "nnx_batch_stats"]

_HOOKED: dict[type, type] = {}  # nnx module class -> its hooked subclass (classes only; no results cached)

# The routing a hooked copy carries, ``(hooks, fqn)``: set on the step's merged copy of a submodule (never on
# the user's module) and read by the subclass ``_hooked`` put in its place; nobody else sets or reads it. An
# attribute, not a WeakKeyDictionary keyed by the module: a user's module class need not hash by identity (one
# that defines __eq__, as a dataclass does, is unhashable).
HOOK_ATTR = "_spmd_hook"


def is_nnx(model: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, nnx.Module)


def nnx_params(model: Any) -> Any:
    from flax import nnx

    return nnx.state(model, nnx.Param)


def _hooked(cls: type) -> type:
    if cls not in _HOOKED:
        def __call__(self, *args, **kwargs):
            hooks, fqn = object.__getattribute__(self, HOOK_ATTR)
            return hooks.nnx_call(fqn, self, cls.__call__, args, kwargs)

        _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _HOOKED[cls]


# The hooks whose ``installed()`` context is open, for the nnx modules a pipeline's stage merges while it runs
# (``spmd.parallel.pipelining._calls``): a context, as linen's ``nn.intercept_methods`` is, set and reset by
# ``Hooks.installed`` around one trace.
_INSTALLED: contextvars.ContextVar = contextvars.ContextVar("spmd_nnx_hooks", default=None)


@contextlib.contextmanager
def installing(hooks: Any):
    token = _INSTALLED.set(hooks)
    try:
        yield
    finally:
        _INSTALLED.reset(token)


def installed_hooks() -> Any:
    """The hooks of the open ``Hooks.installed()`` context, or None."""
    return _INSTALLED.get()


def hook_submodules(m: Any, hooks: Any, prefix: tuple = (), skip: tuple = ()) -> None:
    """Route the calls of ``m``'s submodules (a merged copy) through ``hooks``, named ``prefix`` + their path;
    ``m`` itself too when ``prefix`` names it; not the subtrees at the paths in ``skip``."""
    from flax import nnx

    for path, sub in list(nnx.iter_modules(m)):
        full = tuple(prefix) + tuple(str(p) for p in path)
        if not full or any(full[:len(s)] == tuple(s) for s in skip):
            continue
        object.__setattr__(sub, HOOK_ATTR, (hooks, ".".join(full)))
        sub.__class__ = _hooked(type(sub))


def nnx_batch_stats(model: Any) -> Any:
    """The values of ``model``'s ``nnx.BatchStat`` variables (``nnx.BatchNorm``'s running statistics) as a
    nested dict of arrays by path, or ``None`` where it holds none."""
    from flax import nnx

    stats = nnx.state(model, nnx.BatchStat)
    return stats.to_pure_dict() if jax.tree.leaves(stats) else None


def nnx_loss(model: Any, loss_fn: Callable, params: Any, batch: Any, hooks: Any, stats: Any = None,
             prepare: Callable | None = None) -> Any:
    """``loss_fn(m, batch)`` where ``m`` is ``model`` with ``params`` (this device's values), hooks installed.
    ``stats`` (``nnx_batch_stats``'s dict): ``m``'s ``nnx.BatchStat`` values; the call then returns
    ``(loss_fn's output, m's BatchStat values after it)`` (a BatchNorm in training mode updates its copy's).
    ``prepare(m)``: run on the merged copy before the loss (the step's SyncBatchNorm)."""
    from flax import nnx

    if stats is None:
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        m = nnx.merge(graphdef, params, rest, copy=True)  # its own Variables: a BatchNorm may update them
    else:
        graphdef, _, held, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
        nnx.replace_by_pure_dict(held, stats)
        m = nnx.merge(graphdef, params, held, rest, copy=True)  # its own Variables: a BatchNorm updates them
    for path, sub in list(nnx.iter_modules(m)) if hasattr(nnx, "iter_modules") else list(m.iter_modules()):
        if not path:
            continue
        object.__setattr__(sub, HOOK_ATTR, (hooks, ".".join(str(p) for p in path)))
        sub.__class__ = _hooked(type(sub))
    if prepare is not None:
        prepare(m)
    out = loss_fn(m, batch)
    return out if stats is None else (out, nnx.state(m, nnx.BatchStat).to_pure_dict())


def nnx_unit_params(sub: Any) -> list[tuple[str, Any]]:
    """``(relative path, nnx.Param)`` of a submodule, in state order."""
    from flax import nnx

    return [("/".join(str(p) for p in path), v) for path, v in nnx.iter_graph(sub) if isinstance(v, nnx.Param)]


def with_values(sub: Any, values: dict) -> Any:
    """A fresh copy of ``sub`` whose parameters at relative paths ``values`` (``"kernel"``,
    ``"up/bias"``) hold the given arrays: nnx refuses a Variable set from inside another trace, so
    traced code gets its own copy (``nnx.merge``) rather than a mutated one."""
    from flax import nnx

    from spmd.parallel.plan._param_plan import path_str

    graphdef, state = nnx.split(sub)
    kp, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = []
    for k, x in kp:
        rel = path_str(k)
        rel = rel[: -len("/value")] if rel.endswith("/value") else rel
        leaves.append(values.get(rel, x))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


class _Seen:
    """Hooks that only look: the shape each hooked submodule's call sees of its parameters (``nnx_trace_seen``)."""

    def __init__(self):
        self.seen: dict[str, dict[str, tuple[int, ...]]] = {}

    def nnx_call(self, fqn: str, sub: Any, orig: Callable, args: tuple, kwargs: dict) -> Any:
        import numpy as np

        spath = fqn.replace(".", "/")
        for rel, v in nnx_unit_params(sub):
            self.seen.setdefault(f"{spath}/{rel}/value", {}).setdefault(spath, tuple(np.shape(v[...])))
        return orig(sub, *args, **kwargs)


def nnx_trace_seen(model: Any, params: Any, run: Callable, batch: Any = None) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{param path: {module path: shape}}``: the shapes the submodules of ``model`` (with ``params``, arrays or
    shapes) see of their parameters when ``run(m, batch)`` calls the model abstractly (nothing runs; ``batch``,
    arrays or shapes, is traced as an argument). A block under
    ``nnx.vmap`` + ``nnx.scan`` sees one layer of parameters stored with one more axis (the layer): what
    ``spmd.parallel.plan._scan.find_stacked`` reads, as for a linen ``nn.scan``."""
    rec = _Seen()
    jax.eval_shape(lambda p, b: nnx_loss(model, run, p, b, rec), params, batch)
    return rec.seen
