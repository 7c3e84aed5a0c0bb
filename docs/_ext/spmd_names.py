"""The public names of every public module, and which ones lack a docstring (no Sphinx needed).

``MODULES`` orders the public modules; a name re-exported by several (``spmd.Shard`` is
``placements.Shard``) has its home in the first. ``missing_docstrings()`` lists public names with no
docstring (a test asks for none); the ``spmd-api`` directive (``spmd_api.py``) renders the pages.
"""

from __future__ import annotations

import importlib
import inspect

# Every public module, in the order a name is given its home (its first module here).
MODULES = (
    "placements",
    "spmd",
    "spmd.tensor",
    "spmd.ops",
    "spmd.parallel",
    "spmd.distributed",
    "spmd.distributed.device_mesh",
    "spmd.distributed.tensor",
    "spmd.distributed.tensor.debug",
    "spmd.testing",
    "models",
)


# Public constants (values have no docstring of their own).
CONSTANTS = {
    "placements.PARTIAL_OPS": "The reduce ops a ``Partial`` placement may carry: "
    "``('sum', 'avg', 'max', 'min', 'product')``.",
    "placements.LATENCY_BYTES": "The planner's latency term: each collective of a plan costs this many bytes "
    "(64 KiB) on top of its traffic, so plans with fewer collectives win on small tensors.",
    "placements.TRANSITIONS": "The transition table: for each legal (source kind, destination kind) of one mesh "
    "dim, its collective, how its bytes are counted, its traffic and the name of its lowering. The planner, "
    "the JAX lowering and the NumPy simulator all read it; a pair absent here is not a step.",
    "spmd.parallel.HARDWARE": "The built-in ``Hardware`` by name (``'h100'``, ``'h200'``, ``'a100-80g'``, "
    "``'tpu-v5p'``), each from its vendor's published figures; ``Hardware.named(name)`` looks one up.",
    "spmd.parallel.ROOT": "``'root'``: the name of the unit holding every parameter that no ``units`` pattern "
    "matched (torch's root ``fully_shard``).",
}


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_") and not inspect.ismodule(getattr(module, n))]
    return list(names)


def _key(obj):
    return id(obj)


def homes() -> dict[int, str]:
    """id(object) -> the qualified name that describes it (its first module's)."""
    seen: dict[int, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            obj = getattr(module, name)
            if _documentable(obj):
                seen.setdefault(_key(obj), f"{module_name}.{name}")
    return seen


def _documentable(obj) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj)


def _directive(obj) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    if inspect.isroutine(obj):
        return "autofunction"
    return "autodata"


def missing_docstrings() -> list[str]:
    out = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            obj = getattr(module, name)
            if not _documentable(obj):
                if f"{module_name}.{name}" not in CONSTANTS:
                    out.append(f"{module_name}.{name}")
                continue
            if not (inspect.getdoc(obj) or "").strip():
                out.append(f"{module_name}.{name}")
    return out
