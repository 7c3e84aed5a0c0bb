"""Moving parameter pytrees onto a plan, and gathering a unit inside an SPMD region.

A device stores each parameter's block padded to the chunk size (torch.chunk
cuts unevenly; ``shard_map`` needs equal blocks), so a sharded parameter is a
global ``jax.Array`` of the padded shape, placed by the plan. Padding is zero
and stays zero in training: its gradient is zero (the gather trims it), and
AdamW moves a zero parameter with zero gradient nowhere.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from placements import Shard
from spmd._mesh import DeviceMesh
from spmd.parallel.plan._param_plan import ParamPlan, PlanEntry, gather_buffers

__all__ = ["entry_sharding", "shard_params", "unshard_tree", "pad_tree", "gather_unit", "map_like_params"]


def entry_sharding(e: PlanEntry, mesh: DeviceMesh) -> NamedSharding:
    """The ``jax.sharding.NamedSharding`` of one plan entry's padded storage on ``mesh`` (its ``Shard`` mesh dims)."""
    spec: list[list[str]] = [[] for _ in e.shape]
    for name, p in zip(mesh.mesh_dim_names, e.placements):
        if isinstance(p, Shard):
            spec[p.dim].append(name)
    return NamedSharding(mesh.jax_mesh, P(*[None if not s else (s[0] if len(s) == 1 else tuple(s)) for s in spec]))


def _pad(x, e: PlanEntry, plan: ParamPlan) -> jax.Array:
    target = plan.padded_shape(e)
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, target)])


def _trim(x, e: PlanEntry) -> jax.Array:
    return x[tuple(slice(0, s) for s in e.shape)]


def map_like_params(plan: ParamPlan, tree: Any, fn, *, optimizer=None, other=None) -> Any:
    """Apply ``fn(leaf, entry)`` to the parameter-shaped leaves of ``tree``.

    ``tree`` is the parameters, or an optax state when ``optimizer`` is given
    (``optax.tree_map_params`` finds the leaves shaped like parameters: Adam's
    moments; ``other(leaf)`` maps the rest, such as the step count).
    """
    entries = jax.tree_util.tree_unflatten(plan.treedef, list(plan.entries))
    if optimizer is None:
        return jax.tree.map(fn, tree, entries)
    import optax

    return optax.tree_map_params(optimizer, fn, tree, entries, transform_non_params=other)


def shard_params(tree: Any, plan: ParamPlan, mesh: DeviceMesh, *, optimizer=None) -> Any:
    """Pad each parameter-shaped leaf to its plan's chunks and place it; other leaves replicate."""
    rep = NamedSharding(mesh.jax_mesh, P())
    shardings = map_like_params(plan, tree, lambda x, e: entry_sharding(e, mesh), optimizer=optimizer,
                                other=lambda x: rep)
    pad = jax.jit(lambda t: map_like_params(plan, t, lambda x, e: _pad(x, e, plan), optimizer=optimizer,
                                            other=lambda x: x), out_shardings=shardings)
    return pad(tree)


def pad_tree(tree: Any, plan: ParamPlan) -> Any:
    """Each parameter padded to its plan's stored shape (inside a jitted init)."""
    return map_like_params(plan, tree, lambda x, e: _pad(x, e, plan))


def unshard_tree(tree: Any, plan: ParamPlan, mesh: DeviceMesh | None = None, *, optimizer=None) -> Any:
    """The logical (unpadded) values, replicated on ``mesh`` (default: the arrays' own mesh): the inverse
    of ``shard_params``."""
    if mesh is None:
        first = next((x for x in jax.tree.leaves(tree) if hasattr(x, "sharding")), None)
        mesh = DeviceMesh.from_jax(first.sharding.mesh)
    rep = NamedSharding(mesh.jax_mesh, P())
    trim = jax.jit(lambda t: map_like_params(plan, t, lambda x, e: _trim(x, e), optimizer=optimizer,
                                             other=lambda x: x), out_shardings=rep)
    return trim(tree)


def gather_unit(shards: Sequence[jax.Array], entries: Sequence[PlanEntry], fsdp: str,
                fsdp_index: int, flip: Sequence[bool] = ()) -> list[jax.Array]:
    """Inside a region: the full parameters of one unit from this device's padded blocks.

    One all-gather per buffer of :func:`gather_buffers`: a sharded parameter
    of two or more dims is gathered alone, straight into its own full-size
    buffer (tiled along its shard dim: rank-major, as torch.chunk cuts); the
    unit's sharded vectors (biases, norm scales) of one dtype travel as one
    flat buffer, cut back into vectors (a copy of a few KiB, for one
    rendezvous instead of one per vector; and a re-gather for the backward
    pass fetches them all, like torch's FSDP2, even the one bias that no
    gradient reads, whose own all-gather XLA would drop). The padding is
    trimmed.
    ``lax.all_gather`` (device-varying in, device-varying out) is used on
    purpose: its transpose is one reduce-scatter (``psum_scatter``) per
    buffer, so ``jax.grad`` hands back reduce-scattered gradients, with no
    full-size copy into or out of a flat gradient buffer. Leaves replicated
    on ``fsdp`` pass through.
    ``flip[i]``: a 2-D parameter whose gradient is a dot's output transposed (``spmd.parallel.step.
    _grad_layout``) is gathered as ``all_gather(shard.T).T``: the same all-gather, and its transpose
    reduce-scatters the dot's own output (``ct.T``) instead of folding the transpose into the dot.
    """
    out: list[Any] = list(shards)
    for buf in gather_buffers(entries, fsdp_index):
        if len(entries[buf[0]].shape) == 1:  # flat: (n, F), cut into each vector's n chunks
            g = lax.all_gather(jnp.concatenate([shards[i] for i in buf]), fsdp, axis=0, tiled=False)
            fulls = [piece.reshape(-1) for piece in lax.split(g, [shards[i].size for i in buf], axis=1)]
        elif len(entries[buf[0]].shape) == 2 and buf[0] < len(flip) and flip[buf[0]]:
            d = entries[buf[0]].shard_dim(fsdp_index)
            fulls = [lax.all_gather(shards[buf[0]].T, fsdp, axis=1 - d, tiled=True).T]
        else:
            fulls = [lax.all_gather(shards[buf[0]], fsdp, axis=entries[buf[0]].shard_dim(fsdp_index), tiled=True)]
        for i, full in zip(buf, fulls):
            e, d = entries[i], entries[i].shard_dim(fsdp_index)
            out[i] = lax.slice_in_dim(full, 0, e.shape[d], axis=d) if full.shape[d] != e.shape[d] else full
    return out
