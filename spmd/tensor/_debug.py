"""``visualize_sharding``, as ``torch.distributed.tensor.debug`` has it (``CommDebugMode`` is ``spmd/_debug.py``'s)."""

from __future__ import annotations

from typing import Any

from spmd.tensor._dtensor import DTensor

__all__ = ["visualize_sharding"]


def visualize_sharding(dtensor: Any, header: str = "", use_rich: bool = False) -> None:
    """Print which ranks hold which block of ``dtensor`` (torch's ``visualize_sharding``), under
    ``header`` if given."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(
            f"visualize_sharding: dtensor={dtensor!r} must be a DTensor; make one with distribute_tensor or "
            "DTensor.from_local."
        )
    text = dtensor.visualize(print_out=False)
    print(f"{header}\n{text}" if header else text)
