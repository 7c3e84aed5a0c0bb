"""``@spmd(mesh, in_placements=..., out_placements=...)``: run a function per device.

The function sees each device's local block and may call the collectives of
``spmd`` naming mesh dims as groups. It lowers to ``jax.shard_map`` under
``jax.jit``: a Shard/Replicate argument or result is exactly the
``PartitionSpec`` a hand-written ``shard_map`` would use, so there is no
overhead. A result placed ``Partial`` comes back as a ``DTensor`` holding each
rank's unreduced value (``.full_tensor()`` reduces it).

Trap (from JAX): with ``check_vma=True`` the gradient, inside the region, of a
``Replicate`` argument is already summed over the devices; do not ``psum`` it
again (and divide by the group size for a mean).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from placements import Partial, Placement, Replicate, Shard, check_placements, format_placements
from spmd._arrays import as_array
from spmd._collectives import varying_axes
from spmd._mesh import DeviceMesh
from spmd._uneven import is_uneven, zero_padding
from spmd.tensor._checks import check_target
from spmd.tensor._dtensor import DTensor, from_physical, physical
from spmd.tensor._local import even_global_shape
from spmd.tensor._storage import spec as storage_spec

__all__ = ["spmd"]


def _is_plist(x: Any, nd: int | None = None) -> bool:
    """A placement list (of ``nd`` placements when ``nd`` is given) or a single placement."""
    return isinstance(x, Placement) or (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(isinstance(p, Placement) for p in x)
        and (nd is None or len(x) == nd)
    )


def _per_arg(placements: Any, n_args: int, mesh_ndim: int, where: str) -> tuple:
    """Split ``in_placements`` into one pytree prefix per positional argument.

    One placement list (``mesh_ndim`` placements, or one placement) applies to
    every argument; a sequence of ``n_args`` entries gives one per argument;
    with one argument, anything else is that argument's pytree prefix.
    """
    if placements is None:
        return (None,) * n_args
    if _is_plist(placements, mesh_ndim):
        return (placements,) * n_args
    if isinstance(placements, (list, tuple)) and len(placements) == n_args:
        return tuple(placements)
    if n_args == 1:
        return (placements,)
    raise ValueError(
        f"{where}={placements!r} does not fit {n_args} argument(s) on a {mesh_ndim}-D mesh; give a tuple with one "
        "entry per argument (each a placement list, one placement per mesh dim, or a pytree prefix of them)."
    )


def _broadcast(prefix: Any, tree: Any, where: str, nd: int) -> list:
    """The placement list for every leaf of ``tree`` (``prefix`` is a pytree prefix of plists).

    A list of placements is one placement list when it has one per mesh dim, and
    any list is one when it meets a single value (check_placements then judges
    it, with a clear message); otherwise it is a pytree prefix (e.g.
    ``(R, S0)`` for a pair of results on a 1-D mesh).
    """
    def is_leaf(p):
        return p is None or _is_plist(p, nd) or isinstance(p, Placement)

    is_leaf_value = jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tree, is_leaf=_is_dtensor))
    treedef = jax.tree_util.tree_structure(prefix, is_leaf=is_leaf)
    if is_leaf(prefix) or jax.tree_util.treedef_is_leaf(treedef) or (isinstance(prefix, (list, tuple)) and is_leaf_value):
        # One placement list for the whole subtree (check_placements judges it, with a clear message).
        n = len(jax.tree_util.tree_leaves(tree, is_leaf=_is_dtensor))
        return [prefix] * n
    try:
        subtrees = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{where}: the placements {prefix!r} are not a pytree prefix of the values; give one placement "
            f"list per value or per subtree ({e})."
        ) from None
    out = []
    for p, sub in zip(jax.tree_util.tree_leaves(prefix, is_leaf=is_leaf), subtrees):
        out.extend(_broadcast(p, sub, where, nd))
    return out


def _spec(placements: tuple[Placement, ...], names: tuple[str, ...], ndim: int) -> P:
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for name, p in zip(names, placements):
        if isinstance(p, Shard):
            entries[p.dim].append(name)
    return P(*[None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries])


class _Spmd:
    def __init__(self, f: Callable, mesh: DeviceMesh, in_placements: Any, out_placements: Any, check_vma: bool):
        self._f = f
        self._mesh = mesh
        self._in = in_placements
        self._out = out_placements
        self._check_vma = check_vma

    def _leaf_spec(self, x: Any, plist: Any, path: str):
        """(value, PartitionSpec, kind) for one argument leaf; kind is 'array', 'dtensor', or
        ('uneven', shape, placements) for a DTensor with uneven shards (its padding zeroed in the region)."""
        mesh = self._mesh
        names = mesh.mesh_dim_names
        where = f"spmd: in_placements{path}"
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(
                    f"spmd: argument{path} is a DTensor on {x.device_mesh!r}, not on this function's {mesh!r}; "
                    "redistribute it onto the same mesh first."
                )
            if plist is not None:
                want = check_placements(plist, mesh_ndim=mesh.ndim, tensor_ndim=x.ndim, where=where)
                if want != x.placements:
                    x = x.redistribute(placements=want)
            kind = ("uneven", x.shape, x.placements) if is_uneven(x.shape, mesh.shape, x.placements) else "dtensor"
            return x, storage_spec(mesh, x.placements), kind
        if plist is None:
            raise ValueError(
                f"spmd: argument{path} has no placements; give in_placements for it (e.g. [Replicate()] * "
                f"{mesh.ndim} or [Shard(0)] + ...), or pass a DTensor, which carries its own."
            )
        x = jnp.asarray(x)
        pl = check_placements(plist, mesh_ndim=mesh.ndim, tensor_ndim=x.ndim, where=where)
        for p in pl:
            if isinstance(p, Partial):
                raise ValueError(
                    f"{where}={format_placements(pl)} puts a plain array in a Partial placement; a plain array "
                    "is one value, not per-rank partial values: pass a DTensor with Partial placements instead."
                )
        for d in range(x.ndim):
            k = _shards_on(pl, mesh.shape, d)
            if x.shape[d] % k:
                raise ValueError(
                    f"{where}={format_placements(pl)} cuts dim {d} of argument{path} (shape {x.shape}) into {k} "
                    f"blocks, but {x.shape[d]} is not divisible by {k}; pad dim {d} to a multiple of {k}, or pass "
                    "a DTensor (uneven shards)."
                )
        return x, _spec(pl, names, x.ndim), "array"

    def _trace(self, *args):
        mesh = self._mesh
        nd = mesh.ndim
        per_arg = _per_arg(self._in, len(args), nd, "spmd: in_placements")
        plists = []
        for i, (arg, pre) in enumerate(zip(args, per_arg)):
            plists.extend(_broadcast(pre, arg, f"spmd: in_placements[{i}]", nd))
        with_path, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_dtensor)
        vals, specs, kinds = [], [], []
        for (path, x), pl in zip(with_path, plists):
            v, s, k = self._leaf_spec(x, pl, jax.tree_util.keystr(path))
            vals.append(v if k == "array" else physical(v))
            specs.append(s)
            kinds.append(k)
        sm, out_tree, out_pl = self._build(treedef, tuple(specs), tuple(kinds), vals)
        outs = sm(*vals)
        return jax.tree_util.tree_unflatten(out_tree, [
            from_physical(o, mesh, pl, even_global_shape(o.shape[nd:], mesh.shape, pl)) if _has_partial(pl) else o
            for o, pl in zip(outs, out_pl)
        ])

    def _build(self, treedef, specs, kinds, vals):
        mesh = self._mesh
        names = mesh.mesh_dim_names
        nd = mesh.ndim
        meta: dict = {}

        def body(*flat):
            local = [x if k == "array" else x.reshape(x.shape[nd:]) for x, k in zip(flat, kinds)]
            local = [zero_padding(x, k[1], k[2], names, tuple(mesh.shape)) if isinstance(k, tuple) else x
                     for x, k in zip(local, kinds)]
            out = self._f(*jax.tree_util.tree_unflatten(treedef, local))
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            out_pl = _broadcast(self._out, out, "spmd: out_placements", nd)
            res, checked, ospecs, vmas = [], [], [], []
            for i, (y, pl) in enumerate(zip(out_leaves, out_pl)):
                as_array(y, "spmd", f"the result's leaf {i}")  # a str or object: the project's TypeError, not JAX's
                y = jnp.asarray(y)
                pl = check_target(
                    [Replicate()] * nd if pl is None else pl, nd, y.ndim, y.dtype, "spmd", f"out_placements (leaf {i})",
                    pad=False,  # @spmd names every mesh dim: a short list is an error, never a silent Replicate
                )
                checked.append(pl)
                vmas.append(varying_axes(y))
                if _has_partial(pl):  # a DTensor's storage (spmd/tensor/_storage.py)
                    res.append(y.reshape((1,) * nd + y.shape))
                    ospecs.append(storage_spec(mesh, pl))
                else:
                    res.append(y)
                    ospecs.append(_spec(pl, names, y.ndim))
            meta.update(out_tree=out_tree, out_pl=tuple(checked), ospecs=tuple(ospecs), vmas=vmas)
            return tuple(res)

        # The output specs depend on the output's structure and ranks: find them by an abstract trace,
        # with check_vma=True so that every result's varying axes are known (a function that cannot be
        # traced so under check_vma=False is traced without them).
        def probe(check_vma: bool):
            sm = jax.shard_map(lambda *f: (body(*f), ())[1], mesh=mesh.jax_mesh, in_specs=specs, out_specs=(),
                               check_vma=check_vma)
            jax.eval_shape(sm, *vals)

        if self._check_vma:
            probe(True)
        else:
            try:
                probe(True)
            except Exception:
                probe(False)
                meta["vmas"] = [None] * len(meta["out_pl"])
        out_tree, out_pl, ospecs = meta["out_tree"], meta["out_pl"], meta["ospecs"]
        for i, (pl, vma) in enumerate(zip(out_pl, meta["vmas"])):
            _check_replicated(vma, pl, names, i, self._check_vma)
        sm = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=specs, out_specs=ospecs, check_vma=self._check_vma)
        return sm, out_tree, out_pl


def _check_replicated(vma, pl, names, i: int, check_vma: bool) -> None:
    """A result placed Replicate on a mesh dim must not differ across it. JAX checks it under
    ``check_vma=True`` (a Partial result's storage too: its Replicate dims are stored once, see
    ``spmd/tensor/_storage.py``); ``check_vma=False`` checks nothing (JAX would keep device 0's
    value): check it here, from the varying axes the probe trace found (``vma``; None if the
    function cannot be traced with check_vma=True, and then a Replicate dim cannot be checked and
    is refused)."""
    rep = [n for n, p in zip(names, pl) if isinstance(p, Replicate)]
    if not rep or (vma is None and check_vma):
        return  # (a JAX without vma types: shard_map's own check)
    if vma is None:
        raise ValueError(
            f"spmd: out_placements (leaf {i})={format_placements(pl)} says the result is replicated over {rep}, "
            "but with check_vma=False nothing checks it (and this function cannot be traced with check_vma=True "
            "to check it): JAX would silently keep one device's value. Place it Shard or Partial on those mesh "
            "dims, or all_reduce it and use check_vma=True."
        )
    bad = [n for n in rep if n in vma]
    if bad:
        raise ValueError(
            f"spmd: out_placements (leaf {i})={format_placements(pl)} says the result is replicated over "
            f"{bad}, but it differs across those ranks; make it Partial or Shard there, or all_reduce it first."
        )


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _has_partial(pl) -> bool:
    return any(isinstance(p, Partial) for p in pl)


def _shards_on(pl, mesh_shape, dim: int) -> int:
    """How many blocks the placement list cuts tensor dim ``dim`` into."""
    return int(np.prod([s for s, p in zip(mesh_shape, pl) if isinstance(p, Shard) and p.dim == dim]))




def spmd(
    f: Callable | DeviceMesh | None = None,
    /,
    mesh: DeviceMesh | None = None,
    *,
    in_placements: Any = None,
    out_placements: Any = None,
    check_vma: bool = True,
):
    """Run ``f`` once per device of ``mesh`` on its local blocks (decorator or call).

    ``@spmd(mesh, in_placements=..., out_placements=...)`` or
    ``spmd(f, mesh, in_placements=..., out_placements=...)``.

    ``in_placements``: one entry per positional argument, each a placement list
    (one placement per mesh dim; a single placement on a 1-D mesh) or a pytree
    prefix of them; one placement list alone applies to every argument. A
    ``DTensor`` argument brings its own placements (given ones redistribute it);
    one with uneven shards arrives as its padded block (torch.chunk's largest
    local shape), the padding zero, and :func:`spmd.local_shape` gives this
    device's true local shape for masks. ``out_placements``: a pytree prefix of the result; ``None`` means Replicate,
    which JAX checks (``check_vma``) instead of silently replicating a value
    that differs across devices. Shard/Replicate results come back as global
    arrays, results with a Partial placement as ``DTensor``.
    """
    if isinstance(f, DeviceMesh):
        if mesh is not None:
            raise TypeError("spmd: the mesh was given twice; write spmd(mesh, ...) or spmd(f, mesh=mesh, ...).")
        f, mesh = None, f
    elif mesh is None and f is not None and not callable(f):
        f, mesh = None, f  # spmd(not_a_mesh, ...): report it as the mesh below
    if isinstance(mesh, jax.sharding.Mesh) or isinstance(f, jax.sharding.Mesh):
        jm = mesh if mesh is not None else f  # named by its shape and dims: JAX's repr is not ours to print
        raise TypeError(
            f"spmd: mesh is a jax.sharding.Mesh with axis_names={tuple(jm.axis_names)!r} and shape "
            f"{tuple(jm.axis_sizes)!r}; wrap it as DeviceMesh.from_jax(mesh), or make one with "
            "init_device_mesh('cpu', (8,))."
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"spmd: mesh={mesh!r} must be a DeviceMesh; make one with init_device_mesh('cpu', (8,)) and pass it "
            "as @spmd(mesh, ...)."
        )
    if not isinstance(check_vma, bool):  # "no" or "False" would silently mean True
        raise TypeError(f"spmd: check_vma={check_vma!r} must be a bool (True: JAX checks replication).")

    def wrap(fn: Callable):
        if not callable(fn):
            raise TypeError(f"spmd: f={fn!r} is not callable; decorate a function.")
        region = _Spmd(fn, mesh, in_placements, out_placements, check_vma)

        def traced(*args):
            return region._trace(*args)

        functools.update_wrapper(traced, fn)
        return Region(jax.jit(traced))

    return wrap if f is None else wrap(f)


class Region:
    """An ``@spmd`` function: calling it calls its ``jax.jit`` function (all placement handling ran at trace
    time, so a call costs what a hand-written jitted shard_map costs, plus one Python frame).

    ``lower`` / ``trace`` / ``eval_shape`` are the jitted function's. The frame turns JAX's "abstract array ...
    static_argnums" ``TypeError`` for a non-array argument into one naming the argument, its value and the
    fix. They are class attributes, not instance ones, so ``functools.wraps`` of a region (``jax.grad`` does
    it) copies no ``lower`` onto the gradient function.
    """

    __slots__ = ("jitted", "__wrapped__", "__name__", "__qualname__", "__weakref__")

    def __init__(self, jitted):
        self.jitted = jitted
        self.__wrapped__ = fn = jitted.__wrapped__
        self.__name__ = getattr(fn, "__name__", "region")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    @property
    def __doc__(self):  # noqa: D105 (the decorated function's)
        return self.__wrapped__.__doc__

    def __call__(self, *args):
        try:
            return self.jitted(*args)
        except TypeError:
            _check_arguments(args)
            raise

    def __get__(self, obj, objtype=None):  # a region defined in a class body binds like a function
        return self if obj is None else functools.partial(self, obj)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self.jitted.eval_shape(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<spmd region {self.__qualname__}>"


def _check_arguments(args: tuple) -> None:
    """Every leaf of a region's arguments must be an array (or a DTensor, or a number); the first that is not
    is a ``TypeError`` naming its path and value."""
    from spmd._torch import is_torch_tensor

    for path, x in jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda v: isinstance(v, DTensor))[0]:
        if isinstance(x, (DTensor, jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            continue
        try:
            jax.typeof(x)  # anything else JAX takes as an array (an object with __jax_array__, ...)
            continue
        except TypeError:
            pass
        where = f"argument{jax.tree_util.keystr(path)}"
        if is_torch_tensor(x):
            raise TypeError(
                f"spmd: {where} is a torch.Tensor (shape {tuple(x.shape)}); an @spmd function takes NumPy or JAX "
                "arrays or DTensors: pass x.detach().cpu().numpy().") from None
        raise TypeError(
            f"spmd: {where}={x!r} (a {type(x).__name__}) is not an array; every argument of an @spmd function "
            "must be an array, a DTensor or a pytree of them. Pass a setting through a closure or "
            "functools.partial instead, or convert the value (np.asarray).") from None
