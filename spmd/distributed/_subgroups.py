"""``new_subgroups`` and ``new_subgroups_by_enumeration``, as torch: one group per block of ranks."""

from __future__ import annotations

import os
from typing import Any

from spmd.distributed._groups import group_of, new_group
from spmd.distributed._state import state

__all__ = ["new_subgroups", "new_subgroups_by_enumeration"]


def new_subgroups(group_size: int | None = None, group: Any = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, group_desc: str | None = None) -> tuple[Any, list]:
    """Cut the ranks of ``group`` (default: all) into consecutive blocks of ``group_size``;
    returns (this rank's subgroup, every subgroup). ``group_size`` defaults to the ranks per
    node (``LOCAL_WORLD_SIZE``, which spmdrun sets; torch uses the GPUs per node)."""
    where = "new_subgroups"
    ranks = list(group_of(group, where, non_member="raise").global_ranks())
    if group_size is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        group_size = int(raw) if raw and raw.isdigit() else len(ranks)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"{where}: group_size={group_size!r} must be an int.")
    if not 0 < group_size <= len(ranks) or len(ranks) % group_size:
        raise ValueError(
            f"{where}: group_size={group_size!r} must be in [1, {len(ranks)}] and divide the {len(ranks)} ranks "
            "of the group."
        )
    blocks = [ranks[i:i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(blocks, timeout=timeout, backend=backend, pg_options=pg_options)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Any, timeout: Any = None, backend: Any = None,
                                 pg_options: Any = None, group_desc: str | None = None) -> tuple[Any, list]:
    """One group per list of ranks (disjoint); returns (this rank's subgroup or None, every subgroup)."""
    where = "new_subgroups_by_enumeration"
    me = state(where).rank
    if not isinstance(ranks_per_subgroup_list, (list, tuple)):
        raise TypeError(f"{where}: ranks_per_subgroup_list={ranks_per_subgroup_list!r} must be a list of rank lists such as [[0, 1], [2, 3]].")
    if not ranks_per_subgroup_list:
        raise ValueError(f"{where}: ranks_per_subgroup_list=[] names no subgroup; give at least one list of ranks.")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        if not isinstance(ranks, (list, tuple)):
            raise TypeError(f"{where}: ranks_per_subgroup_list holds {ranks!r}; each entry must be a list of ranks.")
        overlap = seen.intersection(ranks)
        if overlap:
            raise ValueError(f"{where}: rank(s) {sorted(overlap)} appear in more than one subgroup; subgroups must be disjoint.")
        seen.update(ranks)
    subgroups = [new_group(list(ranks), timeout, backend, pg_options) for ranks in ranks_per_subgroup_list]
    mine = next((g for g, ranks in zip(subgroups, ranks_per_subgroup_list) if me in ranks), None)
    return mine, subgroups
