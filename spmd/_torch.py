"""A CPU torch tensor as a NumPy array sharing its memory (bfloat16 included), without importing torch
(used wherever the project takes a tensor: the c10d facade, its in-place writes, DTensor constructors).

NumPy has no bfloat16, so ``tensor.numpy()`` refuses it; its bits are viewed as
int16 by torch, then as ``ml_dtypes.bfloat16`` (JAX's bfloat16) by NumPy: same
memory, so a collective's result can be written back into the tensor.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["is_torch_tensor", "torch_numpy"]


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy") and hasattr(x, "dtype")


def torch_numpy(x: Any) -> np.ndarray:
    """``x.detach().numpy()``, bfloat16 as ``ml_dtypes.bfloat16``; raises for a tensor not in CPU memory."""
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        import torch  # only reached with a torch tensor in hand

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
