"""placements/: placement types, ReduceOp, and the layout math (pure Python)."""

import itertools
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placements as pl
from placements import (
    Partial,
    ReduceOp,
    Replicate,
    Shard,
    as_reduce_op,
    check_placements,
    chunk_size,
    coord_to_rank,
    format_placements,
    local_shape,
    local_shape_and_offset,
    local_shapes,
    padded_local_shape,
    rank_to_coord,
    shard_size_and_offset,
    shard_sizes,
)


# --- layout math: one dim ----------------------------------------------------------------
def _chunk_ref(n: int, k: int) -> list[range]:
    """torch.chunk semantics, written independently: pieces of ceil(n/k), the tail short or empty."""
    c = -(-n // k)
    return [range(n)[i * c : (i + 1) * c] for i in range(k)]


@pytest.mark.parametrize("k", range(1, 9))
def test_shard_sizes_exhaustive(k):
    for n in range(41):
        sizes = shard_sizes(n, k)
        ref = _chunk_ref(n, k)
        assert len(sizes) == k
        assert sum(sizes) == n
        assert sizes == tuple(len(r) for r in ref), (n, k)
        assert chunk_size(n, k) == math.ceil(n / k)
        # Non-increasing: torch.chunk puts the largest chunks first.
        assert all(a >= b for a, b in zip(sizes, sizes[1:]))
        # Offsets contiguous and match the reference's starts.
        expect_off = 0
        for i in range(k):
            size, off = shard_size_and_offset(n, k, i)
            assert size == sizes[i]
            assert off == expect_off
            if size:
                assert off == ref[i].start
            expect_off += size
        assert expect_off == n


@pytest.mark.parametrize("n, k, sizes", [
    (5, 4, (2, 2, 1, 0)),
    (10, 4, (3, 3, 3, 1)),
    (8, 4, (2, 2, 2, 2)),
    (0, 3, (0, 0, 0)),
    (1, 4, (1, 0, 0, 0)),
    (7, 1, (7,)),
    (6, 4, (2, 2, 2, 0)),
])
def test_shard_sizes_examples(n, k, sizes):
    assert shard_sizes(n, k) == sizes


def test_shard_sizes_match_torch_chunk():
    torch = pytest.importorskip("torch")
    for n in range(41):
        for k in range(1, 9):
            got = [len(c) for c in torch.chunk(torch.arange(n), k)] if n else []
            got += [0] * (k - len(got))
            assert shard_sizes(n, k) == tuple(got), (n, k)


@pytest.mark.parametrize("call, msg", [
    (lambda: chunk_size(-1, 2), "dim size n=-1 must be >= 0."),
    (lambda: chunk_size(4, 0), "number of ranks k=0 must be >= 1."),
    (lambda: shard_size_and_offset(4, 2, 2), "rank i=2 is out of range for k=2 ranks; use 0 <= i < 2."),
    (lambda: shard_size_and_offset(4, 2, -1), "rank i=-1 is out of range for k=2 ranks; use 0 <= i < 2."),
    (lambda: rank_to_coord(8, (2, 4)), "rank=8 is out of range for a mesh of 8 ranks."),
])
def test_layout_errors(call, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        call()


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (4, 2), (2, 2, 2), (3, 1, 2)])
def test_rank_coord_round_trip(mesh_shape):
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))  # row-major order
    for r, c in enumerate(coords):
        assert rank_to_coord(r, mesh_shape) == c
        assert coord_to_rank(c, mesh_shape) == r
    assert rank_to_coord(5, (2, 4)) == (1, 1)  # (r // b, r % b)


# --- layout math: placement lists, nested mesh dims --------------------------------------
def _block_ref(global_shape, mesh_shape, placements, coord):
    """Index ranges of the block at ``coord``: cut left to right with torch.chunk semantics."""
    ranges = [range(n) for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            r = ranges[p.dim]
            c = -(-len(r) // mesh_shape[mesh_dim])
            i = coord[mesh_dim]
            ranges[p.dim] = r[i * c : (i + 1) * c]
    return ranges


_P = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2)]


def _cases(mesh_shape, tensor_shapes):
    for global_shape in tensor_shapes:
        nd = len(global_shape)
        ps = [p for p in _P if not (isinstance(p, Shard) and p.dim >= nd)]
        for plist in itertools.product(ps, repeat=len(mesh_shape)):
            yield global_shape, plist


_MESH_CASES = [
    ((2, 4), [(5,), (8, 3), (10, 7), (3, 1), (0, 4), (1, 9)]),
    ((4, 2), [(5,), (9, 6), (2, 2)]),
    ((3, 3), [(7, 4), (4,)]),
    ((2, 2, 2), [(5, 3, 2), (8,), (1, 2, 3)]),
    ((2, 3, 2), [(11, 5), (3, 3, 3)]),
]


@pytest.mark.parametrize("mesh_shape, tensor_shapes", _MESH_CASES, ids=str)
def test_nested_layout_tiles_the_tensor(mesh_shape, tensor_shapes):
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    for global_shape, plist in _cases(mesh_shape, tensor_shapes):
        count = np.zeros(global_shape, dtype=np.int64)
        shapes = local_shapes(global_shape, mesh_shape, plist)
        assert len(shapes) == len(coords)
        padded = padded_local_shape(global_shape, mesh_shape, plist)
        for r, coord in enumerate(coords):
            shape, offset = local_shape_and_offset(global_shape, mesh_shape, plist, coord)
            ref = _block_ref(global_shape, mesh_shape, plist, coord)
            assert shape == tuple(len(x) for x in ref), (global_shape, plist, coord)
            assert shapes[r] == shape
            assert local_shape(global_shape, mesh_shape, plist, coord) == shape
            for d, x in enumerate(ref):
                assert offset[d] == (x.start if len(x) else global_shape[d])
            count[np.ix_(*[np.asarray(x, dtype=np.int64) for x in ref])] += 1
            assert all(s <= m for s, m in zip(shape, padded))
        # Every element is held by exactly the ranks of the non-Shard mesh dims.
        copies = math.prod(s for s, p in zip(mesh_shape, plist) if not isinstance(p, Shard))
        assert (count == copies).all(), (global_shape, plist)
        # The padded shape is the largest block, which rank 0 holds.
        assert padded == tuple(max(s[d] for s in shapes) for d in range(len(global_shape)))
        assert padded == shapes[0]


def test_nested_layout_examples():
    # torch's docstring example: a (2, 5) tensor on a (2, 2) mesh with (Shard(1), Shard(1)).
    got = [local_shape_and_offset((2, 5), (2, 2), (Shard(1), Shard(1)), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert got == [((2, 2), (0, 0)), ((2, 1), (0, 2)), ((2, 1), (0, 3)), ((2, 1), (0, 4))]
    # 10 rows over (2, 4) both on dim 0: 5 per dp rank, then 2, 2, 1, 0 per tp rank.
    assert [s[0] for s in local_shapes((10,), (2, 4), (Shard(0), Shard(0)))] == [2, 2, 1, 0, 2, 2, 1, 0]
    # 3-D: (Shard(0), Shard(1), Shard(0)) on (2, 2, 2) of a (5, 3) tensor.
    shapes = local_shapes((5, 3), (2, 2, 2), (Shard(0), Shard(1), Shard(0)))
    assert shapes == ((2, 2), (1, 2), (2, 1), (1, 1), (1, 2), (1, 2), (1, 1), (1, 1))
    assert padded_local_shape((5, 3), (2, 2, 2), (Shard(0), Shard(1), Shard(0))) == (2, 2)


def test_cross_check_torch_compute_local_shape_and_global_offset():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_fn

    def to_torch(p):
        if isinstance(p, Shard):
            return TShard(p.dim)
        return TReplicate() if isinstance(p, Replicate) else TPartial()

    cases = list(_MESH_CASES) + [((8,), [(n,) for n in range(0, 20)] + [(9, 3)]), ((4,), [(5,), (10,), (3, 7)])]
    for mesh_shape, tensor_shapes in cases:
        for global_shape, plist in _cases(mesh_shape, tensor_shapes):
            tpl = [to_torch(p) for p in plist]
            for coord in itertools.product(*(range(s) for s in mesh_shape)):
                ours = local_shape_and_offset(global_shape, mesh_shape, plist, coord)
                theirs = torch_fn(global_shape, mesh_shape, list(coord), tpl)
                assert ours == (tuple(theirs[0]), tuple(theirs[1])), (mesh_shape, global_shape, plist, coord)


# --- placement types ---------------------------------------------------------------------
def test_placement_repr_str():
    assert repr(Shard(0)) == "Shard(dim=0)"
    assert repr(Shard(dim=-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(reduce_op='sum')"
    assert [str(p) for p in (Shard(0), Shard(2), Replicate(), Partial(), Partial("max"), Partial("avg"))] == [
        "S(0)", "S(2)", "R", "P(sum)", "P(max)", "P(avg)"]
    assert format_placements((Shard(0), Replicate(), Partial("min"))) == "S(0)RP(min)"
    assert format_placements(()) == ""


def test_placement_eq_hash_frozen():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum") == Partial(ReduceOp.SUM) == Partial("SUM")
    assert Partial("max") != Partial("min")
    assert Shard(0) != Replicate() and Replicate() != Partial()
    assert len({Shard(0), Shard(0), Shard(1), Replicate(), Replicate(), Partial(), Partial(ReduceOp.SUM)}) == 4
    assert hash(Partial(ReduceOp.MAX)) == hash(Partial("max"))
    assert Partial(ReduceOp.PRODUCT).reduce_op == "product"
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Partial().reduce_op = "max"  # type: ignore[misc]


def test_placement_predicates():
    s, r, p = Shard(1), Replicate(), Partial("max")
    assert s.is_shard() and s.is_shard(1) and not s.is_shard(0)
    assert not s.is_replicate() and not s.is_partial()
    assert r.is_replicate() and not r.is_shard() and not r.is_partial()
    assert p.is_partial() and p.is_partial("max") and p.is_partial(ReduceOp.MAX) and not p.is_partial("sum")
    assert not p.is_shard() and not p.is_replicate()


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_partial_ops(op):
    assert Partial(op).reduce_op == op
    assert Partial(getattr(ReduceOp, op.upper())).reduce_op == op
    assert str(Partial(op)) == f"P({op})"


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: Shard("0"), TypeError, "Shard: dim must be an int, got '0'; e.g. Shard(0)."),
    (lambda: Shard(True), TypeError, "Shard: dim must be an int, got True; e.g. Shard(0)."),
    (lambda: Partial("band"), ValueError,
     "Partial: reduce_op='band' cannot be a partial placement; use one of 'sum', 'avg', 'max', 'min', 'product'."),
    (lambda: Partial(ReduceOp.PREMUL_SUM(2.0)), ValueError, "cannot be a partial placement"),
    (lambda: Partial("mean"), ValueError, "Partial: reduce_op='mean' is not a reduce op; use one of"),
    (lambda: Partial(3), TypeError, "Partial: reduce_op=3 is not a reduce op; pass a ReduceOp"),
])
def test_placement_errors(call, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        call()


def test_check_placements():
    assert check_placements(Shard(0), mesh_ndim=1, tensor_ndim=2, where="x") == (Shard(0),)
    assert check_placements([Shard(-1), Replicate()], mesh_ndim=2, tensor_ndim=3, where="x") == (Shard(2), Replicate())
    assert check_placements((Partial(), Shard(5)), mesh_ndim=2, tensor_ndim=None, where="x") == (Partial(), Shard(5))


@pytest.mark.parametrize("args, exc, msg", [
    (([Shard(0)], 2, 1), ValueError, "f: placements=S(0) has 1 placement(s) but the mesh has 2 dim(s); "
                                     "give exactly one placement per mesh dim."),
    (([Shard(2), Replicate()], 2, 2), ValueError,
     "f: placements[0]=Shard(dim=2) is out of range for a tensor of rank 2; use a dim in [-2, 1]."),
    (([Shard(-3)], 1, 2), ValueError,
     "f: placements[0]=Shard(dim=-3) is out of range for a tensor of rank 2; use a dim in [-2, 1]."),
    (([Shard(0)], 1, 0), ValueError, "a 0-d tensor cannot be sharded; use Replicate()."),
    (("S(0)", 1, 1), TypeError, "f: placements='S(0)' is not a placement list; pass a list of 1 placement(s) "
                                "such as [Shard(0)]."),
    (("S(0)", 2, 1), TypeError, "f: placements='S(0)' is not a placement list; pass a list of 2 placement(s) "
                                "such as [Shard(0)] + [Replicate()] * 1."),
    ((["R"], 1, 1), TypeError, "f: placements[0]='R' is not a placement; use Shard(dim), Replicate() or Partial(op)."),
])
def test_check_placements_errors(args, exc, msg):
    placements, mesh_ndim, tensor_ndim = args
    with pytest.raises(exc, match=re.escape(msg)):
        check_placements(placements, mesh_ndim=mesh_ndim, tensor_ndim=tensor_ndim, where="f: placements")


# --- ReduceOp ----------------------------------------------------------------------------
_TORCH_NAMES = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


@pytest.mark.parametrize("name", _TORCH_NAMES)
def test_reduce_op_names(name):
    op = getattr(ReduceOp, name)
    assert op.name == name.lower()
    assert repr(op) == f"ReduceOp.{name}"
    assert str(op) == name.lower()
    assert as_reduce_op(name.lower()) == op
    assert as_reduce_op(name) == op  # case-insensitive, as strings in torch code often are
    assert as_reduce_op(op) is op
    assert op.is_bitwise == (name in ("BAND", "BOR", "BXOR"))
    assert op.factor is None
    assert hash(op) == hash(ReduceOp(name.lower()))


def test_reduce_op_names_match_torch():
    torch_dist = pytest.importorskip("torch.distributed")
    theirs = {a for a in dir(torch_dist.ReduceOp) if a.isupper()}
    ours = {a for a in dir(ReduceOp) if a.isupper()}
    assert theirs <= ours


def test_premul_sum():
    op = ReduceOp.PREMUL_SUM(0.5)
    assert op.name == "premul_sum" and op.factor == 0.5
    assert repr(op) == "ReduceOp.PREMUL_SUM(0.5)"
    assert str(op) == "premul_sum(0.5)"
    assert op == ReduceOp.PREMUL_SUM(0.5) and op != ReduceOp.PREMUL_SUM(2)
    assert ReduceOp.PREMUL_SUM(2).factor == 2.0
    assert not op.is_bitwise
    assert as_reduce_op(op) is op


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: as_reduce_op("mean"), ValueError,
     "op='mean' is not a reduce op; use one of 'sum', 'avg', 'product', 'min', 'max', 'band', 'bor', 'bxor' or a ReduceOp."),
    (lambda: as_reduce_op("premul_sum"), ValueError, "op='premul_sum' needs a factor; pass ReduceOp.PREMUL_SUM(factor)."),
    (lambda: as_reduce_op(None, where="all_reduce: op"), TypeError,
     "all_reduce: op=None is not a reduce op; pass a ReduceOp (e.g. ReduceOp.SUM) or its name as a string (e.g. 'sum')."),
    (lambda: ReduceOp.PREMUL_SUM("2"), TypeError,
     "ReduceOp.PREMUL_SUM: factor must be a Python number, got '2'; pass e.g. ReduceOp.PREMUL_SUM(0.5)."),
    (lambda: ReduceOp("mean"), ValueError, "ReduceOp: unknown op name 'mean'; use one of sum, avg"),
    (lambda: ReduceOp("sum", 2.0), ValueError, "ReduceOp: a factor goes with 'premul_sum' and only with it"),
])
def test_reduce_op_errors(call, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        call()


def test_placements_is_pure_python():
    code = "import sys, placements; bad = [m for m in ('jax', 'torch', 'numpy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names():
    """__all__ lists every public attribute of the package (a submodule is not an export), each once."""
    public = [n for n, v in vars(pl).items()
              if not n.startswith("_") and type(v).__name__ not in ("module", "_Feature")]
    assert sorted(pl.__all__) == sorted(public)


# --- property: any placement list on any mesh tiles the tensor ---------------------------
@st.composite
def _layouts(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    choices = [Replicate(), Partial()] + [Shard(d) for d in range(len(global_shape))]
    plist = tuple(draw(st.sampled_from(choices)) for _ in mesh_shape)
    return mesh_shape, global_shape, plist


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_layout_property_tiles(layout):
    mesh_shape, global_shape, plist = layout
    count = np.zeros(global_shape, dtype=np.int64)
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, plist, coord)
        count[tuple(slice(o, o + s) for o, s in zip(offset, shape))] += 1
        assert shape == tuple(len(r) for r in _block_ref(global_shape, mesh_shape, plist, coord))
    copies = math.prod(s for s, p in zip(mesh_shape, plist) if not isinstance(p, Shard))
    assert (count == copies).all()
