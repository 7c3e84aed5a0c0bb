"""Process groups: ``new_group``, ``group.WORLD`` and the rank queries that take a group.

A :class:`Group` is an immutable set of global ranks; WORLD (``ranks=None``)
is every rank. ``group_of`` resolves a collective's ``group=`` argument and
``peer_rank`` its ``src=``/``dst=`` (or ``group_src=``/``group_dst=``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import warnings
from typing import Any, Callable

from spmd.distributed._backend import resolve_backend
from spmd.distributed._state import state

__all__ = [
    "NotAMemberWarning",
    "members_only",
    "Group",
    "group",
    "group_of",
    "peer_rank",
    "peer_of",
    "new_group",
    "get_process_group_ranks",
    "get_group_rank",
    "get_global_rank",
    "get_rank",
    "get_world_size",
    "get_backend",
]


class NotAMemberWarning(UserWarning):
    """A rank called a collective of a group it is not a member of (it does nothing there)."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A set of ranks (``new_group(ranks)``); ``ranks=None`` is the default group (WORLD).

    Group ranks follow the order of the global ranks (as torch sorts them).
    ``g.rank()`` is this process's rank in the group (-1 if it is not a member);
    ``g.size()`` the number of ranks.
    """

    ranks: tuple[int, ...] | None = None

    def global_ranks(self) -> tuple[int, ...]:
        return _all_ranks(state("Group").world_size) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self.global_ranks())

    def rank(self) -> int:
        me = state("Group.rank").rank
        ranks = self.global_ranks()
        return ranks.index(me) if me in ranks else -1

    def __repr__(self) -> str:
        return "Group(WORLD)" if self.ranks is None else f"Group(ranks={list(self.ranks)})"


@functools.lru_cache(maxsize=8)
def _all_ranks(world: int) -> tuple[int, ...]:
    return tuple(range(world))


class group:  # noqa: N801 - torch's name: dist.group.WORLD
    """``group.WORLD``: the default group of all ranks."""

    WORLD = Group(None)


def group_of(g: Any, where: str, *, non_member: str = "warn") -> Group | None:
    """The :class:`Group` meant by ``group=``: None (WORLD) or a Group. On a rank outside it,
    ``non_member`` says what happens: ``"warn"`` gives None and a :class:`NotAMemberWarning`, as in
    torch (whose collectives do nothing there); ``"raise"`` refuses with a ValueError; ``"allow"``
    returns the group anyway (the rank queries, which answer -1 there)."""
    state(where)
    resolved = group.WORLD if g is None else g
    if not isinstance(resolved, Group):
        raise TypeError(f"{where}: group={g!r} must be None (all ranks) or a group from dist.new_group(ranks).")
    if non_member == "allow" or resolved.rank() >= 0:
        return resolved
    me = state(where).rank
    if non_member == "raise":
        raise ValueError(
            f"{where}: rank {me} is not a member of group={resolved!r}; only the group's ranks call its "
            "collectives (as in torch)."
        )
    warnings.warn(
        f"{where}: rank {me} is not a member of group={resolved!r}; the call does nothing "
        "on this rank (as in torch) and returns None.",
        NotAMemberWarning,
        stacklevel=3,
    )
    return None


def members_only(fn: Callable | None = None, /, *, fast: tuple[Callable, Callable] | None = None) -> Callable:
    """Decorate a collective ``fn(..., group=None, ...)``: it runs with ``group=`` resolved to a
    :class:`Group` by :func:`group_of`; on a rank outside the group it warns and returns None,
    doing nothing, as torch's collectives do there.

    ``fast=(hit, learn)`` (the MPI fast path, :mod:`spmd.distributed._mpi_fast`): ``hit`` takes the
    caller's arguments first and gives the result of a cached call, or NotImplemented; then ``fn``
    runs and ``learn(result, *args, **kwargs)`` may keep what the call resolved."""
    if fn is None:
        return functools.partial(members_only, fast=fast)
    names = list(inspect.signature(fn).parameters)
    at = names.index("group")  # group= by position or by name; no Signature.bind per call (it is slow)
    hit, learn = fast if fast is not None else (None, None)

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if hit is not None:
            out = hit(*args, **kwargs)
            if out is not NotImplemented:
                return out
            given = (args, dict(kwargs))
        positional = len(args) > at
        g = group_of(args[at] if positional else kwargs.get("group"), fn.__name__)
        if g is None:
            return None
        if positional:
            args = args[:at] + (g,) + args[at + 1:]
        else:
            kwargs["group"] = g
        out = fn(*args, **kwargs)
        if learn is not None:
            learn(out, *given[0], **given[1])
        return out

    return collective


def _group_rank(g: Group, global_rank: Any, where: str, arg: str) -> int:
    ranks = g.global_ranks()
    if isinstance(global_rank, bool) or not isinstance(global_rank, numbers.Integral):
        raise TypeError(f"{where}: {arg}={global_rank!r} must be an int rank.")
    if int(global_rank) not in ranks:
        raise ValueError(f"{where}: {arg}={global_rank!r} is not a rank of {g!r} (ranks {list(ranks)}).")
    return ranks.index(int(global_rank))


def peer_rank(g: Group, global_rank: Any, group_rank: Any, where: str, arg: str) -> int:
    """The group rank meant by torch's ``src=``/``dst=`` (global) or ``group_src=``/``group_dst=``."""
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(f"{where}: pass {arg}= or group_{arg}=, not both.")
        n = g.size()
        if isinstance(group_rank, bool) or not isinstance(group_rank, numbers.Integral) or not 0 <= group_rank < n:
            raise ValueError(f"{where}: group_{arg}={group_rank!r} must be an int in [0, {n - 1}].")
        return int(group_rank)
    if global_rank is None:
        raise TypeError(f"{where}: {arg}= is required.")
    return _group_rank(g, global_rank, where, arg)



def peer_of(g: Group, global_rank: Any, group_rank: Any, where: str, arg: str) -> int:
    """The global rank of a point-to-point peer (``dst=``/``src=``, or ``group_dst=``/``group_src=``);
    this rank itself is refused."""
    p = g.global_ranks()[peer_rank(g, global_rank, group_rank, where, arg)]
    if p == state(where).rank:
        raise ValueError(f"{where}: {arg}={p} is this rank; send to / receive from another rank.")
    return p

def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None, **kwargs) -> Group:
    """A group of some ranks, as ``torch.distributed.new_group(ranks)``.

    Any set of distinct ranks works: XLA runs a group's collective as a program
    over the members' devices only, so non-members need not call it (nor even
    call ``new_group``). ``ranks=None`` gives the default group.
    """
    where = "new_group"
    st = state(where)
    if ranks is None:
        return group.WORLD
    try:
        items = list(ranks)
    except TypeError:
        raise TypeError(f"{where}: ranks={ranks!r} must be a list of ints such as [0, 1].") from None
    if not items:
        raise ValueError(f"{where}: ranks={ranks!r} is empty; name at least one rank.")
    for r in items:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{where}: ranks={ranks!r} holds {r!r}; every rank must be an int.")
        if not 0 <= r < st.world_size:
            raise ValueError(
                f"{where}: ranks={ranks!r} holds {r}, out of range for world size {st.world_size}; "
                f"use ranks in [0, {st.world_size - 1}]."
            )
    if len(set(items)) != len(items):
        raise ValueError(f"{where}: ranks={ranks!r} repeats a rank; list each rank once.")
    if backend is not None and resolve_backend(backend, where).name != st.backend.name:
        raise ValueError(
            f"{where}: backend={backend!r} differs from the default group's {st.backend.name!r}; "
            "one process runs one backend here (omit backend=)."
        )
    ranks_t = tuple(sorted(items))
    return group.WORLD if ranks_t == tuple(range(st.world_size)) else Group(ranks_t)


def get_process_group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (``None``: the world), in group-rank order."""
    g = group_of(group, "get_process_group_ranks", non_member="allow")
    return list(g.global_ranks())


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank inside ``group`` of the process whose global rank is ``global_rank``."""
    return _group_rank(group_of(group, "get_group_rank", non_member="allow"), global_rank, "get_group_rank", "global_rank")


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of the process whose rank inside ``group`` is ``group_rank``."""
    g = group_of(group, "get_global_rank", non_member="allow")
    ranks = g.global_ranks()
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(f"get_global_rank: group_rank={group_rank!r} is out of range for {g!r} of size {len(ranks)}.")
    return ranks[group_rank]


def get_rank(group: Any = None) -> int:
    """This process's rank (in ``group`` if given; -1 if not a member), as torch."""
    if group is None:
        return state("get_rank").rank
    return group_of(group, "get_rank", non_member="allow").rank()


def get_world_size(group: Any = None) -> int:
    """The number of ranks (of ``group`` if given; -1 if this rank is not a member), as torch."""
    if group is None:
        return state("get_world_size").world_size
    g = group_of(group, "get_world_size", non_member="allow")
    return g.size() if g.rank() >= 0 else -1


def get_backend(group: Any = None) -> str:
    """The backend name of ``group`` (``None``: the world), e.g. ``'gloo'``, ``'nccl'`` or ``'mpi'``."""
    group_of(group, "get_backend", non_member="allow")
    return state("get_backend").backend.name
