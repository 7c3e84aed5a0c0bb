"""DeviceMesh: an n-D array of devices with named dims, wrapping ``jax.sharding.Mesh``."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from spmd._groups import resolve_mesh_dims
from spmd._launch import check_joined, missing_devices_hint
from spmd._process_group import ProcessGroup

__all__ = ["DeviceMesh", "init_device_mesh"]

_DEVICE_TYPE_ALIASES = {"cuda": "gpu", "nccl": "gpu", "rocm": "gpu", "cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}


def _platform(device_type: Any, where: str) -> str:
    if not isinstance(device_type, str):
        raise TypeError(f"{where}: device_type={device_type!r} must be a string such as 'cpu' or 'cuda'.")
    platform = _DEVICE_TYPE_ALIASES.get(device_type.lower())
    if platform is None:
        raise ValueError(
            f"{where}: device_type={device_type!r} is unknown; use one of 'cpu', 'cuda' (or 'gpu'), 'tpu'."
        )
    return platform


def _devices_of(platform: str, device_type: str, where: str) -> list:
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        have = sorted({d.platform for d in jax.devices()})
        raise ValueError(
            f"{where}: device_type={device_type!r} has no devices on this machine "
            f"(JAX sees platform(s) {have}); use device_type={have[0]!r}."
        )
    return devices


def _check_names(names: Any, ndim: int, where: str) -> tuple[str, ...]:
    if names is None:
        return tuple(f"dim_{i}" for i in range(ndim))
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise TypeError(f"{where}: mesh_dim_names={names!r} must be a tuple of strings, one per mesh dim.")
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(
            f"{where}: mesh_dim_names={names!r} has {len(names)} name(s) for a {ndim}-D mesh; give one per mesh dim."
        )
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"{where}: mesh_dim_names={names!r} holds {n!r}; every name must be a non-empty string.")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{where}: mesh_dim_names={names!r} repeats {dup}; names must be distinct.")
    return names


class DeviceMesh:
    """An n-D array of devices with a name per dim, as ``torch.distributed.DeviceMesh``.

    Ranks are row-major: on a mesh of shape ``(a, b)`` rank ``r`` sits at
    ``(r // b, r % b)``. ``mesh.jax_mesh`` gives the wrapped ``jax.sharding.Mesh``.

    ``DeviceMesh("cpu", [[0, 1], [2, 3]])`` takes devices by their index in
    ``jax.devices("cpu")``, as torch takes ranks.
    """

    def __init__(self, device_type: str, mesh: Any, *, mesh_dim_names: Sequence[str] | None = None):
        where = "DeviceMesh"
        platform = _platform(device_type, where)
        devices = _devices_of(platform, device_type, where)
        try:
            ids = np.asarray(mesh)
        except ValueError:  # NumPy refuses a ragged nesting
            raise ValueError(
                f"{where}: mesh={mesh!r} is ragged (its rows have different lengths); give a rectangular nested "
                "list of device indices such as [[0, 1], [2, 3]]."
            ) from None
        if ids.dtype.kind not in "iu" or ids.ndim == 0:
            raise TypeError(
                f"{where}: mesh={mesh!r} must be a nested list of device indices such as [0, 1, 2, 3]."
            )
        if ids.min() < 0 or ids.max() >= len(devices) or len(set(ids.ravel().tolist())) != ids.size:
            raise ValueError(
                f"{where}: mesh={ids.tolist()!r} must hold distinct device indices in [0, {len(devices) - 1}] "
                f"({len(devices)} {device_type} device(s) exist)."
            )
        names = _check_names(mesh_dim_names, ids.ndim, where)
        devs = np.empty(ids.shape, dtype=object)
        for idx, i in np.ndenumerate(ids):
            devs[idx] = devices[int(i)]
        self._init(device_type, Mesh(devs, names))

    def _init(self, device_type: str, jax_mesh: Mesh) -> None:
        self._device_type = device_type
        self._jax_mesh = jax_mesh
        # Value identity (equality and hash): the devices, the shape, the dim names and their JAX axis types
        # (two meshes equal here run each other's compiled programs).
        self._key = (
            tuple(d.id for d in jax_mesh.devices.flat), tuple(jax_mesh.devices.shape), tuple(jax_mesh.axis_names),
            tuple(getattr(jax_mesh, "axis_types", ())),
        )

    @classmethod
    def from_jax(cls, jax_mesh: Mesh, device_type: str | None = None) -> "DeviceMesh":
        """Wrap an existing ``jax.sharding.Mesh`` (its axis types are kept)."""
        if not isinstance(jax_mesh, Mesh):
            raise TypeError(f"DeviceMesh.from_jax: jax_mesh={jax_mesh!r} must be a jax.sharding.Mesh.")
        self = cls.__new__(cls)
        self._init(device_type or jax_mesh.devices.flat[0].platform, jax_mesh)
        return self

    # --- what torch's DeviceMesh exposes -------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def jax_mesh(self) -> Mesh:
        return self._jax_mesh

    @property
    def devices(self) -> np.ndarray:
        """The device array (read-only), shape ``self.shape``."""
        return self._jax_mesh.devices

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._jax_mesh.devices.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(self._jax_mesh.axis_names)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of devices in the mesh, along one mesh dim, or along several (their product)."""
        if mesh_dim is None:
            return math.prod(self.shape)
        return math.prod(self.shape[i] for i in self._dims(mesh_dim, "DeviceMesh.size", "mesh_dim"))

    def get_group(self, mesh_dim: int | str | Sequence[int | str] | None = None):
        """The process group along one mesh dim (or several, flattened); all dims if None."""
        dims = tuple(range(self.ndim)) if mesh_dim is None else self._dims(mesh_dim, "DeviceMesh.get_group", "mesh_dim")
        return ProcessGroup(self, tuple(self.mesh_dim_names[d] for d in dims))

    def _dims(self, mesh_dim: Any, where: str, arg: str) -> tuple[int, ...]:
        return resolve_mesh_dims(mesh_dim, self.mesh_dim_names, where=where, arg=arg)

    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        """The sub-mesh over the named dims through this process's first device (as torch)."""
        dims = self._dims(names, "DeviceMesh.__getitem__", "mesh_dim_names")
        if list(dims) == list(range(self.ndim)):
            return self
        devs = self.devices
        local = [d for d in devs.flat if d.process_index == jax.process_index()]
        anchor = np.argwhere(devs == (local[0] if local else devs.flat[0]))[0]
        index = tuple(slice(None) if i in dims else int(anchor[i]) for i in range(self.ndim))
        sub = devs[index]  # kept dims in mesh order
        kept = [i for i in range(self.ndim) if i in dims]
        sub = np.transpose(sub, [kept.index(d) for d in dims])
        out = DeviceMesh.from_jax(Mesh(sub, tuple(self.mesh_dim_names[d] for d in dims)), self._device_type)
        out._root = self.root_mesh  # as torch's sub-meshes: layouts composed on sub-meshes run over the whole
        return out

    @property
    def root_mesh(self) -> "DeviceMesh":
        """The mesh this one was cut from by ``mesh[...]`` (itself when it was not cut from another)."""
        return getattr(self, "_root", None) or self

    # --- value semantics --------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape))
        return f"DeviceMesh({self._device_type!r}, {dims})"


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """A mesh over the first ``prod(mesh_shape)`` devices of ``device_type``, row-major.

    ``init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))``.
    """
    where = "init_device_mesh"
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in mesh_shape
    ):
        raise TypeError(f"{where}: mesh_shape={mesh_shape!r} must be a tuple of ints such as (2, 4).")
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"{where}: mesh_shape={tuple(mesh_shape)!r} must be non-empty with every size >= 1.")
    platform = _platform(device_type, where)
    check_joined(where)  # under a launcher: never a mesh of this process's devices alone
    devices = _devices_of(platform, device_type, where)
    n = math.prod(mesh_shape)
    if n > len(devices):
        hint = missing_devices_hint(n, len(devices), platform)
        raise ValueError(
            f"{where}: mesh_shape={tuple(mesh_shape)!r} needs {n} devices but only {len(devices)} "
            f"{device_type} device(s) exist; use a smaller mesh{hint}."
        )
    names = _check_names(mesh_dim_names, len(mesh_shape), where)
    devs = np.empty(n, dtype=object)
    devs[:] = devices[:n]
    return DeviceMesh.from_jax(Mesh(devs.reshape(tuple(mesh_shape)), names), device_type)
