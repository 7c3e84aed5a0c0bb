"""Porting fidelity (issue 12): 64-bit values, the names torch programs use, object types, and
torch-style programs run through spmdrun with only the import changed (compared with expected
output, and line by line with torch when torch is installed)."""

from __future__ import annotations

import collections
import datetime
import enum
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import spmd
import spmd.distributed as dist
from spmd.distributed._objects import dumps, loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_launcher import SCRIPTS, clean_env, rank_results, spmdrun  # noqa: E402


# --- item 7: object collectives keep types, or refuse with the allow_pickle hint -----------------
class Color(enum.IntEnum):
    RED = 1


class MyDict(dict):
    pass


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("obj", [
    collections.Counter("abracadabra"),
    collections.OrderedDict([(2, "b"), ("a", (1, 2))]),
    collections.defaultdict(list, {"k": [1, 2]}),
    collections.defaultdict(None, {1: 2}),
    collections.deque([1, "x"], maxlen=4),
    bytearray(b"\x00\xff"),
    {"nested": [collections.Counter({1: 2}), frozenset({1})]},
])
def test_objects_keep_their_exact_type(obj):
    back = loads(dumps(obj))
    assert type(back) is type(obj) and back == obj
    if isinstance(obj, collections.deque):
        assert back.maxlen == obj.maxlen
    if isinstance(obj, collections.defaultdict):
        assert back.default_factory is obj.default_factory
    if isinstance(obj, collections.OrderedDict):
        assert list(back) == list(obj)
    if isinstance(obj, dict) and "nested" in obj:
        assert type(back["nested"][0]) is collections.Counter


@pytest.mark.parametrize("obj,name", [
    (Point(1, 2), "Point"),
    (Color.RED, "Color"),
    (MyDict(a=1), "MyDict"),
    (collections.defaultdict(lambda: 0), "defaultdict whose default_factory is"),
])
def test_subclasses_are_refused_with_the_pickle_hint(world1, obj, name):
    with pytest.raises(TypeError, match=re.escape(f"all_gather_object: cannot send an object holding a {name}")) as e:
        dist.all_gather_object([None], obj)
    assert "pass allow_pickle=True on every rank" in str(e.value)
    if not isinstance(obj, collections.defaultdict):  # a lambda factory cannot be pickled either
        assert type(dist.all_gather_object([None], obj, allow_pickle=True)[0]) is type(obj)


# --- item 1: 64-bit values keep dtype and value (one process; the multi-process run is below) --
def test_int64_and_float64_are_exact_on_the_facade(world1):
    big = np.array([2 ** 40 + 1, -(2 ** 62)])
    for fn in (dist.all_reduce, lambda t: dist.broadcast(t, 0), lambda t: dist.all_gather(None, t)[0],
               lambda t: dist.all_reduce_coalesced([t])[0]):
        out = fn(big.copy())
        assert out.dtype == np.int64 and np.array_equal(np.asarray(out), big)
    f = np.array([4 * (1 + 1e-12)])
    out = dist.all_reduce(f.copy())
    assert out.dtype == np.float64 and np.asarray(out)[0] - 4 == f[0] - 4 != 0.0
    assert dist.all_reduce(np.array([1 + 2j], np.complex128)).dtype == np.complex128


def test_64_bit_on_the_eager_process_group(mesh2x4):
    pg = mesh2x4.get_group("tp")
    x = np.arange(2 * 4 * 3, dtype=np.int64).reshape(2, 4, 3) + 2 ** 40
    out = pg.allreduce(x)
    assert out.dtype == np.int64 and np.array_equal(np.asarray(out), np.broadcast_to(x.sum(1, keepdims=True), x.shape))
    f = np.full((2, 4, 1), 1 + 1e-12)
    out = pg.allreduce(f)
    assert out.dtype == np.float64 and np.asarray(out)[0, 0, 0] - 4 == 4 * (1 + 1e-12) - 4 != 0.0
    u = np.arange(8, dtype=np.uint64).reshape(2, 4, 1) + 2 ** 63
    assert np.array_equal(np.asarray(pg.allreduce(u, op="max")), np.broadcast_to(u.max(1, keepdims=True), u.shape))
    c = (np.arange(8) + 1e-13j).astype(np.complex128).reshape(2, 4, 1)
    assert np.array_equal(np.asarray(pg.broadcast(c, src=3)), np.broadcast_to(c[:, 3:4], c.shape))
    with pytest.raises(TypeError, match=re.escape("all_reduce: op=ReduceOp.MAX is refused on an input of "
                                                  "dtype complex128: complex numbers have no order")):
        pg.allreduce(c, op=dist.ReduceOp.MAX)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.float64, np.complex128])
def test_64_bit_dtensor(mesh2x4, dtype):
    x = (np.arange(30).reshape(10, 3) + 2 ** 53 + 1).astype(dtype)  # 2**53 + 1 has no float32 / float64-sum twin
    dt = spmd.distribute_tensor(x, mesh2x4, [spmd.Shard(0), spmd.Shard(1)])
    assert dt.dtype == dtype
    for placements in ([spmd.Replicate(), spmd.Shard(0)], [spmd.Shard(1), spmd.Replicate()]):
        assert np.asarray(dt.redistribute(placements=placements).full_tensor()).tobytes() == x.tobytes()
    assert [np.asarray(t).dtype for t in dt.local_tensors()] == [np.dtype(dtype)] * 8
    if np.dtype(dtype).kind in "iu":
        parts = [np.full((2,), 2 ** 50 + r, dtype) for r in range(8)]
        p = spmd.DTensor.from_local(parts, mesh2x4, [spmd.Partial(), spmd.Partial()])
        assert np.array_equal(np.asarray(p.full_tensor()), np.full((2,), 8 * 2 ** 50 + 28, dtype))


def test_64_bit_dtensor_ops(mesh2x4):
    x = np.arange(8, dtype=np.int64) + 2 ** 40
    dt = spmd.distribute_tensor(x, mesh2x4, [spmd.Shard(0), spmd.Replicate()])
    assert np.array_equal(np.asarray((dt * 3 + 1).full_tensor()), x * 3 + 1)
    total = dt.sum()
    assert total.dtype == np.int64 and int(np.asarray(total.full_tensor())) == int(x.sum())
    f = spmd.distribute_tensor(np.full(8, 1 + 1e-12), mesh2x4, [spmd.Shard(0), spmd.Replicate()])
    assert float(np.asarray(f.sum().full_tensor())) == np.full(8, 1 + 1e-12).sum() != 8.0


def test_torch_tensors_into_dtensor_and_the_facade(world1, mesh2x4):
    torch = pytest.importorskip("torch")
    w = torch.randn(8, 4, requires_grad=True)  # a parameter, as torch's DTensor README distributes
    dt = spmd.distribute_tensor(w, mesh2x4, [spmd.Shard(0), spmd.Shard(1)])
    assert np.array_equal(np.asarray(dt.full_tensor()), w.detach().numpy())
    b = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    assert np.asarray(spmd.DTensor.from_local([b] * 8, mesh2x4, [spmd.Replicate()] * 2).full_tensor()).tolist() == [1.5, -2.25]
    t = torch.tensor([2 ** 40 + 3])
    dist.all_reduce(t)  # in place, int64
    assert t.tolist() == [2 ** 40 + 3] and t.dtype == torch.int64


def test_mesh_hint_under_a_launcher(monkeypatch):
    from spmd._launch import missing_devices_hint

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=re.escape(
            "init_device_mesh: this process was started by a launcher with WORLD_SIZE=4 but has not joined the job, "
            "so a mesh would hold this process's devices only; call spmd.distributed.init_process_group() first")):
        spmd.init_device_mesh("cpu", (2,))
    hint = missing_devices_hint(16, 4, "cpu")
    assert hint == ("; the 4 processes of this job hold 4 cpu device(s) in all: launch more processes or give each "
                    "more devices (spmdrun --nproc-per-node N --devices-per-proc K with N*K = 16)")
    monkeypatch.delenv("WORLD_SIZE")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in missing_devices_hint(16, 8, "cpu")


# --- item 6: the names -------------------------------------------------------------------------
def test_mesh_names_and_aliases_are_the_projects():
    from spmd.distributed import device_mesh, tensor
    from spmd.distributed.tensor import debug

    assert dist.DeviceMesh is spmd.DeviceMesh is device_mesh.DeviceMesh is tensor.DeviceMesh
    assert dist.init_device_mesh is device_mesh.init_device_mesh is tensor.init_device_mesh
    assert (tensor.DTensor, tensor.distribute_tensor, tensor.Shard) == (spmd.DTensor, spmd.distribute_tensor, spmd.Shard)
    assert (debug.CommDebugMode, debug.visualize_sharding) == (dist.CommDebugMode, dist.visualize_sharding)
    assert dist.reduce_op.SUM == dist.ReduceOp.SUM
    assert dist.is_gloo_available() and not dist.is_ucc_available()
    assert dist.get_default_backend_for_device("cuda:0") == "nccl"
    assert dist.get_default_backend_for_device(jax.devices()[0]) == "gloo"
    with pytest.raises(ValueError, match=re.escape("get_default_backend_for_device: device='xpu' has no backend")):
        dist.get_default_backend_for_device("xpu")


def test_launch_queries(clean):
    assert not dist.is_torchelastic_launched()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(RuntimeError, match=re.escape("get_node_local_rank: LOCAL_RANK is not in the environment")):
        dist.get_node_local_rank()
    clean.setenv("LOCAL_RANK", "2")
    clean.setenv("SPMD_RESTART_COUNT", "0")
    assert dist.get_node_local_rank() == 2 and dist.is_torchelastic_launched()


def test_stores_in_one_process(world1):
    a, b = dist.TCPStore("127.0.0.1", 29500), dist.TCPStore("127.0.0.1", 29500, is_master=True)
    a.set("k", "v")
    assert b.get("k") == b"v"  # same address, same keys
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5 and a.get("n") == b"5"
    assert a.check(["k", "n"]) and not a.check(["k", "missing"])
    p = dist.PrefixStore("run1", a)
    p.multi_set(["x", "y"], [b"1", "2"])
    assert p.multi_get(["x", "y"]) == [b"1", b"2"] and p.num_keys() == 2 and not a.check(["x"])
    assert a.delete_key("k") and not a.delete_key("k")
    h = dist.HashStore()
    h.set_timeout(datetime.timedelta(seconds=0.05))
    with pytest.raises(TimeoutError, match=re.escape("Store.get: key='nope' was not set within 0.05 s")):
        h.get("nope")
    with pytest.raises(TimeoutError, match=re.escape("Store.wait: key='nope' was not set within 0.05 s")):
        a.wait(["n", "nope"], timeout=0.05)
    with pytest.raises(ValueError, match=re.escape("Store.add: key='x' holds b'1x', not an integer")):
        p.set("x", "1x")
        p.add("x", 1)
    with pytest.raises(TypeError, match=re.escape("Store.set: value=3 must be str or bytes.")):
        h.set("k", 3)
    with pytest.raises(TypeError, match=re.escape("TCPStore: port='29500' must be an int such as 29500.")):
        dist.TCPStore("127.0.0.1", "29500")
    with pytest.raises(ValueError, match=re.escape("TCPStore: port=70000 must be in 0..65535.")):
        dist.TCPStore("127.0.0.1", 70000)


def test_future_and_coalesced(world1):
    work = dist.all_reduce(np.arange(3), async_op=True)
    fut = work.get_future()
    assert fut.done() and np.array_equal(fut.wait()[0], np.arange(3))
    assert fut.then(lambda f: np.asarray(f.value()[0]).sum()).wait() == 3
    buf32, buf64 = np.ones(2, np.float32), np.array([2 ** 41])
    out = dist.all_reduce_coalesced([buf32, buf64])
    assert [o.dtype for o in out] == [np.float32, np.int64] and np.asarray(out[1])[0] == 2 ** 41


def test_subgroups_and_object_p2p_checks(world1):
    mine, groups = dist.new_subgroups()
    assert dist.get_process_group_ranks(mine) == [0] and len(groups) == 1
    with pytest.raises(ValueError, match=re.escape("new_subgroups: group_size=2 must be in [1, 1]")):
        dist.new_subgroups(group_size=2)
    with pytest.raises(ValueError, match=re.escape("new_subgroups_by_enumeration: rank(s) [0] appear in more than one")):
        dist.new_subgroups_by_enumeration([[0], [0]])
    with pytest.raises(TypeError, match=re.escape("new_subgroups_by_enumeration: ranks_per_subgroup_list=0 must be a list")):
        dist.new_subgroups_by_enumeration(0)
    with pytest.raises(ValueError, match=re.escape("send_object_list: dst=0 is this rank")):
        dist.send_object_list([1], dst=0)
    with pytest.raises(ValueError, match=re.escape("recv_object_list: rank 0 is alone in its group")):
        dist.recv_object_list([None])
    dist.monitored_barrier(timeout=1)  # a world of one passes at once


def test_comm_debug_mode_counts_from_hlo(world1, mesh2x4):
    with dist.CommDebugMode() as outer:
        dist.all_reduce(np.ones(4, np.float32))
        with dist.CommDebugMode() as inner:
            dist.all_gather(None, np.ones(4, np.float32))
    assert outer.get_comm_counts() == {"all-reduce": 1, "all-gather": 1} and outer.get_total_counts() == 2
    assert inner.get_comm_counts() == {"all-gather": 1}
    assert outer.get_comm_bytes() == {"all-reduce": 16, "all-gather": 16}
    assert "all_reduce  all-reduce" in outer.generate_comm_debug_tracing_table()
    dist.all_reduce(np.ones(4, np.float32))  # outside: not counted
    assert outer.get_total_counts() == 2
    dt = spmd.distribute_tensor(np.arange(64.0).reshape(8, 8), mesh2x4, [spmd.Shard(0), spmd.Shard(1)])
    with dist.CommDebugMode() as mode:
        dt.redistribute(placements=[spmd.Shard(1), spmd.Shard(0)])  # all_gather + all_to_all (README's plan)
        mesh2x4.get_group("dp").allreduce(np.ones((2, 4, 3), np.float32))
    assert mode.get_comm_counts() == {"all-gather": 1, "all-to-all": 1, "all-reduce": 1}
    assert [w for w, _, _, _ in mode.log] == ["DTensor.redistribute", "DTensor.redistribute", "ProcessGroup.allreduce"]


def test_visualize_sharding(capsys, mesh2x4):
    dt = spmd.distribute_tensor(np.arange(10.0), mesh2x4, [spmd.Shard(0), spmd.Replicate()])
    dist.visualize_sharding(dt, header="x")
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert out.startswith("x\nDTensor(") and ["[0:5]", "(5,)", "0,", "1,", "2,", "3"] in rows
    assert ["[5:10]", "(5,)", "4,", "5,", "6,", "7"] in rows
    with pytest.raises(TypeError, match=re.escape("visualize_sharding: dtensor=[1] must be a DTensor")):
        dist.visualize_sharding([1])


def test_ddp_in_one_process(world1):
    def apply(p, x):
        return x @ p["w"]

    def loss(p, x):
        return (apply(p, x) ** 2).mean()

    w = {"w": np.ones((2, 1), np.float32)}
    ddp = dist.DistributedDataParallel(apply, w, optimizer=optax.sgd(0.5))
    x = np.array([[1.0, 2.0]], np.float32)
    assert float(ddp.step(loss, x)) == 9.0
    # d/dw mean((x@w)^2) = 2 * (x@w) * x = [6, 12]; w - 0.5 * grad
    assert np.allclose(ddp.params["w"].ravel(), [1 - 3.0, 1 - 6.0]) and np.allclose(ddp(x), [[-12.0]])
    with pytest.raises(ValueError, match=re.escape("DistributedDataParallel.step: no optimizer was given")):
        dist.DistributedDataParallel(apply, w).step(loss, x)
    with pytest.raises(TypeError, match=re.escape("DistributedDataParallel: module=3 must be a flax module")):
        dist.DistributedDataParallel(3, w)


# --- across processes: items 1, 6, 7 in one 2-rank run -----------------------------------------
@pytest.mark.timeout(150)
def test_porting_checks_on_2_ranks(tmp_path):
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "porting_check.py"),
                              str(tmp_path), timeout=140)
    assert rc == 0, err[-3000:]
    for names in rank_results(tmp_path, 2):
        for must in ("int64 all_reduce sum", "bfloat16 all_gather", "uint64 send/recv", "complex128 broadcast",
                     "complex MAX refused before any work", "Counter arrives as Counter", "TCPStore add is atomic across ranks",
                     "monitored_barrier names the late rank", "DDP 3 steps == one process on the whole batch"):
            assert must in names


# --- torch programs, ported by changing one import line ---------------------------------------------
PROGRAMS = SCRIPTS / "torch_programs"
TORCH_IMPORT, SPMD_IMPORT = "import torch.distributed as dist", "import spmd.distributed as dist"
_LINE = re.compile(r"^\[(?:rank|default)(\d+)\]: ?(rank \d+: .*)$")


def program_lines(out: str) -> list[str]:
    """The programs' own lines ('rank r: ...'), rank by rank, each rank's in the order printed."""
    found = [(int(m[1]), m[2]) for m in map(_LINE.match, out.splitlines()) if m]
    return [text for _, text in sorted(found, key=lambda rt: rt[0])]


def ported(program: Path, tmp_path: Path) -> Path:
    source = program.read_text()
    assert source.count(TORCH_IMPORT) == 1, f"{program.name} must import torch.distributed exactly once"
    port = tmp_path / program.name
    port.write_text(source.replace(TORCH_IMPORT, SPMD_IMPORT))
    return port


@pytest.mark.timeout(200)
def test_torch_program_ports_by_changing_the_import(tmp_path):
    """The program makes its tensors with torch (as every torch program does), so it needs torch
    installed even under spmd; without torch, tests/mp_scripts/porting_check.py covers the same items."""
    pytest.importorskip("torch")
    program = PROGRAMS / "tutorial.py"
    expected = (PROGRAMS / "tutorial.expected").read_text().splitlines()
    rc, out, err, _ = spmdrun("--standalone", "--nproc-per-node", "2", str(ported(program, tmp_path)), timeout=90)
    assert rc == 0, err[-3000:]
    assert program_lines(out) == expected
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--tee", "3", str(program)], capture_output=True, text=True, timeout=100,
                       env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert program_lines(p.stdout) == program_lines(out)  # line by line, rank by rank
