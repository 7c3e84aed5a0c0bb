"""spmd.distributed in one process (world size 1) and its pure parts; the multi-process
runs are in tests/test_launcher.py."""

from __future__ import annotations

import datetime
import fractions
import re
import warnings

import numpy as np
import pytest

import spmd.distributed as dist
from spmd.distributed import _backend, _env, _state
from spmd.distributed._objects import dumps, loads

def x_of(shape=(2, 3), dtype=np.float32):
    return (np.arange(int(np.prod(shape))).reshape(shape) + 1).astype(dtype)


# --- init and state ---------------------------------------------------------------------------
def test_single_process_without_env_is_world_size_1(clean):
    assert not dist.is_initialized()
    dist.init_process_group()
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
    assert dist.get_process_group_ranks() == [0]
    dist.destroy_process_group()
    assert not dist.is_initialized()


def test_uninitialized_calls_say_what_to_do(clean):
    with pytest.raises(RuntimeError, match=re.escape("get_rank: the default process group is not initialized; call "
                                                     "spmd.distributed.init_process_group() first")):
        dist.get_rank()
    with pytest.raises(RuntimeError, match=re.escape("all_reduce: the default process group is not initialized")):
        dist.all_reduce(np.ones(2))


def test_init_twice_is_refused(world1):
    with pytest.raises(RuntimeError, match=re.escape("init_process_group: the default process group is already "
                                                     "initialized; call destroy_process_group() first.")):
        dist.init_process_group()


@pytest.mark.parametrize("env,kwargs,exc,says", [
    ({"WORLD_SIZE": "2", "RANK": "2"}, {}, ValueError,
     "init_process_group: rank=2 is out of range for world_size=2; ranks are 0..1. Check RANK and WORLD_SIZE."),
    ({"WORLD_SIZE": "2"}, {}, ValueError, "init_process_group: WORLD_SIZE=2 is set but RANK is not"),
    ({"RANK": "1"}, {}, ValueError, "init_process_group: RANK=1 is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, {}, ValueError,
     "init_process_group: world_size=2 needs the coordinator's address: set MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "x", "RANK": "0"}, {}, ValueError,
     "init_process_group: the environment variable WORLD_SIZE='x' must be an integer."),
    ({}, {"init_method": "file:///tmp/x"}, ValueError, "init_process_group: init_method='file:///tmp/x' is not supported"),
    ({}, {"init_method": "tcp://nohost"}, ValueError, "init_process_group: init_method='tcp://nohost' must look like"),
    ({}, {"rank": 1.5}, TypeError, "init_process_group: rank=1.5 must be an int"),
    ({}, {"timeout": -1}, ValueError, "init_process_group: timeout=-1 must be positive."),
    ({}, {"timeout": "1s"}, TypeError, "init_process_group: timeout='1s' must be a datetime.timedelta or a number"),
    ({}, {"backend": "ucc"}, RuntimeError, "init_process_group: backend='ucc' is not available: XLA has no UCC "
     "collectives. Use backend='nccl' on NVIDIA GPUs, backend='gloo' on CPU, or backend='mpi'"),
    ({}, {"backend": "mpi"}, RuntimeError, "init_process_group: backend='mpi' needs "),  # the extra, or mpiexec
    ({}, {"backend": "carrier-pigeon"}, ValueError, "init_process_group: backend='carrier-pigeon' is unknown; use one of"),
    ({}, {"backend": 3}, TypeError, "init_process_group: backend=3 must be a string"),
    ({}, {"check_collectives": "yes"}, TypeError,
     "init_process_group: check_collectives='yes' must be True or False (or None: the default)."),
    ({"SPMD_CHECK_COLLECTIVES": "maybe"}, {}, ValueError, "init_process_group: the environment variable "
     "SPMD_CHECK_COLLECTIVES='maybe' must be 1 (check every collective, the default) or 0 (do not)."),
])
def test_init_checks_its_input(clean, env, kwargs, exc, says):
    for k, v in env.items():
        clean.setenv(k, v)
    with pytest.raises(exc, match=re.escape(says)):
        dist.init_process_group(**kwargs)
    assert not dist.is_initialized()


def test_nccl_needs_a_gpu(clean):
    if _backend._has_cuda_plugin():
        assert _backend.resolve_backend("nccl").platform == "cuda"
    else:
        with pytest.raises(RuntimeError, match=re.escape("backend='nccl' needs NVIDIA GPUs and JAX's CUDA plugin")):
            dist.init_process_group("nccl")


def test_init_method_and_timeout_forms(clean):
    assert _env.parse_init_method("tcp://10.1.1.20:23456", "w") == ("10.1.1.20", 23456)
    assert _env.parse_init_method("tcp://[::1]:23456", "w") == ("::1", 23456)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1234", world_size=1, rank=0,
                            timeout=datetime.timedelta(seconds=7))
    assert _state.state("t").timeout_s == 7.0


def test_backend_names():
    assert dist.Backend("GLOO") == "gloo" and dist.Backend.NCCL == "nccl" and dist.Backend.UCC == "ucc"
    with pytest.raises(ValueError, match=re.escape("Backend: name='tcp' is unknown")):
        dist.Backend("tcp")
    # torch's per-device form: the entry for the device this machine has.
    want = "nccl" if _backend._has_cuda_plugin() else "gloo"
    assert _backend.resolve_backend("cpu:gloo,cuda:nccl").name == want


# --- collectives on a world of one ------------------------------------------------------------
def test_collectives_on_one_rank(world1):
    x = x_of()
    np.testing.assert_array_equal(dist.all_reduce(x), x)
    np.testing.assert_array_equal(dist.all_reduce(x.astype(np.int32), op=dist.ReduceOp.BXOR), x)
    np.testing.assert_array_equal(dist.broadcast(x, src=0), x)
    out = [None]
    assert dist.all_gather(out, x) is out
    np.testing.assert_array_equal(out[0], x)
    np.testing.assert_array_equal(dist.all_gather_into_tensor(None, x), x)
    np.testing.assert_array_equal(dist.reduce(x, dst=0, op="max"), x)
    np.testing.assert_array_equal(dist.scatter(None, [x], src=0), x)
    np.testing.assert_array_equal(dist.gather(x, dst=0)[0], x)
    np.testing.assert_array_equal(dist.reduce_scatter(None, [x]), x)
    np.testing.assert_array_equal(dist.reduce_scatter_tensor(None, x), x)
    np.testing.assert_array_equal(dist.all_to_all(None, [x])[0], x)
    np.testing.assert_array_equal(dist.all_to_all_single(None, x), x)
    assert dist.all_reduce(x, async_op=True).wait()
    assert dist.all_gather_object([None], {"a": (1, 2)}) == [{"a": (1, 2)}]
    assert dist.broadcast_object_list([1, "x"], src=0) == [1, "x"]
    assert dist.barrier() is None
    assert dist.new_group([0]) is dist.group.WORLD


@pytest.mark.parametrize("call,exc,says", [
    (lambda x: dist.all_reduce(x, op="median"), ValueError, "all_reduce: op='median' is not a reduce op"),
    (lambda x: dist.all_reduce(x, group=[0]), TypeError, "all_reduce: group=[0] must be None (all ranks) or a group"),
    (lambda x: dist.broadcast(x, src=1), ValueError, "broadcast: src=1 is not a rank of Group(WORLD) (ranks [0])."),
    (lambda x: dist.scatter(None, [x, x], src=0), ValueError,
     "scatter: scatter_list holds 2 array(s); the group has 1 ranks, give one per rank."),
    (lambda x: dist.all_to_all_single(None, x, input_split_sizes=[1, 1]), ValueError,
     "all_to_all_single: input_split_sizes=[1, 1] is uneven"),
    (lambda x: dist.all_to_all(None, [x, x[:1]]), ValueError, "all_to_all: input_tensor_list holds 2 array(s)"),
    (lambda x: dist.all_gather_into_tensor(np.zeros((5, 3)), x), ValueError,
     "all_gather_into_tensor: output_tensor has shape (5, 3); for an input of shape (2, 3) on 1 ranks it must be"),
    (lambda x: dist.send(x, dst=0), ValueError, "isend: dst=0 is this rank"),
    (lambda x: dist.recv(x), ValueError, "irecv: src= is required"),
    (lambda x: dist.new_group([0, 1]), ValueError, "new_group: ranks=[0, 1] holds 1, out of range for world size 1"),
    (lambda x: dist.new_group([0, 0]), ValueError, "new_group: ranks=[0, 0] repeats a rank"),
    (lambda x: dist.all_gather_object(None, object()), TypeError,
     "all_gather_object: cannot send an object holding a object safely"),
    (lambda x: dist.all_gather_object(None, 1, timeout="1s"), TypeError,
     "all_gather_object: timeout='1s' must be a datetime.timedelta or a number of seconds."),
    (lambda x: dist.barrier(timeout=0), ValueError, "barrier: timeout=0 must be positive."),
    (lambda x: dist.gather_object(1, None, dst=1), ValueError,
     "gather_object: dst=1 is not a rank of Group(WORLD) (ranks [0])."),
    (lambda x: dist.scatter_object_list([None], None, src=1), ValueError,
     "scatter_object_list: src=1 is not a rank of Group(WORLD) (ranks [0])."),
    (lambda x: dist.broadcast_object_list([1], group_src=-1), ValueError,
     "broadcast_object_list: group_src=-1 must be an int in [0, 0]."),
    (lambda x: dist.get_group_rank(None, True), TypeError, "get_group_rank: global_rank=True must be an int rank."),
])
def test_collective_errors(world1, call, exc, says):
    with pytest.raises(exc, match=re.escape(says)):
        call(x_of())


# --- safe serialisation -------------------------------------------------------------------------
@pytest.mark.parametrize("obj", [
    None, True, 3, -2.5, float("inf"), 1 + 2j, "text", b"\x00\xff", [1, [2, (3, 4)]], (), {"a": 1},
    {1: "int key", (2, 3): "tuple key"}, {"__tuple__": "looks like a tag"}, {1, 2}, frozenset({"a"}),
    np.arange(6, dtype=np.int16).reshape(2, 3), np.float32(1.5), np.array(True), np.zeros((0, 3)),
    np.float64(2.5), np.complex128(1j), np.str_("s"), np.array(2.0), np.arange(6).reshape(2, 3).T,
])
def test_objects_round_trip_without_pickle(obj):
    back = loads(dumps(obj))
    if isinstance(obj, np.ndarray) or isinstance(obj, np.generic):
        assert np.asarray(back).dtype == np.asarray(obj).dtype and type(back) is type(obj)
        assert np.shape(back) == np.shape(obj)
        np.testing.assert_array_equal(back, obj)
    elif isinstance(obj, float) and obj != obj:
        assert back != back
    else:
        assert back == obj and type(back) is type(obj)


def test_pickle_only_when_both_sides_opt_in():
    f = fractions.Fraction(1, 3)
    with pytest.raises(TypeError, match=re.escape("dumps: cannot send an object holding a Fraction safely")):
        dumps(f)
    data = dumps(f, allow_pickle=True)
    with pytest.raises(ValueError, match=re.escape("loads: a peer sent a pickled object and this rank did not pass "
                                                   "allow_pickle=True")):
        loads(data)
    assert loads(data, allow_pickle=True) == f
    with pytest.raises(TypeError, match=re.escape("object array")):
        dumps(np.array([object()]))


# --- results written in place, as torch (issue 12.2) ------------------------------------------------
def test_collectives_write_into_writable_buffers(world1):
    twice = dist.ReduceOp.PREMUL_SUM(2.0)  # one rank: the result differs from the input
    t = x_of()
    returned = dist.all_reduce(t, op=twice)
    np.testing.assert_array_equal(t, 2 * x_of())
    np.testing.assert_array_equal(returned, 2 * x_of())
    u = x_of()
    work = dist.all_reduce(u, op=dist.ReduceOp.PREMUL_SUM(3.0), async_op=True)
    assert work.wait()
    np.testing.assert_array_equal(u, 3 * x_of())
    out = np.zeros((2, 3), np.float32)
    dist.scatter(out, [x_of()], src=0)
    np.testing.assert_array_equal(out, x_of())
    cat = np.zeros((2, 3), np.float32)
    dist.all_gather_into_tensor(cat, x_of())
    np.testing.assert_array_equal(cat, x_of())
    rs = np.zeros((2, 3), np.float32)
    dist.reduce_scatter_tensor(rs, x_of(), op=twice)
    np.testing.assert_array_equal(rs, 2 * x_of())
    bufs = [np.zeros((2, 3), np.float32)]
    first = bufs[0]
    dist.all_gather(bufs, x_of())
    assert bufs[0] is first
    np.testing.assert_array_equal(first, x_of())
    frozen = x_of()
    frozen.flags.writeable = False
    np.testing.assert_array_equal(dist.all_reduce(frozen, op=twice), 2 * x_of())  # returned, input untouched
    np.testing.assert_array_equal(frozen, x_of())


def test_torch_cpu_tensors_are_written_in_place(world1):
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(2.0))
    assert t.tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


def test_a_dropped_result_of_a_jax_input_warns(world1):
    import jax.numpy as jnp

    x = jnp.asarray(x_of())
    with pytest.warns(dist.DiscardedResultWarning, match=re.escape(
            "all_reduce: the result was discarded, and tensor is a jax.Array, which cannot change in place")):
        dist.all_reduce(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = dist.all_reduce(x)  # kept: no warning
        dist.all_reduce(x_of())  # NumPy input: written in place, no warning
    np.testing.assert_array_equal(y, x_of())


def test_debug_level_is_checked(clean):
    clean.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match=re.escape("init_process_group: the environment variable "
                                                   "TORCH_DISTRIBUTED_DEBUG='LOUD' must be one of ['OFF', 'INFO', 'DETAIL'].")):
        dist.init_process_group()
