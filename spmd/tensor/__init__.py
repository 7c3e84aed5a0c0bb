"""DTensor: a global tensor laid out over a DeviceMesh by Shard / Replicate / Partial placements.

Layout of the package (internal modules):

* ``_dtensor.py``: the class (properties, local views, ``full_tensor``, ``redistribute``);
  ``physical`` / ``from_physical`` for the rest of ``spmd``;
* ``_distribute.py``: ``distribute_tensor``, ``plan_redistribute``;
* ``_local.py``: ``DTensor.from_local`` (one process, or this process's tensor);
* ``_storage.py``: the padded, stacked storage (building it, reading a block);
* ``_checks.py``: argument validation;
* ``_tables.py``: the index tables of a redistribute step (NumPy);
* ``_lower.py``: one JAX lowering per transition kind, the plan's program;
* ``_dispatch.py``: the one program cache (per mesh, weak, bounded);
* ``_visualize.py``: ``DTensor.visualize``; ``_debug.py``: ``visualize_sharding`` (torch's debug name);
* ``_source.py``: a multi-process ``distribute_tensor``'s source rank;
* ``_ops_*.py``: DTensor operators and methods (``spmd.ops``), executed per op strategy.
"""

from spmd.tensor._distribute import distribute_tensor, plan_redistribute
from spmd.tensor._dtensor import DTensor

__all__ = ["DTensor", "distribute_tensor", "plan_redistribute"]
