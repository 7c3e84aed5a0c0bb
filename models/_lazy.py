"""Lazy package names (PEP 562): a package's public names load from their modules on first use, so
importing the package imports no JAX (the job sets ``XLA_FLAGS`` before JAX starts)."""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["lazy_names"]


def lazy_names(package: str, where: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The package's ``__getattr__`` and ``__dir__``: name ``n`` is ``where[n]``'s attribute ``n``,
    imported on first use and kept in the package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str):
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
