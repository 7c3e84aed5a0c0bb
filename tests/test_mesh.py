"""DeviceMesh and init_device_mesh: shapes, names, sub-meshes, groups, errors."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import spmd
from spmd import DeviceMesh, init_device_mesh


def _ids(devices) -> list:
    return np.vectorize(lambda d: d.id)(np.asarray(devices)).tolist()


def test_mesh_2x4(mesh2x4):
    m = mesh2x4
    assert m.shape == (2, 4) and m.ndim == 2
    assert m.mesh_dim_names == ("dp", "tp")
    assert m.size() == 8 and m.size("dp") == 2 and m.size("tp") == 4 and m.size(0) == 2 and m.size(-1) == 4
    assert m.size(("tp", "dp")) == 8 and m.size(["tp"]) == 4
    assert m.device_type == "cpu"
    # Row-major ranks: rank r sits at (r // 4, r % 4), on device r.
    assert _ids(m.devices) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _ids(m.jax_mesh.devices) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.jax_mesh.axis_names == ("dp", "tp")
    assert dict(m.jax_mesh.shape) == {"dp": 2, "tp": 4}
    assert repr(m) == "DeviceMesh('cpu', dp=2, tp=4)"
    # A plain jax Mesh (Auto axes), usable by hand-written shard_map.
    assert m.jax_mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


@pytest.mark.parametrize("shape", [(1,), (3,), (8,), (2, 2), (2, 2, 2), (1, 8), (4, 1, 2)])
def test_mesh_shapes_use_the_first_devices(shape):
    m = init_device_mesh("cpu", shape)
    n = int(np.prod(shape))
    assert m.shape == shape and m.size() == n
    assert m.mesh_dim_names == tuple(f"dim_{i}" for i in range(len(shape)))
    assert np.array(_ids(m.devices)).ravel().tolist() == list(range(n))


def test_mesh_int_shape_and_list_names():
    m = init_device_mesh("cpu", 4, mesh_dim_names=["x"])
    assert m.shape == (4,) and m.mesh_dim_names == ("x",)


def test_submeshes(mesh2x4):
    m = mesh2x4
    dp, tp = m["dp"], m["tp"]
    # Through this process's first device (rank 0), as torch's mesh["dp"] on rank 0.
    assert dp.shape == (2,) and dp.mesh_dim_names == ("dp",) and _ids(dp.devices) == [0, 4]
    assert tp.shape == (4,) and tp.mesh_dim_names == ("tp",) and _ids(tp.devices) == [0, 1, 2, 3]
    assert m["dp", "tp"] is m or m["dp", "tp"] == m
    t = m["tp", "dp"]
    assert t.shape == (4, 2) and t.mesh_dim_names == ("tp", "dp")
    assert _ids(t.devices) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m[("tp",)] == tp
    m3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    assert _ids(m3["a", "c"].devices) == [[0, 1], [4, 5]]
    assert _ids(m3["c"].devices) == [0, 1]
    assert _ids(m3["b"].devices) == [0, 2]


def test_get_group(mesh2x4):
    m = mesh2x4
    for dim, dims, size in [("dp", ("dp",), 2), ("tp", ("tp",), 4), (0, ("dp",), 2), (-1, ("tp",), 4),
                            (("dp", "tp"), ("dp", "tp"), 8), (("tp", "dp"), ("tp", "dp"), 8), (None, ("dp", "tp"), 8)]:
        g = m.get_group(dim)
        assert g.dims == dims and g.size == size and g.mesh == m
    assert m.get_group("dp") == m.get_group(0)
    assert hash(m.get_group("dp")) == hash(m.get_group(0))
    assert m.get_group("dp") != m.get_group("tp")
    assert repr(m.get_group("tp")) == "ProcessGroup(dims=('tp',), size=4, mesh=DeviceMesh('cpu', dp=2, tp=4))"


def test_explicit_device_mesh_and_value_semantics():
    m = DeviceMesh("cpu", [[7, 6], [5, 4]], mesh_dim_names=("a", "b"))
    assert _ids(m.devices) == [[7, 6], [5, 4]]
    assert m == DeviceMesh("cpu", [[7, 6], [5, 4]], mesh_dim_names=("a", "b"))
    assert m != DeviceMesh("cpu", [[7, 6], [5, 4]], mesh_dim_names=("a", "c"))
    assert m != DeviceMesh("cpu", [[4, 5], [6, 7]], mesh_dim_names=("a", "b"))
    assert len({m, DeviceMesh("cpu", [[7, 6], [5, 4]], mesh_dim_names=("a", "b"))}) == 1
    assert _ids(m["b"].devices) == [7, 6]
    assert DeviceMesh("cpu", list(range(4))).shape == (4,)
    # Wrapping a jax Mesh keeps it.
    jm = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    w = DeviceMesh.from_jax(jm)
    assert w.jax_mesh is jm and w.shape == (2, 2) and w.device_type == "cpu"
    assert init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")) == init_device_mesh(
        "cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    # The same devices and names with other JAX axis types are another mesh (they compile other programs).
    ex = Mesh(jm.devices, ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    assert DeviceMesh.from_jax(ex) != w and DeviceMesh.from_jax(ex) == DeviceMesh.from_jax(ex)


def test_mesh_devices_read_only(mesh2x4):
    with pytest.raises(ValueError):
        mesh2x4.devices[0, 0] = mesh2x4.devices[0, 1]


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: init_device_mesh("cpu", (16,)), ValueError,
     "init_device_mesh: mesh_shape=(16,) needs 16 devices but only 8 cpu device(s) exist; use a smaller mesh; "
     "for more CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=16 before JAX is imported."),
    (lambda: init_device_mesh("cpu", (3, 3)), ValueError, "mesh_shape=(3, 3) needs 9 devices but only 8"),
    (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a")), ValueError,
     "init_device_mesh: mesh_dim_names=('a', 'a') repeats ['a']; names must be distinct."),
    (lambda: init_device_mesh("cpu", (2,), mesh_dim_names=("a", "b")), ValueError,
     "init_device_mesh: mesh_dim_names=('a', 'b') has 2 name(s) for a 1-D mesh; give one per mesh dim."),
    (lambda: init_device_mesh("cpu", (2,), mesh_dim_names="a"), TypeError,
     "init_device_mesh: mesh_dim_names='a' must be a tuple of strings, one per mesh dim."),
    (lambda: init_device_mesh("cpu", (2,), mesh_dim_names=(1,)), TypeError,
     "init_device_mesh: mesh_dim_names=(1,) holds 1; every name must be a non-empty string."),
    (lambda: init_device_mesh("cuda", (2,)), ValueError,  # (the host's platforms are not pinned)
     "init_device_mesh: device_type='cuda' has no devices on this machine (JAX sees platform(s) "),
    (lambda: init_device_mesh("xpu", (2,)), ValueError,
     "init_device_mesh: device_type='xpu' is unknown; use one of 'cpu', 'cuda' (or 'gpu'), 'tpu'."),
    (lambda: init_device_mesh(0, (2,)), TypeError,
     "init_device_mesh: device_type=0 must be a string such as 'cpu' or 'cuda'."),
    (lambda: init_device_mesh("cpu", (0,)), ValueError,
     "init_device_mesh: mesh_shape=(0,) must be non-empty with every size >= 1."),
    (lambda: init_device_mesh("cpu", ()), ValueError, "init_device_mesh: mesh_shape=() must be non-empty"),
    (lambda: init_device_mesh("cpu", "2x4"), TypeError,
     "init_device_mesh: mesh_shape='2x4' must be a tuple of ints such as (2, 4)."),
    (lambda: DeviceMesh("cpu", [0, 0]), ValueError,
     "DeviceMesh: mesh=[0, 0] must hold distinct device indices in [0, 7] (8 cpu device(s) exist)."),
    (lambda: DeviceMesh("cpu", [0, 9]), ValueError, "DeviceMesh: mesh=[0, 9] must hold distinct device indices"),
    (lambda: DeviceMesh("cpu", [0.5]), TypeError,
     "DeviceMesh: mesh=[0.5] must be a nested list of device indices such as [0, 1, 2, 3]."),
    (lambda: DeviceMesh.from_jax("mesh"), TypeError,
     "DeviceMesh.from_jax: jax_mesh='mesh' must be a jax.sharding.Mesh."),
])
def test_mesh_construction_errors(call, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        call()


@pytest.mark.parametrize("call, exc, msg", [
    (lambda m: m["pp"], ValueError,
     "DeviceMesh.__getitem__: mesh_dim_names='pp' names 'pp', which is not a mesh dim; the mesh has dims ('dp', 'tp'): "
     "use one of them, or a tuple of them."),
    (lambda m: m["dp", "dp"], ValueError,
     "DeviceMesh.__getitem__: mesh_dim_names=('dp', 'dp') repeats a mesh dim; name each at most once."),
    (lambda m: m[()], ValueError,
     "DeviceMesh.__getitem__: mesh_dim_names=() is empty; name at least one mesh dim of ('dp', 'tp')."),
    (lambda m: m.size("pp"), ValueError, "DeviceMesh.size: mesh_dim='pp' names 'pp', which is not a mesh dim"),
    (lambda m: m.get_group(2), ValueError,
     "DeviceMesh.get_group: mesh_dim=2 holds mesh dim 2, out of range for a 2-D mesh with dims ('dp', 'tp')."),
    (lambda m: m.get_group(1.0), TypeError,
     "DeviceMesh.get_group: mesh_dim=1.0 must be a mesh dim name, an int, or a tuple of them; "
     "the mesh has dims ('dp', 'tp')."),
])
def test_mesh_lookup_errors(mesh2x4, call, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        call(mesh2x4)


def test_public_names():
    """__all__ is the package's public surface: it lists every public attribute (a submodule is not an
    export), each once, and nothing that is not there."""
    public = [n for n, v in vars(spmd).items()
              if not n.startswith("_") and type(v).__name__ not in ("module", "_Feature")]
    assert sorted(spmd.__all__) == sorted(public)
