"""Turning what a caller passes into an array, with the project's error when it is not one."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._torch import is_torch_tensor, torch_numpy

__all__ = ["as_array"]


def as_array(x: Any, where: str, arg: str):
    """``x`` as an array: a ``jax.Array`` as it is, anything else through ``np.asarray``.

    A value that is not a numeric (or bool) array, e.g. a string, an object array
    or something ``np.asarray`` refuses, is a ``TypeError`` naming ``where`` and ``arg``.
    """
    if isinstance(x, jax.Array):
        return x
    if type(x) is np.ndarray and x.dtype.kind in "biufc":  # the common case, without jnp.issubdtype
        return x
    try:
        a = torch_numpy(x) if is_torch_tensor(x) else np.asarray(x)  # a torch tensor: requires_grad / bfloat16 too
    except Exception:
        a = None
    if a is None or not (a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.number)):  # bfloat16 & co. too
        raise TypeError(
            f"{where}: {arg}={x!r} is not a numeric array; pass a NumPy or JAX array (or anything np.asarray "
            "turns into one) of a bool, integer, float or complex dtype."
        )
    return a
