"""Global-view ops on DTensors, with torch DTensor's output placements by default.

``jax.numpy`` / ``jax.nn`` names; the same ops are DTensor operators and methods
(``x @ w``, ``y.sum(0)``, ``x.T``). Each op picks a strategy (placement rules in
``placements._strategy``), redistributes its inputs if the strategy asks, and runs
the local op on every rank as one jitted program; it composes with ``jax.jit``.
``explain(fn, *args)`` prints what a function will communicate before it runs, with the cost of
the cheapest strategy beside torch's; ``with placement_strategy("cheapest"):`` opts into it.
"""

from spmd.tensor._ops_crossmesh import plan_cross_mesh
from spmd.tensor._ops_exec import placement_strategy
from spmd.tensor._ops_elementwise import (
    abs,
    add,
    astype,
    divide,
    equal,
    exp,
    gelu,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    maximum,
    minimum,
    multiply,
    negative,
    not_equal,
    power,
    relu,
    sigmoid,
    sqrt,
    subtract,
    tanh,
    where,
)
from spmd.ops._explain import Explanation, explain
from spmd.ops._grad import grad, placed_gradient, value_and_grad
from spmd.tensor._ops_linalg import einsum, matmul
from spmd.tensor._ops_reduce import layer_norm, log_softmax, max, mean, min, prod, softmax, sum
from spmd.tensor._ops_views import getitem, reshape, transpose

__all__ = [
    "exp", "log", "tanh", "sqrt", "abs", "negative", "relu", "gelu", "sigmoid",
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "where", "astype",
    "sum", "mean", "max", "min", "prod", "softmax", "log_softmax", "layer_norm",
    "matmul", "einsum", "transpose", "reshape", "getitem",
    "explain", "Explanation", "grad", "value_and_grad", "placed_gradient",
    "plan_cross_mesh", "placement_strategy",
]
