"""Bad inputs raise TypeError (wrong kind) or ValueError (wrong value) with a message that names
the function, the argument, the value, and a fix."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import Partial, ReduceOp, Replicate, Shard

S0, R = Shard(0), Replicate()


def owned(msg) -> str:
    """A pattern for the parts of a message the project writes: a string is matched as it is; a tuple
    of strings in order, with anything (a JAX repr, the host's platform) between them."""
    parts = (msg,) if isinstance(msg, str) else msg
    return "(?s)" + ".*".join(re.escape(p) for p in parts)  # (a repr may span lines)


@pytest.fixture(scope="module")
def m24():
    return spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))


@pytest.fixture(scope="module")
def m8():
    return spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))


def _in_region(mesh, body, x=None):
    """Run ``body`` on (4, 8) float blocks of an (8, 8) array inside @spmd on ``mesh``."""
    x = jnp.ones((8, 8)) if x is None else x
    pl = [S0, R] if mesh.ndim == 2 else [S0]
    return spmd.spmd(body, mesh, in_placements=pl, out_placements=pl)(x)


INT = jnp.ones((8, 8), jnp.int32)
BOOL = jnp.ones((8, 8), bool)
STR = np.array([str(i) for i in range(8)])
CPLX = np.ones((2,), np.complex64) * (1 + 2j)

# (case id, call taking (m24, m8), exception type, the exact message or its start)
CASES = [
    ("unknown group", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, group="pp")), ValueError,
     "all_reduce: group='pp' names 'pp', which is not a mesh dim; the mesh has dims ('dp', 'tp'): use one of them, "
     "or a tuple of them."),
    ("group of the wrong kind", lambda m, m8: _in_region(m, lambda x: spmd.all_gather(x, group=1.5)), TypeError,
     "all_gather: group=1.5 must be a mesh dim name, an int, or a tuple of them; the mesh has dims ('dp', 'tp')."),
    ("group repeats a dim", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, group=("tp", "tp"))),
     ValueError, "all_reduce: group=('tp', 'tp') repeats a mesh dim; name each at most once."),
    ("src out of range", lambda m, m8: _in_region(m, lambda x: spmd.broadcast(x, 4, group="tp")), ValueError,
     "broadcast: src=4 is out of range for group ('tp',) of size 4; use 0 <= src < 4."),
    ("src not an int", lambda m, m8: _in_region(m, lambda x: spmd.scatter(x, 1.0, group="tp")), TypeError,
     "scatter: src=1.0 must be an int rank in the group ('tp',), e.g. src=0."),
    ("dst negative", lambda m, m8: _in_region(m, lambda x: spmd.reduce(x, -1, group="tp")), ValueError,
     "reduce: dst=-1 is out of range for group ('tp',) of size 4; use 0 <= dst < 4."),
    ("gather dst out of a flattened group", lambda m, m8: _in_region(m, lambda x: spmd.gather(x, 8, group=("dp", "tp"))),
     ValueError, "gather: dst=8 is out of range for group ('dp', 'tp') of size 8; use 0 <= dst < 8."),
    ("bitwise op on floats", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, "band", group="tp")), TypeError,
     "all_reduce: op=ReduceOp.BAND is a bitwise op and the input is float32; bitwise ops take integer or bool "
     "inputs (as in torch); cast the input, or use MAX/MIN/SUM."),
    ("bitwise reduce_scatter on bf16",
     lambda m, m8: _in_region(m, lambda x: spmd.reduce_scatter(x, ReduceOp.BXOR, group="tp"),
                              jnp.ones((8, 8), jnp.bfloat16)), TypeError,
     "reduce_scatter: op=ReduceOp.BXOR is a bitwise op and the input is bfloat16"),
    ("avg on ints", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, "avg", group="tp"), INT), TypeError,
     "all_reduce: op=ReduceOp.AVG is refused on an input of dtype int32 (torch allows AVG only on floating "
     "inputs); reduce with SUM and divide, or cast to a float dtype."),
    ("premul_sum on bools", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, ReduceOp.PREMUL_SUM(2), group="tp"),
                                                     BOOL), TypeError,
     "all_reduce: op=ReduceOp.PREMUL_SUM(2.0) needs a numeric input, got bool; cast it first."),
    ("fractional premul_sum on ints",
     lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, ReduceOp.PREMUL_SUM(0.5), group="tp"), INT), ValueError,
     "all_reduce: op=ReduceOp.PREMUL_SUM(0.5) on an input of dtype int32 would truncate the factor 0.5 to an "
     "integer; use an integral factor, or cast the input to a float dtype."),
    ("unknown reduce op string", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, "mean", group="tp")),
     ValueError, "all_reduce: op='mean' is not a reduce op; use one of 'sum', 'avg', 'product', 'min', 'max', "
                 "'band', 'bor', 'bxor' or a ReduceOp."),
    ("reduce op of the wrong kind", lambda m, m8: _in_region(m, lambda x: spmd.reduce(x, 0, op=1, group="tp")),
     TypeError, "reduce: op=1 is not a reduce op; pass a ReduceOp (e.g. ReduceOp.SUM) or its name as a string "
                "(e.g. 'sum')."),
    ("shape the group cannot split",
     lambda m, m8: _in_region(m, lambda x: spmd.reduce_scatter(x[:3], group="tp")), ValueError,
     "reduce_scatter: the input's dim scatter_dim=0 has size 3, not divisible by the group ('tp',) of size 4; "
     "pad it to a multiple of 4, or use a DTensor, which handles uneven shards."),
    ("all_to_all split the group cannot split",
     lambda m, m8: _in_region(m, lambda x: spmd.all_to_all(x, 1, 0, group=("dp", "tp")), jnp.ones((8, 4))),
     ValueError, "all_to_all: the input's dim split_axis=1 has size 4, not divisible by the group ('dp', 'tp') of "
                 "size 8; pad it to a multiple of 8"),
    ("all_gather axis out of range", lambda m, m8: _in_region(m, lambda x: spmd.all_gather(x, axis=3, group="tp")),
     ValueError, "all_gather: axis=3 is out of range for an input of rank 3; use a value in [-3, 2]."),
    ("scatter input without the group's leading axis",
     lambda m, m8: _in_region(m, lambda x: spmd.scatter(x[:3], 0, group="tp")), ValueError,
     "scatter: the input has shape (3, 8); it must have a leading axis of the group ('tp',)'s size 4 "
     "(piece i goes to rank i)."),
    ("permute sends to one rank twice",
     lambda m, m8: _in_region(m, lambda x: spmd.permute(x, [(0, 1), (2, 1)], group="tp")), ValueError,
     "permute: pairs=[(0, 1), (2, 1)] uses a destination rank twice; each rank sends at most once and receives "
     "at most once (split it into several permutes)."),
    ("permute rank out of range", lambda m, m8: _in_region(m, lambda x: spmd.permute(x, [(0, 4)], group="tp")),
     ValueError, "permute: pairs dst=4 is out of range for group ('tp',) of size 4; use 0 <= pairs dst < 4."),
    ("permute pairs not pairs", lambda m, m8: _in_region(m, lambda x: spmd.permute(x, [(0, 1, 2)], group="tp")),
     ValueError, "permute: pairs holds (0, 1, 2); each pair is (src, dst)."),
    ("permute pairs not a sequence", lambda m, m8: _in_region(m, lambda x: spmd.permute(x, 3, group="tp")), TypeError,
     "permute: pairs=3 must be a sequence of (src, dst) rank pairs."),
    ("collective outside a region", lambda m, m8: spmd.all_reduce(jnp.ones(3)), ValueError,
     "all_reduce: called outside an SPMD region; call it inside a function decorated with @spmd(mesh, ...) "
     "(or jax.shard_map), or use mesh.get_group(dim) for eager per-rank arrays."),
    ("axis_index outside a region", lambda m, m8: spmd.axis_index("x"), ValueError,
     "axis_index: called outside an SPMD region"),
    ("eager input with wrong leading axes", lambda m, m8: m.get_group("tp").allreduce(jnp.ones((4, 2))), ValueError,
     "ProcessGroup.allreduce: the input t has shape (4, 2); its leading axes must be the mesh shape (2, 4) "
     "(one block per rank): stack the ranks' tensors, e.g. t of shape (2, 4, 4, 2) for a block of shape (4, 2)."),
    ("eager src out of range", lambda m, m8: m.get_group("dp").broadcast(jnp.ones((2, 4, 3)), src=2), ValueError,
     "broadcast: src=2 is out of range for group ('dp',) of size 2; use 0 <= src < 2."),
    ("eager bitwise op on floats", lambda m, m8: m.get_group("tp").allreduce(jnp.ones((2, 4, 3)), "bor"), TypeError,
     "all_reduce: op=ReduceOp.BOR is a bitwise op and the input is float32"),
    ("placements of the wrong length",
     lambda m, m8: spmd.spmd(lambda x: x, m, in_placements=[S0], out_placements=[R, R])(jnp.ones(8)), ValueError,
     "spmd: in_placements[0]=S(0) has 1 placement(s) but the mesh has 2 dim(s); give exactly one placement per "
     "mesh dim."),
    ("Shard dim out of range",
     lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=Shard(2), out_placements=S0)(jnp.ones(8)), ValueError,
     "spmd: in_placements[0][0]=Shard(dim=2) is out of range for a tensor of rank 1; use a dim in [-1, 0]."),
    ("Shard of a 0-d result",
     lambda m, m8: spmd.spmd(lambda x: x.sum(), m8, in_placements=S0, out_placements=S0)(jnp.ones(8)), ValueError,
     "spmd: out_placements (leaf 0)[0]=Shard(dim=0) is out of range for a tensor of rank 0; a 0-d tensor cannot be "
     "sharded; use Replicate()."),
    ("shape the region cannot split",
     lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=S0, out_placements=S0)(jnp.ones(10)), ValueError,
     "spmd: in_placements[0]=S(0) cuts dim 0 of argument[0] (shape (10,)) into 8 blocks, but 10 is not divisible "
     "by 8; pad dim 0 to a multiple of 8, or pass a DTensor (uneven shards)."),
    ("nested shards the region cannot split",
     lambda m, m8: spmd.spmd(lambda x: x, m, in_placements=[S0, S0], out_placements=[S0, S0])(jnp.ones(12)),
     ValueError, "spmd: in_placements[0]=S(0)S(0) cuts dim 0 of argument[0] (shape (12,)) into 8 blocks, but 12 is "
                 "not divisible by 8"),
    ("plain array placed Partial",
     lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=Partial(), out_placements=S0)(jnp.ones(8)), ValueError,
     "spmd: in_placements[0]=P(sum) puts a plain array in a Partial placement; a plain array is one value, not "
     "per-rank partial values: pass a DTensor with Partial placements instead."),
    ("argument without placements", lambda m, m8: spmd.spmd(lambda x: x, m8)(jnp.ones(8)), ValueError,
     "spmd: argument[0] has no placements; give in_placements for it (e.g. [Replicate()] * 1 or [Shard(0)] + ...), "
     "or pass a DTensor, which carries its own."),
    ("placements that do not fit the arguments",
     lambda m, m8: spmd.spmd(lambda x, y, z: x, m, in_placements=([S0, R], [R, R]))(*[jnp.ones(8)] * 3), ValueError,
     "spmd: in_placements=([Shard(dim=0), Replicate()], [Replicate(), Replicate()]) does not fit 3 argument(s) on "
     "a 2-D mesh; give a tuple with one entry per argument"),
    ("placement that is not a placement",
     lambda m, m8: spmd.spmd(lambda x: x, m, in_placements=[[S0, "R"]], out_placements=[S0, R])(jnp.ones(8)),
     TypeError, "spmd: in_placements[0][1]='R' is not a placement; use Shard(dim), Replicate() or Partial(op)."),
    ("placement list that is not a list",
     lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=["S(0)"], out_placements=S0)(jnp.ones(8)), TypeError,
     "spmd: in_placements[0]='S(0)' is not a placement list; pass a list of 1 placement(s) such as [Shard(0)]."),
    ("Partial with a bitwise op", lambda m, m8: Partial("bxor"), ValueError,
     "Partial: reduce_op='bxor' cannot be a partial placement; use one of 'sum', 'avg', 'max', 'min', 'product'."),
    ("Shard dim not an int", lambda m, m8: Shard(0.0), TypeError, "Shard: dim must be an int, got 0.0; e.g. Shard(0)."),
    ("Replicate given a dim", lambda m, m8: Replicate(0), TypeError,
     "Replicate: takes no arguments, got Replicate(0); write Replicate() (to cut a tensor dim over the mesh dim, "
     "use Shard(dim))."),
    ("not a mesh passed to spmd", lambda m, m8: spmd.spmd(lambda x: x, "mesh"), TypeError,
     "spmd: mesh='mesh' must be a DeviceMesh; make one with init_device_mesh('cpu', (8,)) and pass it as "
     "@spmd(mesh, ...)."),
    ("a jax Mesh passed to spmd", lambda m, m8: spmd.spmd(m8.jax_mesh), TypeError,
     "spmd: mesh is a jax.sharding.Mesh with axis_names=('x',) and shape (8,); wrap it as DeviceMesh.from_jax(mesh), "
     "or make one with init_device_mesh('cpu', (8,))."),
    ("spmd of a non-function", lambda m, m8: spmd.spmd(m8)(3), TypeError,
     "spmd: f=3 is not callable; decorate a function."),
    ("mesh given twice", lambda m, m8: spmd.spmd(m8, m8), TypeError,
     "spmd: the mesh was given twice; write spmd(mesh, ...) or spmd(f, mesh=mesh, ...)."),
    ("too many devices", lambda m, m8: spmd.init_device_mesh("cpu", (4, 4)), ValueError,
     "init_device_mesh: mesh_shape=(4, 4) needs 16 devices but only 8 cpu device(s) exist; use a smaller mesh; "
     "for more CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=16 before JAX is imported."),
    ("duplicate mesh names", lambda m, m8: spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "a")),
     ValueError, "init_device_mesh: mesh_dim_names=('a', 'a') repeats ['a']; names must be distinct."),
    ("device type not present", lambda m, m8: spmd.init_device_mesh("cuda", (2,)), ValueError,
     # The platforms JAX sees (and so the suggested device_type) are the host's, not the project's.
     ("init_device_mesh: device_type='cuda' has no devices on this machine (JAX sees platform(s) ",
      "); use device_type=")),
    ("unknown sub-mesh name", lambda m, m8: m["pp"], ValueError,
     "DeviceMesh.__getitem__: mesh_dim_names='pp' names 'pp', which is not a mesh dim; the mesh has dims "
     "('dp', 'tp'): use one of them, or a tuple of them."),
    ("unknown group name for get_group", lambda m, m8: m.get_group("pp"), ValueError,
     "DeviceMesh.get_group: mesh_dim='pp' names 'pp', which is not a mesh dim"),
    # Raw tracebacks before (issue 10.12): NumPy's "inhomogeneous shape", Python's "unhashable type: 'list'",
    # JAX's "not a valid JAX array type", XLA's "UNIMPLEMENTED: Unsupported reduction computation".
    ("collective input a str array", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(STR, group="tp") * 0 + x),
     TypeError, ("all_reduce: x=", " is not a numeric array; pass a NumPy or JAX array")),  # (x in NumPy's repr)
    ("collective input None", lambda m, m8: _in_region(m, lambda x: spmd.broadcast(None, 0, group="tp")), TypeError,
     "broadcast: x=None is not a numeric array"),
    ("all_gather tiled not a bool", lambda m, m8: _in_region(m, lambda x: spmd.all_gather(x, tiled="yes", group="tp")),
     TypeError, "all_gather: tiled='yes' must be a bool: True concatenates the ranks' blocks along axis, False stacks "
                "them on a new axis."),
    ("a jax Mesh passed to distribute_tensor", lambda m, m8: spmd.distribute_tensor(INT, m8.jax_mesh, [S0]), TypeError,
     "distribute_tensor: device_mesh is a jax.sharding.Mesh with axis_names=('x',) and shape (8,); wrap it as "
     "DeviceMesh.from_jax(mesh)."),
    ("a result that is not an array", lambda m, m8: spmd.spmd(lambda x: "s", m8, in_placements=S0)(jnp.ones(8)),
     TypeError, "spmd: the result's leaf 0='s' is not a numeric array"),
    ("check_vma not a bool", lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=S0, check_vma="no"), TypeError,
     "spmd: check_vma='no' must be a bool (True: JAX checks replication)."),
    ("run_check not a bool", lambda m, m8: spmd.DTensor.from_local([INT[:1]] * 8, m8, [S0], run_check="no"),
     TypeError, "DTensor.from_local: run_check='no' must be a bool."),
    ("collectives of a non-function", lambda m, m8: spmd.collectives("f", 1), TypeError,
     "collectives: fn='f' is not callable; pass the function, then its arguments."),
    ("ragged device mesh", lambda m, m8: spmd.DeviceMesh("cpu", [[0, 1], [2]]), ValueError,
     "DeviceMesh: mesh=[[0, 1], [2]] is ragged (its rows have different lengths); give a rectangular nested list "
     "of device indices such as [[0, 1], [2, 3]]."),
    ("eager src a list", lambda m, m8: m.get_group("tp").broadcast(jnp.ones((2, 4, 3)), src=[0]), TypeError,
     "ProcessGroup.broadcast: src=[0] must be an int rank in the group ('tp',), e.g. src=0."),
    ("eager op a list", lambda m, m8: m.get_group("tp").allreduce(jnp.ones((2, 4, 3)), op=["max"]), TypeError,
     "ProcessGroup.allreduce: op=['max'] is not a reduce op; pass a ReduceOp (e.g. ReduceOp.SUM) or its name"),
    ("eager axis a float", lambda m, m8: m.get_group("tp").reduce_scatter(jnp.ones((2, 4, 8)), scatter_dim=0.0),
     TypeError, "ProcessGroup.reduce_scatter: scatter_dim=0.0 must be an int."),
    ("eager string array", lambda m, m8: m.get_group("tp").allreduce(STR.reshape(2, 4, 1)), TypeError,
     ("ProcessGroup.allreduce: t=", " is not a numeric array")),
    ("string array distributed", lambda m, m8: spmd.distribute_tensor(STR, m8, [S0]), TypeError,
     ("distribute_tensor: x=", " is not a numeric array")),
    ("string arrays as locals", lambda m, m8: spmd.DTensor.from_local(list(STR), m8, [S0]), TypeError,
     ("DTensor.from_local: locals[0]=", " is not a numeric array")),
    ("complex all_reduce max", lambda m, m8: _in_region(m, lambda x: spmd.all_reduce(x, "max", group="tp"),
                                                        jnp.ones((8, 8), jnp.complex64)), TypeError,
     "all_reduce: op=ReduceOp.MAX is refused on an input of dtype complex64: complex numbers have no order (torch "
     "refuses it too); reduce the real part or abs(x), or use SUM, AVG or PRODUCT."),
    ("complex reduce_scatter min", lambda m, m8: _in_region(m, lambda x: spmd.reduce_scatter(x, "min", group="tp"),
                                                            jnp.ones((8, 8), jnp.complex64)), TypeError,
     "reduce_scatter: op=ReduceOp.MIN is refused on an input of dtype complex64"),
    ("eager complex max", lambda m, m8: m.get_group("dp").allreduce(np.ones((2, 4, 2), np.complex64), "max"),
     TypeError, "all_reduce: op=ReduceOp.MAX is refused on an input of dtype complex64"),
    ("complex Partial max", lambda m, m8: spmd.DTensor.from_local([CPLX] * 8, m8, [Partial("max")]), TypeError,
     "DTensor.from_local: placements[0]=P(max) on a complex64 tensor is refused: complex numbers have no order "
     "(torch refuses MAX/MIN on complex too); use Partial('sum'), or reduce abs() or the real part."),
    ("complex Partial min distributed", lambda m, m8: spmd.distribute_tensor(CPLX, m8, [Partial("min")]), TypeError,
     "distribute_tensor: placements[0]=P(min) on a complex64 tensor is refused"),
    # issue 21.8: the last unclear messages
    ("@spmd given a string", lambda m, m8: spmd.spmd(lambda x: x, m8, in_placements=[S0], out_placements=[S0])("abc"),
     TypeError, "spmd: argument[0]='abc' (a str) is not an array; every argument of an @spmd function must be an "
     "array, a DTensor or a pytree of them. Pass a setting through a closure or functools.partial instead, or "
     "convert the value (np.asarray)."),
    ("@spmd given a string in a pytree",
     lambda m, m8: spmd.spmd(lambda x, c: x, m8, in_placements=([S0], None))(jnp.ones(8), {"mode": "fast"}),
     TypeError, "spmd: argument[1]['mode']='fast' (a str) is not an array;"),
    ("PREMUL_SUM of nan", lambda m, m8: ReduceOp.PREMUL_SUM(float("nan")), ValueError,
     "ReduceOp.PREMUL_SUM: factor=nan is not a finite number; the factor multiplies every rank's input, so pass a "
     "finite one, e.g. ReduceOp.PREMUL_SUM(0.5)."),
    ("PREMUL_SUM of -inf", lambda m, m8: ReduceOp.PREMUL_SUM(float("-inf")), ValueError,
     "ReduceOp.PREMUL_SUM: factor=-inf is not a finite number;"),
    ("ReduceOp built with a nan factor", lambda m, m8: ReduceOp("premul_sum", float("nan")), ValueError,
     "ReduceOp: factor=nan is not a finite number; write ReduceOp.PREMUL_SUM(f) with a finite f"),
    ("from_local replicas of two shapes",
     lambda m, m8: spmd.DTensor.from_local([np.ones(4)] * 7 + [np.ones(5)], m8, [R]), ValueError,
     "DTensor.from_local: locals[7] has shape (5,) but placements R of a global shape (4,) give rank 7 the shape "
     "(4,); dim 0 is not sharded by R, so every rank holds all of it: give every rank's local tensor the same size "
     "there (locals[0] has shape (4,))."),
    ("from_local unsharded dim of another size",
     lambda m, m8: spmd.DTensor.from_local([np.ones((2, 3))] * 3 + [np.ones((2, 4))] * 5, m, [S0, R]), ValueError,
     "DTensor.from_local: locals[3] has shape (2, 4) but placements S(0)R of a global shape (4, 3) give rank 3 the "
     "shape (2, 3); dim 1 is not sharded by S(0)R, so every rank holds all of it"),
]


@pytest.mark.parametrize("call, exc, msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(m24, m8, call, exc, msg):
    with pytest.raises(exc, match=owned(msg)):
        call(m24, m8)


def test_from_local_uneven_shard_still_advises_shape():
    # a sharded dim of another size is uneven shards: there shape= is the fix
    with pytest.raises(ValueError, match=owned("give rank 7 the shape (3,); give shape= (the global shape) for "
                                               "uneven shards; assuming even shards it is (24,).")):
        spmd.DTensor.from_local([np.ones(3)] * 7 + [np.ones(1)], spmd.init_device_mesh("cpu", (8,)), [S0])


class _Service:
    """A stand-in for JAX's coordination client: every read fails at once (the service went away)."""

    def key_value_set(self, key, value):
        pass

    def key_value_delete(self, key):
        pass

    def blocking_key_value_get(self, key, timeout_ms):
        raise RuntimeError("UNAVAILABLE: recvmsg:Connection reset by peer\nmore GRPC detail")


@pytest.mark.parametrize("timed_out", [False, True])
def test_signature_check_reports_the_real_wait(monkeypatch, timed_out):
    """Issue 21.8: a rank whose check of the group's first call fails because the service is gone (rank 0 ended)
    must not say it waited its whole timeout; one whose read did time out says that."""
    import time
    import types

    from spmd.distributed import _guard
    from spmd.distributed._errors import PeerError

    monkeypatch.setattr(_guard, "_client", lambda: _Service())
    now = time.monotonic()
    start = now - 20.0 if timed_out else now
    call = _guard.Call("all_reduce", (0, 1), 0, (("op", "max"),), (4,), "float32", 2, start, start + 20.0)
    with pytest.raises(PeerError) as e:
        _guard._check_across_ranks(types.SimpleNamespace(rank=1), call)
    if timed_out:
        assert str(e.value).startswith("all_reduce: rank 1 waited 20 s (the timeout) for ranks [0] to reach "
                                       "all_reduce (call #0 of Group(WORLD)); they did not arrive.")
    else:
        assert re.match(re.escape("all_reduce: rank 1 stopped waiting after ") + r"\d+\.\d s" + re.escape(
            " (of its 20 s timeout) for ranks [0] to reach all_reduce (call #0 of Group(WORLD)): the coordination "
            "service stopped answering (UNAVAILABLE: recvmsg:Connection reset by peer). Rank 0 hosts it: rank 0 "
            "most likely ended first (see its output for why)."), str(e.value)), str(e.value)
        assert "(the timeout)" not in str(e.value)
