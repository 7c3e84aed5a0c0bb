"""A one-device step's cost at a new batch size, derived from its compiles at two others (``Profile``).

``auto_layout`` reads the user's step on one device at each micro-batch size its candidates run (``dp=8``
and ``dp=4,tp=2`` differ in rows per device), one compile each. What it reads, XLA's ``cost_analysis``
flops and bytes accessed and the program's operations, is affine in the rows: each operation of the step
works either on the batch (its work proportional to the rows) or on the parameters alone (a constant), and
its operations are the same program's. So two compiles at ``b1`` and ``b2`` rows give every other ``b``:
``v(b) = v(b1) + (v(b2) - v(b1)) (b - b1) / (b2 - b1)``, nothing fitted. That holds where the program is
the same at every size and its work affine, which is checked, not assumed: the loss's jaxpr (traced on
shape structs, nothing compiled; its gradient's operations are each forward operation's transposes, whose
work scales as it does) must have the same equations at ``b`` as at ``b1`` and ``b2``, and their summed
output elements and matmul flops must be affine in the rows (an MoE's capacity grows with the
tokens and its dispatch matmul with their square: compiled, not derived). On the suite's Transformer the
derived flops are within 1e-6 and the bytes within 2e-4 of the compiled ones at 64 and 128 rows (from 16
and 32), the operations equal. XLA's temp bytes are not affine (its buffer assignment), and a derived
entry has none (``None``: nothing reads it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
from spmd.parallel._jaxprs import sub_jaxprs

__all__ = ["InBatch"]


def _sig(jaxpr, times: float, acc: list) -> None:
    """``acc`` = [equations, output elements, matmul flops] of ``jaxpr`` and its sub-jaxprs (a scan's body
    its length times)."""
    for e in jaxpr.eqns:
        acc[0] += 1
        acc[1] += times * sum(math.prod(getattr(v.aval, "shape", ())) for v in e.outvars)
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            acc[2] += times * 2.0 * math.prod(e.invars[0].aval.shape[d] for d in lc) * math.prod(
                e.outvars[0].aval.shape)
        n = times * (e.params.get("length", 1) if e.primitive.name == "scan" else 1)
        for inner in sub_jaxprs(e):
            _sig(inner, n, acc)


class InBatch:
    """The compiled costs of one loss's step by rows, per shape of the rest of the batch, and those derived
    from them (see the module doc)."""

    def __init__(self, loss: Callable, params: Any):
        self.loss, self.params = loss, params
        self._compiled: dict = {}  # the batch's shapes past the rows -> {rows: cost tuple}
        self._sigs: dict = {}  # (rest, rows) -> the gradient jaxpr's signature (_sig)

    @staticmethod
    def _split(batch: Any) -> tuple[tuple, int] | None:
        leaves = jax.tree.leaves(batch)
        if not leaves or any(len(x.shape) == 0 or x.shape[0] != leaves[0].shape[0] for x in leaves):
            return None
        rest = (jax.tree_util.tree_structure(batch), tuple((tuple(x.shape[1:]), str(x.dtype)) for x in leaves))
        return rest, int(leaves[0].shape[0])

    def _signature(self, rest: tuple, rows: int, batch: Any) -> tuple:
        if (rest, rows) not in self._sigs:
            acc = [0, 0.0, 0.0]
            _sig(jax.make_jaxpr(self.loss)(self.params, batch).jaxpr, 1.0, acc)
            self._sigs[(rest, rows)] = tuple(acc)
        return self._sigs[(rest, rows)]

    def derived(self, batch: Any) -> tuple | None:
        """The cost at ``batch`` from two compiled at other rows of the same shapes, or None where fewer than
        two are compiled or the work is not affine."""
        split = self._split(batch)
        if split is None:
            return None
        rest, b = split
        seen = self._compiled.get(rest, {})
        if len(seen) < 2 or b in seen:
            return None
        b1, b2 = sorted(seen)[:2]

        def at(rows: int) -> Any:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)

        s1, s2 = self._signature(rest, b1, at(b1)), self._signature(rest, b2, at(b2))
        s = self._signature(rest, b, batch)
        t = (b - b1) / (b2 - b1)
        affine = s[0] == s1[0] == s2[0] and all(
            math.isclose(s[i], s1[i] + (s2[i] - s1[i]) * t, rel_tol=1e-9, abs_tol=0.5) for i in (1, 2))
        c1, c2 = seen[b1], seen[b2]
        if not affine or c1[3] != c2[3]:  # the operations of one program are the same at every size
            return None
        return (c1[0] + (c2[0] - c1[0]) * t, c1[1] + (c2[1] - c1[1]) * t, None, c1[3])

    def compiled(self, batch: Any, cost: tuple) -> None:
        """Record ``cost``, compiled at ``batch``."""
        split = self._split(batch)
        if split is not None:
            self._compiled.setdefault(split[0], {})[split[1]] = cost
