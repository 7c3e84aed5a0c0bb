"""Which inputs and outputs of a model's module calls hold the batch's sequence under cp, read from the program.

A module run on the sequence gathered over cp (``ContextCalls.around``) gathers its ``[batch, seq, ...]`` inputs and
cuts its outputs back. Whether a leaf holds the sequence on dim 1 is not read from its size (a ``[batch, d]``
input whose width ``d`` happens to equal the sequence length is no sequence) but from how the program shapes it:
the step is traced once more at another sequence length, and a leaf holds the sequence where its dim 1 follows
the batch's.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["batch_seq", "seq_batch", "seq_inputs", "seq_leaves"]

_TRACE_ERRORS: tuple = (TypeError, ValueError, IndexError)


def _trace_errors() -> tuple:
    """What a trace at the wrong shapes raises: JAX's shape errors, and flax's (a parameter whose shape the input
    no longer fits)."""
    try:
        from flax.errors import FlaxError
    except ImportError:  # flax is optional
        return _TRACE_ERRORS
    return _TRACE_ERRORS + (FlaxError,)


def seq_leaves(at: dict, at_probe: dict, seq_len: int, probe_len: int) -> dict:
    """``{(fqn, k): (ins, outs)}``: which leaves of the ``k``-th call of module ``fqn`` (its inputs, its outputs)
    hold the batch's sequence on dim 1. ``at`` / ``at_probe``: the calls' leaves' dim 1 (``ContextCalls.dims``) in
    a trace of the step at the batch's ``seq_len`` and in one at another length ``probe_len``; a leaf is the
    sequence where its dim 1 follows the batch's (``seq_len`` in one, ``probe_len`` in the other), not where it
    merely equals ``seq_len``. A call whose leaves differ between the two traces is left out (the dim-1 rule)."""
    out = {}
    for key, (ins, outs) in at.items():
        other = at_probe.get(key)
        if other is None or len(other[0]) != len(ins) or len(other[1]) != len(outs):
            continue
        out[key] = tuple(tuple(a == seq_len and b == probe_len for a, b in zip(x, y))
                         for x, y in ((ins, other[0]), (outs, other[1])))
    return out


def seq_inputs(trace: Callable[[Any], Any], first: Any, batch: Any, seq_len: int, n: int, seq_of: dict,
               cut: tuple[bool, ...] | None = None) -> dict:
    """The modules taking the sequence (``ContextCalls.seen``, read from the program): ``trace(batch)`` traces the
    step on a batch and returns its ``ContextCalls``; ``first`` is the trace's at ``batch``. The step is traced
    again with the batch's sequence at ``seq_len - n`` positions (the leaves ``cut`` names, ``batch_seq``'s; None:
    every leaf of rank 2+) and ``seq_of`` filled by ``seq_leaves``. A model whose shapes fix the sequence length
    (it does not trace at another), or a sequence of ``n`` positions, keeps the dim-1 rule."""
    if seq_len <= n:
        return first.seen
    probe = seq_len - n
    leaves, tree = jax.tree.flatten(batch)
    cut = tuple(np.ndim(x) >= 2 for x in leaves) if cut is None else cut
    short = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct((x.shape[0], probe) + tuple(x.shape[2:]), x.dtype)
                                      if c else x for x, c in zip(leaves, cut)])
    try:
        other = trace(short)
    except _trace_errors():
        return first.seen
    seq_of.update(seq_leaves(first.dims, other.dims, seq_len, probe))
    seen: dict[str, bool] = {}
    for key, (ins, _) in first.dims.items():
        got = seq_of[key][0] if key in seq_of else tuple(d == seq_len for d in ins)
        seen[key[0]] = seen.get(key[0], False) or any(got)
    return seen


def _traced_cut(trace: Callable[[Any], Any], batch: Any, seq_len: int, n: int, most: int) -> tuple[bool, ...] | None:
    """``seq_batch``'s reading: the leaves whose dim 1 is ``seq_len`` that ``trace`` takes at ``seq_len - n``
    positions (all of them first, then the fewest kept at ``seq_len``, at most ``most`` traces), or None where it
    takes no such set."""
    leaves, tree = jax.tree.flatten(batch)
    cand = [i for i, x in enumerate(leaves) if np.ndim(x) >= 2 and np.shape(x)[1] == seq_len]
    errors, tried = _trace_errors(), 0
    for k in range(len(cand)):
        for keep in itertools.combinations(cand, k):
            if tried == most:
                return None
            tried += 1
            cut = tuple(i in cand and i not in keep for i in range(len(leaves)))
            short = [jax.ShapeDtypeStruct((np.shape(x)[0], seq_len - n, *np.shape(x)[2:]) if c else np.shape(x),
                                          jnp.result_type(x)) for x, c in zip(leaves, cut)]
            try:
                trace(jax.tree.unflatten(tree, short))
            except errors:
                continue
            return cut
    return None


def seq_batch(trace: Callable[[Any], Any], batch: Any, seq_len: int, n: int, most: int = 64) -> tuple[bool, ...]:
    """Which leaves of ``batch`` (in ``jax.tree.leaves`` order) hold the sequence on dim 1, read from the program:
    ``trace(b)`` traces the step (shapes only) on a batch ``b``. The candidates are the leaves whose dim 1 is
    ``seq_len``; the step is traced with them at ``seq_len - n`` positions, and where it does not trace, with
    fewer of them (the fewest kept at ``seq_len`` first, at most ``most`` traces). The leaves it traces shortened
    are the sequence; one the program needs at its width (a ``[batch, d]`` vector with ``d == seq_len`` into a
    dense layer) is not. A step that traces at no such set (its shapes fix the sequence length), or a sequence of
    ``n`` positions, keeps the dim-1 rule."""
    leaves = jax.tree.leaves(batch)
    dim1 = tuple(np.ndim(x) >= 2 and np.shape(x)[1] == seq_len for x in leaves)
    if seq_len <= n or not any(dim1):
        return dim1
    cut = _traced_cut(trace, batch, seq_len, n, most)
    return dim1 if cut is None else cut


def batch_seq(trace: Callable[[Any], Any], batch: Any, n: int, where: str = "train_step",
              most: int = 64) -> tuple[int, tuple[bool, ...]]:
    """``(seq_len, cut)``: the batch's sequence length and which leaves of ``batch`` (``jax.tree.leaves`` order) hold
    it on dim 1, to cut over cp=``n``, read from the program (``trace(b)``: ``loss_fn`` traced, shapes only, on a
    batch ``b``). Leaves of one dim-1 length: ``seq_batch``. Leaves whose dim 1 differs: the sequence is the one
    length whose leaves the program takes at ``n`` fewer positions (``seq_batch``'s reading, each length on its
    own, the other leaves as given); a leaf of another length is no sequence and stays whole over cp. Refused
    (``ValueError``, naming the leaves by path) where no leaf has a dim 1, where the program takes no length or
    several that way (which is the sequence is ambiguous), or where ``n`` does not divide the sequence."""
    named = [(jax.tree_util.keystr(p), tuple(np.shape(x))) for p, x in jax.tree_util.tree_leaves_with_path(batch)]
    lens = sorted({s[1] for _, s in named if len(s) >= 2})
    rule = (f"{where}: a mesh with cp={n} cuts the batch's sequence (dim 1 of the leaves the program reads as the "
            "sequence)")
    shown = ", ".join(f"batch{k} {s}" for k, s in named)
    if not lens:
        raise ValueError(f"{rule}, but no batch leaf has a dim 1: {shown}; pass [batch, seq, ...] leaves (tokens, "
                         "labels).")
    if len(lens) == 1:
        (t,), cut = lens, seq_batch(trace, batch, lens[0], n, most)
    else:
        trace(batch)  # the program as given: an error of its own is its own, not a question of which is the sequence
        found = {t: c for t in lens if t > n for c in [_traced_cut(trace, batch, t, n, most)] if c is not None}
        if len(found) != 1:
            got = ("at none of them" if not found else
                   "at each of " + " and ".join(str(t) for t in found))
            raise ValueError(
                f"{rule}, and the batch leaves' dim 1 differs: {shown}; loss_fn, traced with the leaves of each length "
                f"at {n} fewer positions, runs {got}, so which leaves hold the sequence is ambiguous. Give the leaves "
                "that hold the sequence one length on dim 1, and the others a dim 1 the program fixes (a [batch, d] "
                "vector into a dense layer) or of size 1 ([batch, 1, ...]).")
        ((t, cut),) = found.items()
    if t % n:
        raise ValueError(f"{where}: the batch's sequence has {t} positions, not divisible by cp={n}; use a sequence "
                         f"length that is a multiple of {n} (of {2 * n} for the balanced causal cut).")
    return t, cut
