"""Cross-mesh redistribute (torch refuses it, pytorch#126795): a costed, printable plan; exact values;
sub-mesh to full mesh, disjoint halves, (8,) to (2, 4) over the same devices; uneven and Partial sources."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import spmd
import spmd.ops as ops
from placements import Partial, Replicate, Shard, rank_to_coord
from spmd import DeviceMesh, DTensor, distribute_tensor

R, S, P = Replicate(), Shard, Partial


@pytest.fixture(scope="module")
def meshes(mesh8, mesh2x4):
    return {
        "8": mesh8,
        "2x4": mesh2x4,
        "lo4": spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("x",)),  # devices 0..3
        "hi4": DeviceMesh.from_jax(Mesh(np.array(jax.devices()[4:8]), ("y",))),  # devices 4..7
        "hi2x2": DeviceMesh.from_jax(Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("a", "b"))),
    }


def make(x, mesh, pl):
    """Partial sources hold a non-trivial split: sum -> x on coordinate 0 plus offsets that cancel;
    max -> x lowered on the other coordinates."""
    if not any(isinstance(p, Partial) for p in pl):
        return distribute_tensor(x, mesh, pl)
    base = distribute_tensor(x, mesh, [R if isinstance(p, Partial) else p for p in pl]).local_tensors()
    locs = []
    for r, b in enumerate(base):
        b, c = np.asarray(b), rank_to_coord(r, mesh.shape)
        for m, p in enumerate(pl):
            if isinstance(p, Partial):
                k = mesh.shape[m]
                if p.reduce_op == "sum":
                    b = (b if c[m] == 0 else np.zeros_like(b)) + (1 if c[m] else -(k - 1))
                else:
                    b = b - c[m]
        locs.append(b)
    return DTensor.from_local(locs, mesh, pl, shape=x.shape)


CASES = [
    ("lo4", [S(0)], "8", [S(1)]),  # a sub-mesh to the full mesh
    ("8", [S(0)], "lo4", [S(0)]),  # and back (uneven: 10 rows over 8)
    ("lo4", [S(1)], "hi4", [S(0)]),  # disjoint halves
    ("lo4", [P("sum")], "hi4", [R]),
    ("hi4", [P("max")], "lo4", [S(0)]),
    ("8", [S(0)], "2x4", [S(0), S(1)]),  # same devices, other shape
    ("2x4", [S(1), P("sum")], "8", [P("sum")]),
    ("2x4", [S(0), S(0)], "hi2x2", [S(1), R]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{''.join(map(str, b))}-{c}-{''.join(map(str, d))}" for a, b, c, d in CASES])
def test_cross_mesh_values_and_plan(meshes, case):
    src_m, src, dst_m, dst = case
    x = (np.arange(10 * 7) % 13 - 6).reshape(10, 7).astype(np.float32)
    d = make(x, meshes[src_m], src)
    p = ops.plan_cross_mesh(d, meshes[dst_m], dst)
    y = d.redistribute(meshes[dst_m], dst)
    assert y.device_mesh == meshes[dst_m] and y.placements == tuple(dst) and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y.full_tensor()), x)
    ref = distribute_tensor(x, meshes[dst_m], [R if isinstance(q, Partial) else q for q in dst]).local_tensors()
    if not any(isinstance(q, Partial) for q in dst):
        for a, b in zip(y.local_tensors(), ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert p.src_plan.src == tuple(src) and p.dst_plan.dst == tuple(dst)
    assert all(not isinstance(q, Partial) for q in p.src_plan.dst + p.dst_plan.src)  # the transfer moves values
    assert p.dst_plan.cost().collectives == 0  # the destination side is local (slices, partitions)
    text = str(p)
    assert "2. transfer" in text and f"on mesh {meshes[dst_m].shape}" in text


def test_transfer_bytes(meshes):
    x = np.ones((8, 4), np.float32)
    same = ops.plan_cross_mesh(distribute_tensor(x, meshes["8"], [S(0)]), meshes["2x4"], [S(0), S(0)])
    assert same.transfer_bytes == (0,) * 8 and same.bytes == 0  # the same blocks on the same devices
    halves = ops.plan_cross_mesh(distribute_tensor(x, meshes["lo4"], [R]), meshes["hi4"], [R])
    assert halves.transfer_bytes == (8 * 4 * 4,) * 4  # every block crosses over
    grow = ops.plan_cross_mesh(distribute_tensor(x, meshes["lo4"], [R]), meshes["8"], [R])
    assert grow.transfer_bytes == (0,) * 4 + (8 * 4 * 4,) * 4  # devices 0..3 hold it already


def test_cross_mesh_errors(meshes):
    d = distribute_tensor(np.ones((8, 4), np.float32), meshes["lo4"], [S(0)])
    with pytest.raises(ValueError, match=re.escape("DTensor.redistribute: placements=S(0)RR has 3 placement(s) but the mesh has 2 dim(s)")):
        d.redistribute(meshes["2x4"], [S(0), R, R])
    with pytest.raises(TypeError, match=re.escape("DTensor.redistribute: redistributing onto another mesh")):
        jax.jit(lambda t: t.redistribute(meshes["hi4"], [R]))(d)
