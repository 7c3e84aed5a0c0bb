"""``torch.distributed.tensor.debug``'s names: ``CommDebugMode`` and ``visualize_sharding``."""

from spmd._debug import CommDebugMode
from spmd.tensor._debug import visualize_sharding

__all__ = ["CommDebugMode", "visualize_sharding"]
