"""Where a pipeline's stages begin: the even rule, or torch's explicit split points.

``split_points={"layers_4": SplitPoint.BEGINNING}`` (or ``"beginning"``; ``SplitPoint.END`` / ``"end"``:
the next stage begins after the module), as ``torch.distributed.pipelining.pipeline(..., split_spec=)``
takes them. Each split point names a unit (a module the ``units`` glob matches, ``.`` or ``/`` joined); the
points cut the units, in call order, into ``len(split_points) + 1`` consecutive stages, which must be the
``pp x stages_per_rank`` stages, each holding at least one unit. Stages may hold unequal counts: each rank
stores ``max(count)`` unit slots per stage and a shorter stage skips its extra zero slots. Without split
points the units are cut like ``numpy.array_split`` (the first ``L % S`` stages one unit more).
"""

from __future__ import annotations

import enum
import re
from typing import Any

from spmd.parallel.styles._transforms import glob_regex

__all__ = ["SplitPoint", "check_split_points", "stage_counts", "natural_key", "unit_modules"]


class SplitPoint(enum.Enum):
    """torch's ``SplitPoint``: a stage begins at the module (``BEGINNING``) or right after it (``END``)."""

    BEGINNING = "beginning"
    END = "end"


def natural_key(name: str) -> list:
    """``layers_2`` before ``layers_10``: digit runs compared as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def check_split_points(split_points: Any) -> dict[str, SplitPoint] | None:
    """``split_points`` as ``{module path ('/'-joined): SplitPoint}`` (None: the even rule)."""
    where = "pipeline"
    if split_points is None:
        return None
    if not isinstance(split_points, dict) or not split_points:
        raise TypeError(f"{where}: split_points={split_points!r} must be a non-empty dict of module name -> "
                        "SplitPoint.BEGINNING / SplitPoint.END (or 'beginning' / 'end'), e.g. {'layers_2': "
                        "'beginning'}.")
    out = {}
    for name, point in split_points.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: split_points key {name!r} must be a module name such as 'layers_2'.")
        try:
            point = SplitPoint(point.lower() if isinstance(point, str) else point)
        except ValueError:
            raise ValueError(f"{where}: split_points[{name!r}]={point!r} is not a split point; use "
                             "SplitPoint.BEGINNING or SplitPoint.END ('beginning' / 'end').") from None
        out[name.replace(".", "/")] = point
    return out


def stage_counts(units: list[str], n_units: int, n_stages: int, split_points: dict[str, SplitPoint] | None,
                 pp_text: str) -> list[int]:
    """Units per stage: the even rule, or the split points' cuts (``units`` in call order)."""
    where = "pipeline"
    if split_points is None:
        return [n_units // n_stages + (1 if c < n_units % n_stages else 0) for c in range(n_stages)]
    cuts = set()
    for name, point in split_points.items():
        if name not in units:
            raise ValueError(f"{where}: split_points names {name.replace('/', '.')!r}, which is no pipeline unit; "
                             f"the units are: {', '.join(u.replace('/', '.') for u in units)}. Name one of them.")
        i = units.index(name) + (1 if point is SplitPoint.END else 0)
        if i in (0, n_units) or i in cuts:
            raise ValueError(f"{where}: split_points[{name.replace('/', '.')!r}]={point} leaves a stage with no "
                             "unit (a cut before the first unit, after the last, or twice at one place); move or "
                             "drop it.")
        cuts.add(i)
    if len(cuts) + 1 != n_stages:
        raise ValueError(f"{where}: split_points={ {k.replace('/', '.'): str(v) for k, v in split_points.items()} } "
                         f"cut the units into {len(cuts) + 1} stages, but the pipeline has {n_stages} ({pp_text}); "
                         f"give {n_stages - 1} split points.")
    bounds = [0, *sorted(cuts), n_units]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def unit_modules(paths: list[str], units: str) -> list[str]:
    """Module paths (``/``-joined) matching the glob, outermost only, in parameter order."""
    pat = glob_regex(units, "/")
    out: list[str] = []
    for p in paths:
        comps = p.split("/")
        for i in range(1, len(comps)):
            m = "/".join(comps[:i])
            if re.fullmatch(pat, m):
                if m not in out:
                    out.append(m)
                break
    return out
