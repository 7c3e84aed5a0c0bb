"""The one cache of DTensor programs: per mesh, weakly held, bounded, least recently used out.

Entries live under their ``DeviceMesh`` in a ``weakref.WeakKeyDictionary``: when
the mesh dies its programs go with it (a program holds the ``jax.sharding.Mesh``,
never the ``DeviceMesh``). Under a mesh, at most ``MAX_PER_MESH`` entries; a new
one pushes out the least recently used, one at a time. Kinds of keys:

* a plan (``placements.Plan``, a value): its jitted program;
* a redistribute request ``(src placements, shape, dtype, requested placements)``:
  the checked destination placements and the program, so that a repeated
  ``redistribute`` is one look-up and the jitted call;
* ``("op", ...)`` / ``("interop", ...)``: the program of a DTensor op call (``_ops_exec.py``) or of a
  ``to_jax`` / ``from_jax`` conversion (``_ops_interop.py``).

A memo only: what it returns is what it would compute again.
"""

from __future__ import annotations

import collections
import weakref

from placements._plan import Plan
from spmd.tensor._lower import build_program

__all__ = ["MAX_PER_MESH", "lookup", "remember", "program"]

#: Entries kept per mesh.
MAX_PER_MESH = 1024

_BY_MESH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lookup(mesh, key):
    """The entry of ``key`` under ``mesh`` (now the most recent), or None."""
    entries = _BY_MESH.get(mesh)
    if entries is None:
        return None
    hit = entries.get(key)
    if hit is not None:
        entries.move_to_end(key)
    return hit


def remember(mesh, key, value) -> None:
    entries = _BY_MESH.get(mesh)
    if entries is None:
        entries = _BY_MESH[mesh] = collections.OrderedDict()
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > MAX_PER_MESH:
        entries.popitem(last=False)


def program(mesh, plan: Plan):
    """The jitted program ``storage -> storage`` of ``plan`` on ``mesh`` (built once per mesh and plan)."""
    fn = lookup(mesh, plan)
    if fn is None:
        fn = build_program(mesh, plan)
        remember(mesh, plan, fn)
    return fn
