"""Python operators and methods of DTensor (``x @ w``, ``y.sum(0)``, ``x.T``, ``x[:, 0]``).

``DTensorOps`` is a base class of ``DTensor``; every method forwards to ``spmd.ops``.
Comparisons are elementwise (as torch and jax.numpy), so a DTensor is not hashable.
"""

from __future__ import annotations

from spmd.tensor import _ops_elementwise as E
from spmd.tensor import _ops_interop as I
from spmd.tensor import _ops_linalg as L
from spmd.tensor import _ops_reduce as Rd
from spmd.tensor import _ops_views as V
from spmd.tensor._ops_exec import DTensorBase

__all__ = ["DTensorOps"]


class DTensorOps(DTensorBase):
    __slots__ = ()
    __hash__ = None  # == is elementwise

    def __add__(self, other):
        return E.add(self, other)

    def __radd__(self, other):
        return E.add(other, self)

    def __sub__(self, other):
        return E.subtract(self, other)

    def __rsub__(self, other):
        return E.subtract(other, self)

    def __mul__(self, other):
        return E.multiply(self, other)

    def __rmul__(self, other):
        return E.multiply(other, self)

    def __truediv__(self, other):
        return E.divide(self, other)

    def __rtruediv__(self, other):
        return E.divide(other, self)

    def __pow__(self, other):
        return E.power(self, other)

    def __rpow__(self, other):
        return E.power(other, self)

    def __matmul__(self, other):
        return L.matmul(self, other)

    def __rmatmul__(self, other):
        return L.matmul(other, self)

    def __neg__(self):
        return E.negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return E.abs(self)

    def __eq__(self, other):  # type: ignore[override]
        return E.equal(self, other)

    def __ne__(self, other):  # type: ignore[override]
        return E.not_equal(self, other)

    def __lt__(self, other):
        return E.less(self, other)

    def __le__(self, other):
        return E.less_equal(self, other)

    def __gt__(self, other):
        return E.greater(self, other)

    def __ge__(self, other):
        return E.greater_equal(self, other)

    def __getitem__(self, index):
        return V.getitem(self, index)

    def sum(self, axis=None, keepdims: bool = False):
        return Rd.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims: bool = False):
        return Rd.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims: bool = False):
        return Rd.max(self, axis, keepdims)

    def min(self, axis=None, keepdims: bool = False):
        return Rd.min(self, axis, keepdims)

    def prod(self, axis=None, keepdims: bool = False):
        return Rd.prod(self, axis, keepdims)

    @property
    def T(self):
        return V.transpose(self)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return V.transpose(self, axes or None)

    def reshape(self, *shape):
        return V.reshape(self, *shape)

    def astype(self, dtype):
        return E.astype(self, dtype)

    def to_jax(self):
        """This tensor as a ``jax.Array`` with the matching ``NamedSharding`` (even, no Partial)."""
        return I.to_jax(self)

    @classmethod
    def from_jax(cls, arr, device_mesh):
        """A DTensor from a ``jax.Array`` sharded by a ``NamedSharding`` over ``device_mesh``."""
        return I.from_jax(cls, arr, device_mesh)
