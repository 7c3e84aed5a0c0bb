"""Where each token of a sequence cut over ``cp`` ranks sits: the plain cut and torch's head-tail (zigzag) cut.

Under a causal mask the plain cut gives rank ``cp - 1`` about twice the mean work (its queries see the whole
sequence, rank 0's only its own block). The zigzag cut splits the sequence into ``2 cp`` chunks and gives
rank ``i`` chunks ``i`` and ``2 cp - 1 - i``, a short and a long prefix, so every rank attends the same number
of (query, key) pairs. A batch (and its position ids) is permuted with :func:`zigzag_permutation` before the
contiguous cut; the model itself is unchanged.
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["LAYOUTS", "causal_work", "unzigzag_permutation", "zigzag_permutation"]

LAYOUTS = ("contiguous", "zigzag")


def _check_int(fn: str, name: str, value, low: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{fn}: {name}={value!r} is not an integer; pass a Python int.") from None
    if value < low:
        raise ValueError(f"{fn}: {name}={value!r} must be at least {low}.")
    return value


def _check_cut(fn: str, seq_len, cp) -> tuple[int, int]:
    seq_len, cp = _check_int(fn, "seq_len", seq_len, 1), _check_int(fn, "cp", cp, 1)
    if seq_len % (2 * cp):
        raise ValueError(f"{fn}: seq_len={seq_len!r} is not divisible by 2 * cp = {2 * cp} (the zigzag cut "
                         f"splits the sequence into 2 * cp equal chunks); pad the sequence to a multiple of "
                         f"{2 * cp}.")
    return seq_len, cp


def check_layout(fn: str, layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout={layout!r} is not one of {LAYOUTS}; pass 'contiguous' for the plain "
                         f"cut or 'zigzag' for a batch permuted with zigzag_permutation.")
    return layout


def zigzag_permutation(seq_len: int, cp: int) -> np.ndarray:
    """The token order of torch's head-tail (zigzag) cut of a causal sequence over ``cp`` ranks.

    The sequence is split into ``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and
    ``2 * cp - 1 - i``. ``x[:, perm]`` reorders a batch ``x`` of shape ``[B, seq_len, ...]`` so that the usual
    contiguous cut of its sequence dim over ``cp`` gives each rank its two chunks; ``perm`` itself is the
    global position of every token in the permuted order, the position ids to give the model (RoPE, learned
    position embeddings), so the model computes what it computes on the unpermuted batch. Attention over such
    a cut takes ``layout="zigzag"`` (:func:`ring_attention`, :func:`allgather_attention`).
    :func:`unzigzag_permutation` is the inverse.

    ``seq_len`` must be divisible by ``2 * cp``.

    >>> zigzag_permutation(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    seq_len, cp = _check_cut("zigzag_permutation", seq_len, cp)
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return chunks[order].reshape(-1)


def unzigzag_permutation(seq_len: int, cp: int) -> np.ndarray:
    """The inverse of :func:`zigzag_permutation`: ``y[:, inv]`` puts a zigzag-ordered ``y`` back in order.

    >>> unzigzag_permutation(8, 2).tolist()
    [0, 1, 4, 5, 6, 7, 2, 3]
    """
    perm = zigzag_permutation(seq_len, cp)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def halves(t_local: int, layout: str, split: bool) -> list[tuple[int, int]]:
    """(offset, size) of the pieces of a rank's local sequence that are contiguous in global position.

    The zigzag cut always has two; the plain cut one, or two when ``split`` (the causal ring skips the
    pieces that are wholly in the future of a query piece)."""
    if layout == "zigzag" or split:
        c = t_local // 2
        return [(0, c), (c, t_local - c)]
    return [(0, t_local)]


def piece_starts(rank, t_local: int, cp: int, layout: str, pieces: list[tuple[int, int]]) -> list:
    """The global position of the first token of each piece of rank ``rank`` (an int or a traced int)."""
    if layout == "zigzag":
        c = t_local // 2
        return [rank * c, (2 * cp - 1 - rank) * c]
    return [rank * t_local + off for off, _ in pieces]


def piece_visible(q_start, q_size: int, k_start) -> object:
    """Whether a query piece at ``[q_start, q_start + q_size)`` sees any key of a piece starting at ``k_start``
    under a causal mask (its last query is at or after the first key)."""
    return q_start + q_size - 1 >= k_start


def global_positions(rank: int, t_local: int, cp: int, layout: str) -> np.ndarray:
    """The global positions of rank ``rank``'s local tokens, in local order."""
    pieces = halves(t_local, layout, split=False)
    starts = piece_starts(rank, t_local, cp, layout, pieces)
    return np.concatenate([s + np.arange(n) for s, (_, n) in zip(starts, pieces)])


def causal_work(seq_len: int, cp: int, *, layout: str = "contiguous") -> dict[str, np.ndarray]:
    """The work of causal attention on each of ``cp`` ranks of a sequence of ``seq_len`` tokens cut by ``layout``.

    Returns ``{"pairs": ..., "blocks": ...}``, each an int array of one entry per rank: ``pairs`` the
    (query, key) pairs the causal mask keeps for the rank's queries, ``blocks`` the (query piece, key piece)
    pairs that :func:`ring_attention` computes on it (each rank's local sequence is two pieces, ``seq_len /
    (2 cp)`` tokens each; a pair wholly in the future is skipped). The program runs in lockstep, so its time
    follows the busiest rank: ``max / mean`` of either is the imbalance, 1.0 for ``"zigzag"``.
    """
    seq_len, cp = _check_cut("causal_work", seq_len, cp)
    check_layout("causal_work", layout)
    t_local = seq_len // cp
    pieces = halves(t_local, layout, split=True)
    pairs, blocks = np.zeros(cp, np.int64), np.zeros(cp, np.int64)
    for r in range(cp):
        pairs[r] = int((global_positions(r, t_local, cp, layout) + 1).sum())
        q_starts = piece_starts(r, t_local, cp, layout, pieces)
        for src in range(cp):
            k_starts = piece_starts(src, t_local, cp, layout, pieces)
            blocks[r] += sum(bool(piece_visible(qs, qn, ks)) for qs, (_, qn) in zip(q_starts, pieces)
                             for ks in k_starts)
    return {"pairs": pairs, "blocks": blocks}
