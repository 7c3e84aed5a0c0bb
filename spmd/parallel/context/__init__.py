"""Context parallelism: attention over a sequence cut on a mesh dim (``cp``).

``ring_attention`` passes K/V around the ring with ``ppermute`` and an online softmax;
``allgather_attention`` all-gathers K/V and attends locally. Both run inside an SPMD region with causal
masks by global position, segment ids (packed sequences) and GQA. ``zigzag_permutation`` orders a batch
for torch's head-tail cut, which balances causal work over the ranks (``causal_work`` counts it).
"""

from spmd.parallel.context._attention import allgather_attention, ring_attention
from spmd.parallel.context._layout import causal_work, unzigzag_permutation, zigzag_permutation

__all__ = ["allgather_attention", "causal_work", "ring_attention", "unzigzag_permutation", "zigzag_permutation"]
