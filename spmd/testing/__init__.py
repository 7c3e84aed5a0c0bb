"""Testing aids: a NumPy simulator of redistribute plans, checked against the real programs."""

from spmd.testing._simulate import np_storage, simulate_plan

__all__ = ["simulate_plan", "np_storage"]
