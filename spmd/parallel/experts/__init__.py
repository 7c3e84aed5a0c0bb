"""Expert parallelism: a mixture of experts' tokens sent to the ranks holding their experts and back.

Inside an SPMD region whose experts dim is cut over a mesh dim (``ep``), ``expert_dispatch`` places each
rank's routed tokens into capacity-padded buffers and exchanges them with one ``all_to_all``, so each rank
holds the tokens of its own ``E / ep`` experts; ``expert_combine`` sends the experts' outputs back with the
inverse ``all_to_all`` and sums them by the router's weights; ``expert_capacity`` and ``expert_places`` are
the capacity routing both use (and ``models.MoE``). In the train step, ``ExpertParallel`` (a style on the ``ep``
dim, ``spmd.parallel.styles``) does the exchange around a model's own experts module.
"""

from spmd.parallel.experts._dispatch import (ExpertDispatch, expert_capacity, expert_combine, expert_dispatch,
                                            expert_places)

__all__ = ["ExpertDispatch", "expert_capacity", "expert_dispatch", "expert_combine", "expert_places"]
