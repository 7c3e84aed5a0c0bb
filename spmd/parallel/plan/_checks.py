"""Checks of the training API's inputs against the model, the optimizer and the documented forms.

Each runs before anything compiles and names the function, the argument (with its pytree path), the value
and the fix. The expensive ones (an abstract ``init`` of the model, ``optimizer.init`` under
``jax.eval_shape``) run once per step build and plan, never per call:

- the parameters are the model's (``check_same_tree``): their paths, shapes and dtypes equal the model's
  abstract ``init`` (linen: on the inputs the user's loss gives the model, read off one abstract trace; nnx:
  the model's own ``nnx.state``); the first difference is named, path, expected and got;
- the optimizer state is the optimizer's (``check_opt_state``): ``jax.eval_shape(optimizer.init, params)``;
- an rng is a JAX key (``check_rng``); a batch holds arrays with one leading dim (``check_batch_leaves``);
  the loss is a float scalar and every ``aux`` metric a scalar (``check_loss``);
- a ``parallelize_module`` plan gives each module one style, and a column / row style lands on a module
  that holds a kernel or an embedding table (``check_tp_plan``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from spmd.parallel.plan._param_plan import path_str

__all__ = ["describe_tree", "first_difference", "check_same_tree", "check_opt_state", "check_rng",
           "check_batch_leaves", "check_loss", "check_tp_plan", "params_hint", "linen_abstract_params",
           "traced_model_params"]

_COLLECTIONS = ("params", "batch_stats", "cache", "intermediates", "losses", "aux_loss")


def _spec(x: Any) -> str:
    dt = getattr(x, "dtype", None)
    name = np.dtype(dt).name if dt is not None else type(x).__name__
    return f"{name}{list(np.shape(x))}"


def describe_tree(tree: Any) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """``{path: (shape, dtype name)}`` of the leaves of ``tree`` (arrays or ``ShapeDtypeStruct``)."""
    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dt = getattr(x, "dtype", None)
        path = path_str(kp)
        path = path[: -len("/value")] if path.endswith("/value") else path  # an nnx Variable's value
        out[path] = (tuple(int(d) for d in np.shape(x)), np.dtype(dt).name if dt is not None else None)
    return out


def _fmt(spec: tuple[tuple[int, ...], str | None] | None) -> str:
    if spec is None:
        return "nothing"
    shape, dtype = spec
    return f"{dtype or 'a Python scalar'}{list(shape)}"


def first_difference(expected: Mapping[str, tuple], got: Mapping[str, tuple], *, float_dtypes_differ: bool = True
                     ) -> tuple[str, str, str, int] | None:
    """``(path, expected, got, number of differing paths)`` of the first path (in sorted order) whose shape or
    dtype differs, or which only one side holds; ``None`` if they agree. ``float_dtypes_differ=False``: a
    floating leaf stored in another floating dtype (bfloat16 weights) is no difference."""
    def same(a, b) -> bool:
        if a[0] != b[0]:
            return False
        if a[1] == b[1] or a[1] is None or b[1] is None:
            return True
        if not float_dtypes_differ:
            fa, fb = (np.issubdtype(np.dtype(d), np.floating) or d == "bfloat16" for d in (a[1], b[1]))
            return fa and fb
        return False

    diffs = [p for p in sorted(set(expected) | set(got))
             if p not in expected or p not in got or not same(expected[p], got[p])]
    if not diffs:
        return None
    p = diffs[0]
    return p, _fmt(expected.get(p)), _fmt(got.get(p)), len(diffs)


def params_hint(params: Any, *, sure: bool = False) -> str:
    """Why ``params`` is probably not a model's parameter tree, or ``""``: the variables dict
    ``{'params': ...}`` that ``model.init`` returns, a list around the tree, a tree of no module (not
    with ``sure``: only the first two, which no model's parameters are)."""
    if isinstance(params, Mapping) and "params" in params and set(params) <= set(_COLLECTIONS) \
            and isinstance(params["params"], Mapping):
        return (f" params= is the variables dict model.init returns (keys {sorted(params)}), not its parameters: "
                "pass variables['params'].")
    if isinstance(params, (list, tuple)):
        return (f" params= is a {type(params).__name__} of {len(params)} entries; a model's parameters are the "
                "tree model.init(rng, x)['params'] itself (an nnx model: nnx.state(model, nnx.Param)).")
    paths = list(describe_tree(params))
    if not sure and paths and all("/" not in p for p in paths):
        return (f" params= holds no module's parameters (its leaves: {paths[:6]}); it is not this model's parameter "
                "tree: pass model.init(rng, x)['params'].")
    return ""


def check_same_tree(where: str, arg: str, expected: Any, got: Any, source: str, fix: str, *,
                    float_dtypes_differ: bool = False) -> None:
    """Refuse ``got`` (``arg``) unless its leaves have ``expected``'s paths, shapes and dtypes."""
    diff = first_difference(describe_tree(expected), describe_tree(got), float_dtypes_differ=float_dtypes_differ)
    if diff is None:
        return
    path, want, have, n = diff
    more = f" ({n} paths differ)" if n > 1 else ""
    hint = params_hint(got) if arg.endswith("params") or arg == "params=" else ""
    raise ValueError(f"{where}: {arg} is not {source}: at {path!r} the model has {want}, {arg} has {have}{more}."
                     f"{hint} {fix}")


def check_opt_state(where: str, optimizer: Any, params: Any, opt_state: Any) -> None:
    """Refuse an ``opt_state`` that ``optimizer.init(params)`` does not make (another optimizer's)."""
    try:
        want = jax.eval_shape(optimizer.init, params)
    except Exception:  # an optimizer whose init cannot run abstractly: left to the step
        return
    same_def = jax.tree_util.tree_structure(want) == jax.tree_util.tree_structure(opt_state)
    diff = first_difference(describe_tree(want), describe_tree(opt_state))
    if diff is None and same_def:
        return
    if diff is None:
        path, exp, have = "", f"the structure {jax.tree_util.tree_structure(want)}", "another"
        at = f"optimizer.init gives {exp}, state.opt_state has {have}"
    else:
        path, exp, have, _ = diff
        at = f"at {path!r} optimizer.init(params) gives {exp}, state.opt_state has {have}"
    raise ValueError(f"{where}: state.opt_state was not made by this step's optimizer ({at}); build the state "
                     "with init_train_state(model, optimizer, ...) given the same optimizer as make_train_step.")


def check_rng(where: str, rng: Any) -> None:
    """A JAX PRNG key (``jax.random.key(0)``, ``jax.random.PRNGKey(0)``) or a dict of them (flax's ``rngs``)."""
    def is_key(k) -> bool:
        if not hasattr(k, "dtype") or not hasattr(k, "shape"):
            return False
        if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key):
            return True
        return np.dtype(k.dtype) == np.uint32 and tuple(k.shape) == (2,)

    if isinstance(rng, Mapping) and rng and all(isinstance(n, str) and is_key(k) for n, k in rng.items()):
        return
    if not is_key(rng):
        raise TypeError(f"{where}: rng={rng!r} (the first of init_args, (rng, *example_inputs)) must be a JAX PRNG "
                        "key: jax.random.key(0) (or a dict of them, {'params': key, 'dropout': key}).")


def check_batch_leaves(where: str, batch: Any) -> None:
    """Every leaf an array with a leading (batch) dim, the same for all."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(f"{where}: batch={batch!r} holds no arrays; give a pytree of arrays with a leading batch dim.")
    for kp, x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{where}: batch{jax.tree_util.keystr(kp)}={x!r} is a Python {type(x).__name__}, not an "
                            "array (a batch of Python lists?); give arrays: jax.tree.map(np.asarray, batch, is_leaf="
                            "lambda x: isinstance(x, list)), or np.asarray on each field.")
    dims = [(jax.tree_util.keystr(kp), tuple(np.shape(x))) for kp, x in leaves]
    for k, shape in dims:
        if not shape:
            raise ValueError(f"{where}: batch{k} has shape (): every batch leaf needs a leading (batch) dim; give "
                             "per-example values (np.full((batch_size,), v)) or close over the constant in loss_fn.")
    n = dims[0][1][0]
    bad = next(((k, s) for k, s in dims if s[0] != n), None)
    if bad is not None:
        raise ValueError(f"{where}: every batch leaf needs the same leading (batch) dim: batch{dims[0][0]} has "
                         f"shape {dims[0][1]} but batch{bad[0]} has {bad[1]}; give every field the batch's "
                         f"{n} rows.")


def check_loss(where: str, loss: Any, aux: Mapping) -> None:
    """The loss a float scalar (``jax.grad`` needs one); every ``aux`` metric a scalar."""
    dt = getattr(loss, "dtype", None)
    if dt is not None and not jax.dtypes.issubdtype(dt, np.floating):
        raise TypeError(f"{where}: loss_fn returned a loss of dtype {np.dtype(dt).name}; the loss is differentiated, "
                        "so it must be a float: return loss.astype(jnp.float32) (or compute it in floats).")
    for k, v in aux.items():
        if np.shape(v) != ():
            raise ValueError(f"{where}: loss_fn's aux[{k!r}] has shape {tuple(np.shape(v))}; aux metrics are "
                             f"scalars (averaged over the data dims): return e.g. aux[{k!r}].mean(), or one scalar "
                             "per entry.")


# --- parallelize_module's plan --------------------------------------------------------------------------
def check_tp_plan(plan: Sequence[tuple[str, Any]], modules: Sequence[str], params: Mapping[str, tuple],
                  regex: Callable[[str], str]) -> None:
    """One style per module; a style that ``cuts_kernel`` (ColwiseParallel, RowwiseParallel) on modules holding
    a kernel of 2+ dims or an embedding table. ``params``: ``{(module fqn, name): shape}``."""
    where = "parallelize_module"
    for m in modules:
        keys = [k for k, _ in plan if re.fullmatch(regex(k), m)]
        if len(keys) > 1:
            raise ValueError(f"{where}: plan keys {keys[0]!r} and {keys[1]!r} both match module {m!r}; a module takes "
                             "one style (torch would apply both, the second over the first's layout): narrow one of "
                             "the globs or drop one key.")

    def cuttable(m: str) -> bool:
        return len(params.get((m, "kernel"), ())) >= 2 or (m, "embedding") in params

    for key, style in plan:
        if not style.cuts_kernel:
            continue
        for m in modules:
            if not re.fullmatch(regex(key), m) or cuttable(m):
                continue
            own = sorted(n for (fqn, n) in params if fqn == m)
            under = [s for s in modules if s.startswith(m + ".") and cuttable(s)]
            name = type(style).__name__
            what = (f"holds {', '.join(own)}" if own else "holds no parameter of its own (a container)")
            norm = " (a norm's parameters stay whole: SequenceParallel() runs it on the sequence shards)" if (
                own and set(own) <= {"scale", "bias"}) else ""
            fix = (f"the modules under it that {name} can cut: {', '.join(under[:8])}" + (" ..." if len(under) > 8
                   else "") + f"; key those instead (e.g. {under[0]!r}: {name}())") if under else \
                "no module under it has one; drop the key"
            raise ValueError(f"{where}: {name} on {m!r} (plan key {key!r}): the style cuts a module's own kernel of "
                             f"2 or more dims (Dense, DenseGeneral, nnx Linear) or an Embed table, and {m!r} {what}"
                             f"{norm}; {fix}.")


# --- the model's own parameters, abstractly ---------------------------------------------------------------
_INIT_RNG_STREAMS = ("params", "dropout")


def _structs(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x, tree)


def linen_abstract_params(module: Any, args: Sequence[Any], kwargs: Mapping | None = None,
                          method: str = "__call__") -> Any:
    """``jax.eval_shape`` of ``module.init(rng, *args, method=method, **kwargs)['params']`` (arrays or shapes
    as the inputs); ``None`` when that init cannot run abstractly (a module needing other rng streams...)."""
    kwargs = dict(kwargs or {})
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args), kwargs))
    is_arr = [hasattr(x, "dtype") and hasattr(x, "shape") for x in leaves]
    arrays = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x, a in zip(leaves, is_arr) if a]

    def init(key, arrs):
        it = iter(arrs)
        a, kw = jax.tree_util.tree_unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, is_arr)])
        rngs = {s: key for s in _INIT_RNG_STREAMS}
        kw = dict(kw)
        if method != "__call__":
            kw["method"] = method
        return module.init(rngs, *a, **kw).get("params", {})

    try:
        return jax.eval_shape(init, jax.random.key(0), arrays)
    except Exception:
        return None


def traced_model_params(loss_fn: Callable, params: Any, batch: Any) -> tuple[Any, dict | None]:
    """Trace ``loss_fn(params, batch)`` abstractly (``trace_seen``) and return the model's own abstract
    parameters: ``linen_abstract_params`` of the root linen module the loss applied to exactly ``params``
    (its first call, on the inputs it got), or ``None`` (no such call: the loss transformed the parameters,
    or runs no linen module); and the trace's ``seen`` (``None`` if the trace raised: a tree the model
    refuses, compared here, else left to the step to raise)."""
    from spmd.parallel.plan._scan import trace_seen

    calls: list = []
    ids: list = []

    def on_call(mod, method, args, kwargs):
        if calls or mod.scope.path:
            return
        got = mod.variables.get("params", {})
        same = [id(x) for x in jax.tree.leaves(got)] == ids[0]
        calls.append((mod, method, _structs(args), _structs(kwargs)) if same else None)

    def run(p, b):
        ids.append([id(x) for x in jax.tree.leaves(p)])
        return loss_fn(p, b)

    try:
        seen = trace_seen(run, params, batch, on_call=on_call)[1]
    except Exception:  # the model refused the tree (ScopeParamShapeError...): compared below
        seen = None
    if not calls or calls[0] is None:
        return None, seen
    mod, method, args, kwargs = calls[0]
    try:
        unbound = mod.clone(parent=None)
    except Exception:
        return None, seen
    return linen_abstract_params(unbound, args, kwargs, method), seen
