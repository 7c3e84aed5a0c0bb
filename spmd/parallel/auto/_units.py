"""The units a pipeline cuts, read from a model's parameters: how many modules a unit glob matches, and whether
they all hold the same parameters (the check ``pipeline`` runs before it cuts stages, here on the shapes alone).
Shared by ``auto_layout``'s pipeline candidates (``_pipeline``) and its cp / ep ones (``_cpep``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd.parallel.plan._param_plan import path_str
from spmd.parallel.pipelining._pipeline import unit_modules

__all__ = ["count_units", "units_alike"]


def count_units(params: Any, glob: str) -> int:
    """How many modules of ``params`` the pipeline glob matches (the stages it can cut)."""
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return len(unit_modules(paths, glob.replace(".", "/")))


def units_alike(params: Any, glob: str) -> bool:
    """Whether the modules of ``params`` the pipeline glob matches all hold the same parameters (relative paths,
    shapes and dtypes): the check ``pipeline`` runs on its units before it cuts stages (it refuses units of
    other parameters, such as an MoE's blocks with experts beside blocks without), here on the shapes alone."""
    leaves = {path_str(kp): (tuple(np.shape(x)), str(x.dtype))
              for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    found = unit_modules(list(leaves), glob.replace(".", "/"))
    kinds = {tuple(sorted((p[len(u) + 1:], v) for p, v in leaves.items() if p.startswith(u + "/"))) for u in found}
    return len(kinds) <= 1
