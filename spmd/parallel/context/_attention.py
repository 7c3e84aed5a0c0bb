"""Attention over a sequence cut on a mesh dim: ring attention (K/V passed around the ring) and the
all-gather of K/V, both inside an SPMD region (``spmd.spmd``, ``jax.shard_map``).

Arrays are ``[batch, seq, heads, head_dim]`` (``jax.nn.dot_product_attention``'s layout), each rank holding
its piece of the sequence. Internally queries are grouped by the KV head they share (GQA):
``[B, T, K, G, D]`` with ``K`` KV heads and ``G = N / K`` query heads per KV head, so K/V are never repeated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd._collectives import varying_axes
from spmd.parallel.context._layout import (check_layout, global_positions, halves, piece_starts,
                                           piece_visible)

__all__ = ["allgather_attention", "ring_attention"]

_F32 = jnp.float32


# ---------------------------------------------------------------------------------------------- checks


def _check_args(fn, q, k, v, axis_name, causal, segment_ids, scale, layout):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: {name}={x!r} is not an array; pass a [batch, seq, heads, head_dim] array.")
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name} has shape {tuple(x.shape)!r}, not [batch, seq, heads, head_dim]; "
                             f"pass rank-4 arrays (jax.nn.dot_product_attention's layout).")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k has shape {tuple(k.shape)!r} and v {tuple(v.shape)!r}; they must be equal.")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{fn}: q of shape {tuple(q.shape)!r} and k of shape {tuple(k.shape)!r} differ in "
                         f"batch or head_dim; they must agree.")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{fn}: q has {q.shape[2]} heads, not a multiple of k's {k.shape[2]} heads (GQA "
                         f"shares each KV head among N / K query heads); pass a KV head count dividing "
                         f"{q.shape[2]}.")
    if not isinstance(axis_name, str):
        raise TypeError(f"{fn}: axis_name={axis_name!r} is not a str; pass the name of the mesh dim the "
                        f"sequence is cut over (e.g. 'cp').")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal={causal!r} is not a bool.")
    check_layout(fn, layout)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"{fn}: causal=True needs q and k cut alike, but q has {q.shape[1]} local positions "
                         f"and k {k.shape[1]}; pass self-attention pieces of one sequence.")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{fn}: layout='zigzag' needs an even local sequence (two chunks per rank), got "
                         f"{q.shape[1]}; cut a batch permuted by zigzag_permutation(seq_len, cp).")
    if segment_ids is not None:
        if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"{fn}: segment_ids={segment_ids!r} is not an integer array; pass [batch, seq] "
                            f"int segment ids (0 for padding, 1, 2, ... for packed sequences).")
        if tuple(segment_ids.shape) != (q.shape[0], q.shape[1]) or q.shape[1] != k.shape[1]:
            raise ValueError(f"{fn}: segment_ids has shape {tuple(segment_ids.shape)!r}; it must be "
                             f"[batch, seq] = {(q.shape[0], q.shape[1])!r} for self-attention of q, k, v "
                             f"of one sequence.")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale={scale!r} is not a number; pass a float or None for "
                        f"1 / sqrt(head_dim).")
    try:
        cp = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"{fn}: axis_name={axis_name!r} is not a mesh dim of the enclosing SPMD region; call "
                         f"it inside spmd.spmd / jax.shard_map over a mesh with a dim {axis_name!r}.") from None
    return cp, (1.0 / np.sqrt(q.shape[3]) if scale is None else float(scale))


def _group(q, k):
    """q [B, T, N, D] -> [B, T, K, G, D]."""
    b, t, n, d = q.shape
    return q.reshape(b, t, k.shape[2], n // k.shape[2], d)


# ---------------------------------------------------------------------------------------------- blocks


def _mask(q_pos, k_pos, seg_q, seg_k):
    """[B|1, 1, 1, Tq, Tk] bool (True: attend) or None; positions None when not causal."""
    mask = None
    if q_pos is not None:
        mask = (q_pos[:, None] >= k_pos[None, :])[None, None, None]
    if seg_q is not None:
        same = (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, scale, mask):
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=_F32) * scale
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _update(state, q, k, v, mask, scale):
    """One step of the online softmax: fold the block (q, k, v) into (o, m, l)."""
    o, m, l = state
    s = _scores(q, k, scale, mask)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing visible yet
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + p.sum(-1)
    o = o * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=_F32)
    return o, m_new, l


def _grads(acc, q, k, v, do, lse, delta, mask, scale):
    """Flash attention's backward for one block: add its dq, dk, dv to ``acc``."""
    dq, dk, dv = acc
    s = _scores(q, k, scale, mask)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p, do, preferred_element_type=_F32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v, preferred_element_type=_F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=_F32)
    dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, q, preferred_element_type=_F32)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- the ring


class _Ring:
    """The static plan of one ring: the pieces of each local sequence and their global positions."""

    def __init__(self, axis_name, cp, causal, scale, layout, t_q, t_k):
        self.axis_name, self.cp, self.causal, self.scale, self.layout = axis_name, cp, causal, scale, layout
        # without a causal mask the positions do not matter: one piece each
        self.q_pieces = halves(t_q, layout, split=True) if causal else [(0, t_q)]
        self.k_pieces = halves(t_k, layout, split=True) if causal else [(0, t_k)]
        self.t_q, self.t_k = t_q, t_k
        self.perm = [(i, (i + 1) % cp) for i in range(cp)]

    def pairs(self, rank, src):
        """(q piece, k piece, visible or None, q positions, k positions) for the rank's queries and the block
        that came from rank ``src``; ``visible`` is None where every pair is computed."""
        if not self.causal:
            return [(self.q_pieces[0], self.k_pieces[0], None, None, None)]
        q_starts = piece_starts(rank, self.t_q, self.cp, self.layout, self.q_pieces)
        k_starts = piece_starts(src, self.t_k, self.cp, self.layout, self.k_pieces)
        out = []
        for (qo, qn), qs in zip(self.q_pieces, q_starts):
            for (ko, kn), ks in zip(self.k_pieces, k_starts):
                out.append(((qo, qn), (ko, kn), piece_visible(qs, qn, ks), qs + jnp.arange(qn), ks + jnp.arange(kn)))
        return out

    def shift(self, tree):
        return lax.ppermute(tree, self.axis_name, self.perm)


def _varying(x, axis_name, *like):
    """``x`` marked as varying over ``axis_name`` and every mesh dim ``like`` varies over (a scan's carry keeps
    its type: the blocks it folds in vary over those dims)."""
    have = varying_axes(x)
    if have is None:  # untracked (check_vma=False)
        return x
    vma = {axis_name}.union(*(varying_axes(y) or () for y in like if y is not None))
    missing = tuple(sorted(vma - have))
    return lax.pcast(x, missing, to="varying") if missing else x


def _sl(x, piece, axis=1):
    off, n = piece
    return lax.slice_in_dim(x, off, off + n, axis=axis)


def _ring_forward(ring, q, k, v, seg):
    b, t_q, h, g, d = q.shape
    rank = lax.axis_index(ring.axis_name)
    states = [jax.tree.map(lambda x: _varying(x, ring.axis_name, q, k, v, seg),
                           (jnp.zeros((b, h, g, n, d), _F32), jnp.full((b, h, g, n), -jnp.inf, _F32),
                            jnp.zeros((b, h, g, n), _F32))) for _, n in ring.q_pieces]
    q_idx = {p: i for i, p in enumerate(ring.q_pieces)}

    def fold(states, kv, src):
        states = list(states)
        for qp, kp, visible, q_pos, k_pos in ring.pairs(rank, src):
            seg_q = None if seg is None else _sl(seg, qp)
            seg_k = None if seg is None else _sl(kv["seg"], kp)
            args = (_sl(q, qp), _sl(kv["k"], kp), _sl(kv["v"], kp), _mask(q_pos, k_pos, seg_q, seg_k))
            i = q_idx[qp]
            if visible is None:
                states[i] = _update(states[i], *args, ring.scale)
            else:
                states[i] = lax.cond(visible, lambda st, a: _update(st, *a, ring.scale), lambda st, a: st,
                                     states[i], args)
        return states

    kv = {"k": k, "v": v} if seg is None else {"k": k, "v": v, "seg": seg}
    if ring.cp > 1:
        def body(carry, s):
            states, kv = carry
            nxt = ring.shift(kv)  # issued before the block's compute, so a backend can overlap the two
            return (fold(states, kv, (rank - s) % ring.cp), nxt), None

        (states, kv), _ = lax.scan(body, (states, kv), jnp.arange(ring.cp - 1))
    states = fold(states, kv, (rank - (ring.cp - 1)) % ring.cp)
    outs, lses = [], []
    for o, m, l in states:
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        outs.append(jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0))
        lses.append(jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf))
    out = jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4)  # [B, H, G, T, D] -> [B, T, H, G, D]
    return out.astype(q.dtype), jnp.concatenate(lses, axis=3)


def _ring_backward(ring, q, k, v, seg, out, lse, do):
    rank = lax.axis_index(ring.axis_name)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", do.astype(_F32), out.astype(_F32))
    q_idx = {p: i for i, p in enumerate(ring.q_pieces)}
    q_off = [0]
    for _, n in ring.q_pieces:
        q_off.append(q_off[-1] + n)

    def fold(dq, dkv, kv, src):
        for qp, kp, visible, q_pos, k_pos in ring.pairs(rank, src):
            i = q_idx[qp]
            seg_q = None if seg is None else _sl(seg, qp)
            seg_k = None if seg is None else _sl(kv["seg"], kp)
            args = (_sl(q, qp), _sl(kv["k"], kp), _sl(kv["v"], kp), _sl(do, qp),
                    lax.slice_in_dim(lse, q_off[i], q_off[i + 1], axis=3),
                    lax.slice_in_dim(delta, q_off[i], q_off[i + 1], axis=3),
                    _mask(q_pos, k_pos, seg_q, seg_k))

            def add(acc, a, qp=qp, kp=kp):
                dq, dk, dv = acc
                gq, gk, gv = _grads((_sl(dq, qp), _sl(dk, kp), _sl(dv, kp)), *a, ring.scale)
                return (lax.dynamic_update_slice_in_dim(dq, gq, qp[0], axis=1),
                        lax.dynamic_update_slice_in_dim(dk, gk, kp[0], axis=1),
                        lax.dynamic_update_slice_in_dim(dv, gv, kp[0], axis=1))

            acc = (dq, dkv["k"], dkv["v"])
            acc = add(acc, args) if visible is None else lax.cond(visible, add, lambda a_, _: a_, acc, args)
            dq, dkv = acc[0], {"k": acc[1], "v": acc[2]}
        return dq, dkv

    kv = {"k": k, "v": v} if seg is None else {"k": k, "v": v, "seg": seg}
    dq = _varying(jnp.zeros(q.shape, _F32), ring.axis_name, q, k, v, seg, do)
    dkv = {n: _varying(jnp.zeros(x.shape, _F32), ring.axis_name, q, k, v, seg, do) for n, x in (("k", k), ("v", v))}
    if ring.cp > 1:
        def body(carry, s):
            dq, kv, dkv = carry
            nxt = ring.shift(kv)
            dq, dkv = fold(dq, dkv, kv, (rank - s) % ring.cp)
            return (dq, nxt, ring.shift(dkv)), None  # dk, dv travel with their block

        (dq, kv, dkv), _ = lax.scan(body, (dq, kv, dkv), jnp.arange(ring.cp - 1))
    dq, dkv = fold(dq, dkv, kv, (rank - (ring.cp - 1)) % ring.cp)
    if ring.cp > 1:
        dkv = ring.shift(dkv)  # the last step's block goes home
    return dq.astype(q.dtype), dkv["k"].astype(k.dtype), dkv["v"].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, seg, ring):
    return _ring_forward(ring, q, k, v, seg)[0]


def _ring_fwd(q, k, v, seg, ring):
    out, lse = _ring_forward(ring, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(ring, res, do):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _ring_backward(ring, q, k, v, seg, out, lse, do)
    seg_ct = None if seg is None else np.zeros(seg.shape, jax.dtypes.float0)
    return dq, dk, dv, seg_ct


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name: str, causal: bool = False, segment_ids=None, scale: float | None = None,
                   layout: str = "contiguous"):
    """Attention over a sequence cut on mesh dim ``axis_name``, K/V passed around the ring (ring attention).

    Call it inside an SPMD region (``spmd.spmd``, ``jax.shard_map``) where ``q``, ``k``, ``v``
    (``[batch, seq, heads, head_dim]``, ``jax.nn.dot_product_attention``'s layout) hold each rank's piece of
    the sequence. Over ``cp`` ranks the K/V blocks (and their segment ids) make ``cp - 1`` hops with
    ``lax.ppermute``, each hop issued before the current block's compute; an online (log-sum-exp) softmax
    folds every block into a float32 output. The result is each rank's piece of
    ``jax.nn.dot_product_attention`` over the whole sequence.

    - ``causal``: a query attends to the keys at or before its global position. The global positions follow
      ``layout``: ``"contiguous"`` (rank ``i`` holds the ``i``-th of ``cp`` equal blocks) or ``"zigzag"``
      (a batch permuted by :func:`zigzag_permutation`: rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` of
      ``2 cp``, the same causal work on every rank). Each local sequence is handled as two pieces and a
      (query piece, key piece) pair wholly in the future is skipped (:func:`causal_work` counts them).
    - ``segment_ids``: ``[batch, seq]`` ints, cut like ``q``: a query attends only to keys of its own segment
      (packed sequences; give padding its own id).
    - GQA: ``k`` and ``v`` may have fewer heads ``K`` than ``q``'s ``N`` (``N % K == 0``); query head ``n``
      uses KV head ``n // (N / K)``, as in ``jax.nn.dot_product_attention``.
    - ``scale``: the logits' factor, ``1 / sqrt(head_dim)`` by default.

    The gradient is a custom VJP that runs the ring again in the backward pass (flash attention's backward
    per block, dK/dV travelling with their block and sent home by one last hop): the residuals are the
    local q, k, v, output and log-sum-exp, not the ``cp`` blocks' probabilities.
    """
    cp, scale = _check_args("ring_attention", q, k, v, axis_name, causal, segment_ids, scale, layout)
    ring = _Ring(axis_name, cp, causal, scale, layout, q.shape[1], k.shape[1])
    out = _ring(_group(q, k), k, v, segment_ids, ring)
    return out.reshape(q.shape)


# ---------------------------------------------------------------------------------------------- all-gather


def allgather_attention(q, k, v, *, axis_name: str, causal: bool = False, segment_ids=None,
                        scale: float | None = None, layout: str = "contiguous"):
    """Attention over a sequence cut on mesh dim ``axis_name``: K and V all-gathered, then local attention.

    Same arguments and result as :func:`ring_attention` (inside an SPMD region, ``[batch, seq, heads,
    head_dim]`` pieces, ``causal`` by the global positions of ``layout``, ``segment_ids``, GQA, ``scale``).
    One all-gather each of K and V (and of the segment ids) over ``axis_name`` gives every rank the whole
    sequence's keys; its queries attend to them in one float32 softmax. It holds ``cp`` times the K/V of
    :func:`ring_attention` but has no ring to run; its gradient is JAX's, the gathers' transposes being
    reduce-scatters of dK and dV.
    """
    cp, scale = _check_args("allgather_attention", q, k, v, axis_name, causal, segment_ids, scale, layout)
    rank = lax.axis_index(axis_name)
    qg = _group(q, k)
    k_all = lax.all_gather(k, axis_name, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis_name, axis=1, tiled=True)
    q_pos = k_pos = seg_k = None
    if causal:
        t = q.shape[1]
        table = np.stack([global_positions(r, t, cp, layout) for r in range(cp)])  # [cp, T_local]
        q_pos, k_pos = jnp.asarray(table)[rank], jnp.asarray(table.reshape(-1))
    if segment_ids is not None:
        seg_k = lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
    s = _scores(qg, k_all, scale, _mask(q_pos, k_pos, segment_ids, seg_k))
    m = lax.stop_gradient(s.max(-1, keepdims=True))  # a stabiliser only: the result does not depend on it
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(l > 0, l, 1.0), v_all.astype(_F32))
    return o.reshape(q.shape).astype(q.dtype)
