"""Checksums of a checkpoint's arrays and JSON, independent of how the arrays are sharded.

``array_digest(x)`` is a function of the global value of ``x`` only (its dtype, shape and bits), never of
its sharding or mesh: each element's bits are mixed with its flat index through a 32-bit hash (murmur3's
finaliser), and the mixed words are summed modulo 2**32. Integer addition modulo 2**32 is exact, associative
and commutative, so XLA may split the sum over any devices in any order and still give the same number: a
checkpoint saved on 8 devices verifies when it is restored onto 2. Two such sums with different seeds make a
64-bit digest. It is computed on the devices that hold the array (``jax.jit``), so the save reads back 8
bytes per array, not the array.

This is a check against corruption (flipped bits, torn or edited files), not a cryptographic signature.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["array_digests", "json_digest"]

_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words, one per element (two for 64-bit, real and imaginary for complex)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # a trailing dim of 2 words
    return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def _digest(x: jax.Array) -> jax.Array:
    w = _words(x).reshape(-1)
    index = jnp.arange(w.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(_fmix(w ^ _fmix(index + jnp.uint32(s))), dtype=jnp.uint32) for s in _SEEDS])


@jax.jit
def _digest_all(leaves: list) -> jax.Array:
    """(number of leaves, 2) uint32: one program for the whole tree."""
    return jnp.stack([_digest(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def array_digests(tree: Any) -> dict[str, str]:
    """``{pytree path: digest}`` of every array leaf of ``tree`` (the path as ``jax.tree_util.keystr`` writes it).

    A digest reads ``"float32[16, 4]:<16 hex digits>"``: dtype, shape and the sharding-independent sum.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = []
    for _, x in flat:
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        leaves.append(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    lanes = np.asarray(jax.device_get(_digest_all(leaves)), dtype=np.uint32)
    return {jax.tree_util.keystr(path): f"{np.dtype(x.dtype).name}{list(x.shape)}:{int(a):08x}{int(b):08x}"
            for (path, _), x, (a, b) in zip(flat, leaves, lanes)}


def json_digest(obj: Any) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys): equal for a value and its JSON round trip."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()
