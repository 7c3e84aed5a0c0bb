"""Output placements of DTensor ops against torch 2.13's, on a broad generated set of cases:
elementwise unary and binary ops (scalars on either side) over every placement combination
incl. each Partial op, matmul / bmm / einsum, reductions, softmax, layer norm, views and casts,
on meshes (4,), (2, 2) and (2, 4), even and uneven shapes. torch runs on a fake process group
(one process, no data: sharding propagation alone); our side traces the ops (``jax.eval_shape``).
At least 99% must agree; every case that differs is in ``DIFFERENT`` (docs/placements.md gives
each reason), and the opt-in ``placement_strategy("cheapest")`` keeps the cheaper choices.

torch's placements of every case are shipped in ``data/torch_placements.json`` (made by torch 2.13 with
``python tests/test_ops_torch_placements.py``), so the comparison runs without torch and without its 30 s
of fake-process-group work; where torch is installed, a seeded sample of the cases is rerun live and
must equal the shipped results."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import pathlib
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
import spmd.ops as ops
from placements import Partial, Replicate, Shard, format_placements
from spmd import DTensor, distribute_tensor
from _torch_ref import torch_placements

# op -> (torch expression over a, b, c; ours).
OPS = {
    # unary
    "exp": ("a.exp()", ops.exp), "tanh": ("a.tanh()", ops.tanh), "relu": ("torch.relu(a)", ops.relu),
    "abs": ("a.abs()", abs), "neg": ("-a", lambda a: -a), "sigmoid": ("a.sigmoid()", ops.sigmoid),
    "sqrt": ("a.sqrt()", ops.sqrt), "log": ("a.log()", ops.log),
    "gelu": ("torch.nn.functional.gelu(a)", lambda a: ops.gelu(a, approximate=False)),
    "scale": ("a * 2", lambda a: a * 2), "rscale": ("2 * a", lambda a: 2 * a), "shift": ("a + 1", lambda a: a + 1),
    "rshift": ("1 + a", lambda a: 1 + a), "sub1": ("a - 1", lambda a: a - 1), "rsub": ("1 - a", lambda a: 1 - a),
    "div2": ("a / 2", lambda a: a / 2), "rdiv": ("2 / a", lambda a: 2 / a), "pow2": ("a ** 2", lambda a: a ** 2),
    "gt0": ("(a > 0).to(torch.float32)", lambda a: (a > 0).astype(jnp.float32)),
    "to_half": ("a.to(torch.float16)", lambda a: a.astype(jnp.float16)),
    "to_int": ("a.to(torch.int32)", lambda a: a.astype(jnp.int32)),
    # binary
    "add": ("a + b", lambda a, b: a + b), "sub": ("a - b", lambda a, b: a - b), "mul": ("a * b", lambda a, b: a * b),
    "div": ("a / b", lambda a, b: a / b), "maximum": ("torch.maximum(a, b)", ops.maximum),
    "minimum": ("torch.minimum(a, b)", ops.minimum), "pow": ("a ** b", lambda a, b: a ** b),
    "eq": ("(a == b).to(torch.float32)", lambda a, b: (a == b).astype(jnp.float32)),
    "where": ("torch.where(a > 0, a, b)", lambda a, b: ops.where(a > 0, a, b)),
    # contractions
    "mm": ("a @ b", lambda a, b: a @ b), "bmm": ("torch.bmm(a, b)", lambda a, b: a @ b),
    "mv": ("a @ b", lambda a, b: a @ b), "vm": ("a @ b", lambda a, b: a @ b), "dot": ("a @ b", lambda a, b: a @ b),
    "mm3": ("a @ b", lambda a, b: a @ b),
    "einsum_rowdot": ("torch.einsum('ij,ij->i', a, b)", lambda a, b: ops.einsum("ij,ij->i", a, b)),
    "einsum_bmm": ("torch.einsum('bij,bjk->bik', a, b)", lambda a, b: ops.einsum("bij,bjk->bik", a, b)), "einsum": ("torch.einsum('ij,jk->ik', a, b)", lambda a, b: ops.einsum("ij,jk->ik", a, b)),
    # reductions, softmax, normalisation
    "sum0": ("a.sum(0)", lambda a: a.sum(0)), "sum1": ("a.sum(1)", lambda a: a.sum(1)), "sum": ("a.sum()", lambda a: a.sum()),
    "sum0k": ("a.sum(0, keepdim=True)", lambda a: a.sum(0, keepdims=True)),
    "mean0": ("a.mean(0)", lambda a: a.mean(0)), "mean1": ("a.mean(1)", lambda a: a.mean(1)), "mean": ("a.mean()", lambda a: a.mean()),
    "amax0": ("a.amax(0)", lambda a: a.max(0)), "amax1": ("a.amax(1)", lambda a: a.max(1)),
    "amin0": ("a.amin(0)", lambda a: a.min(0)), "amin1": ("a.amin(1)", lambda a: a.min(1)),
    "prod0": ("a.prod(0)", lambda a: a.prod(0)),
    "softmax0": ("a.softmax(0)", lambda a: ops.softmax(a, 0)), "softmax": ("a.softmax(-1)", lambda a: ops.softmax(a, -1)),
    "log_softmax": ("a.log_softmax(-1)", lambda a: ops.log_softmax(a, -1)),
    "layer_norm": ("torch.nn.functional.layer_norm(a, a.shape[-1:])", lambda a: ops.layer_norm(a, -1)),
    # views
    "t": ("a.t()", lambda a: a.T), "index": ("a[:, 1]", lambda a: a[:, 1]), "index0": ("a[1]", lambda a: a[1]),
    "none": ("a[None]", lambda a: a[None]), "flatten": ("a.reshape(-1)", lambda a: a.reshape(-1)),
    "split0": ("a.reshape(2, -1, a.shape[1])", lambda a: a.reshape(2, -1, a.shape[1])),
    "permute": ("a.permute(2, 0, 1)", lambda a: a.transpose(2, 0, 1)),
}

UNARY = ["exp", "tanh", "relu", "abs", "neg", "sigmoid", "sqrt", "log", "gelu", "scale", "rscale", "shift", "rshift",
         "sub1", "rsub", "div2", "rdiv", "pow2", "gt0", "to_half", "to_int"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "pow", "eq", "where"]
REDUCE = ["sum0", "sum1", "sum", "sum0k", "mean0", "mean1", "mean", "amax0", "amax1", "amin0", "amin1", "prod0",
          "softmax0", "softmax", "log_softmax", "layer_norm"]
ONE_D = ["R()", "S(0)", "S(1)", "P()", "P('avg')", "P('max')", "P('min')"]
TWO_D = ["R()", "S(0)", "S(1)", "P()", "P('max')"]


def _two_d(choices=TWO_D):
    return [f"[{a}, {b}]" for a, b in itertools.product(choices, repeat=2)]


def cases() -> list:
    """The generated cases ``(mesh shape, op, [(shape, placements code), ...])``, in a fixed order."""
    rng = random.Random(2130)
    one = [f"[{p}]" for p in ONE_D]
    out = []
    for op in UNARY:
        for shape in [(8, 6), (5, 3)]:
            out += [((4,), op, [(shape, p)]) for p in one]
        out += [((2, 2), op, [((8, 6), p)]) for p in _two_d()]
    for op in BINARY:
        for sa, sb in [((8, 6), (8, 6)), ((8, 6), (6,)), ((6,), (8, 6)), ((5, 3), (5, 3)), ((8, 6), (8, 1))]:
            out += [((4,), op, [(sa, p), (sb, q)]) for p, q in itertools.product(one, repeat=2)]
        pairs = list(itertools.product(_two_d(), repeat=2))
        out += [((2, 2), op, [((8, 6), p), ((8, 6), q)]) for p, q in rng.sample(pairs, 40)]
        out += [((2, 4), op, [((8, 8), p), ((8, 8), q)]) for p, q in rng.sample(pairs, 12)]
    mm1 = ["[R()]", "[S(0)]", "[S(1)]", "[P()]", "[P('avg')]"]
    for sa, sb in [((8, 6), (6, 4)), ((8, 16), (16, 4)), ((5, 6), (6, 3))]:
        out += [((4,), "mm", [(sa, p), (sb, q)]) for p, q in itertools.product(mm1, repeat=2)]
    out += [((4,), "einsum", [((8, 6), p), ((6, 4), q)]) for p, q in itertools.product(mm1, repeat=2)]
    out += [((4,), "einsum_rowdot", [((8, 6), p), ((8, 6), q)]) for p, q in itertools.product(mm1, repeat=2)]
    mm2 = list(itertools.product(_two_d(["R()", "S(0)", "S(1)", "P()"]), repeat=2))
    out += [((2, 2), "mm", [((8, 6), p), ((6, 4), q)]) for p, q in rng.sample(mm2, 60)]
    out += [((2, 4), "mm", [((8, 8), p), ((8, 8), q)]) for p, q in rng.sample(mm2, 20)]
    b1 = ["[R()]", "[S(0)]", "[S(1)]", "[S(2)]", "[P()]"]
    out += [((4,), "bmm", [((4, 6, 8), p), ((4, 8, 4), q)]) for p, q in itertools.product(b1, repeat=2)]
    out += [((4,), "einsum_bmm", [((4, 6, 8), p), ((4, 8, 4), q)]) for p, q in itertools.product(b1, repeat=2)]
    vec = ["[R()]", "[S(0)]", "[P()]", "[P('avg')]"]
    out += [((4,), "mv", [((8, 6), p), ((6,), q)]) for p, q in itertools.product(mm1, vec)]
    out += [((4,), "vm", [((8,), p), ((8, 6), q)]) for p, q in itertools.product(vec, mm1)]
    out += [((4,), "dot", [((8,), p), ((8,), q)]) for p, q in itertools.product(vec, repeat=2)]
    out += [((4,), "mm3", [((4, 8, 6), p), ((6, 4), q)]) for p, q in itertools.product(b1 + ["[P('avg')]"], mm1)]
    out += [((2, 2), "mv", [((8, 6), p), ((6,), q)]) for p, q in rng.sample(list(itertools.product(
        _two_d(["R()", "S(0)", "S(1)", "P()"]), _two_d(["R()", "S(0)", "P()"]))), 20)]
    for op in REDUCE:
        for shape in [(8, 6), (5, 3)]:
            out += [((4,), op, [(shape, p)]) for p in one]
        out += [((2, 2), op, [((8, 6), p)]) for p in _two_d()]
    for op in ["t", "index", "index0", "none", "flatten", "split0"]:
        out += [((4,), op, [((8, 8), p)]) for p in one]
        out += [((2, 2), op, [((8, 8), p)]) for p in _two_d()]
    out += [((4,), "permute", [((4, 8, 6), p)]) for p in one + ["[S(2)]"]]
    return out


CASES = cases()


def _value(shape):
    return np.arange(1, 1 + int(np.prod(shape)), dtype=np.float32).reshape(shape)


_OPERANDS: dict = {}


def _operand(mesh, shape, pl):
    """The DTensor of ``shape`` with placements ``pl`` (immutable, so built once per mesh and case)."""
    key = (id(mesh), tuple(shape), pl)
    if key not in _OPERANDS:
        _OPERANDS[key] = _new_operand(mesh, shape, pl)
    return _OPERANDS[key]


def _new_operand(mesh, shape, pl):
    if not any(isinstance(p, Partial) for p in pl):
        return distribute_tensor(_value(shape), mesh, pl)
    base = distribute_tensor(_value(shape), mesh, [Replicate() if isinstance(p, Partial) else p for p in pl])
    return DTensor.from_local(base.local_tensors(), mesh, pl, shape=shape)


def _parse(code):
    return tuple(eval(code, {"S": Shard, "R": Replicate, "P": Partial}))


def _torch(pl):
    return tuple(Shard(p[1]) if p[0] == "S" else Partial(p[1]) if p[0] == "P" else Replicate() for p in pl)


def ours(mesh, op, args, strategy=None):
    """Our output placements of one case (traced, not run), or ``("error", message)``."""
    dts = [_operand(mesh, shape, _parse(pl)) for shape, pl in args]
    fn = OPS[op][1]
    if strategy is not None:
        f0 = fn

        def fn(*a):
            with ops.placement_strategy(strategy):
                return f0(*a)
    try:
        return jax.eval_shape(fn, *dts).placements
    except (ValueError, TypeError) as e:
        return ("error", f"{type(e).__name__}: {e}")


#: Cases whose placements differ from torch 2.13's, by a key naming the case, with the reason
#: (docs/placements.md, "Where spmd still differs from torch").
DIFFERENT: dict[str, str] = {
    "mm3 (4,) (4, 8, 6):[S(1)] (6, 4):[S(0)]": "torch reshapes to (32, 6) for an mm and gathers the inner S(1) first",
    "mm3 (4,) (4, 8, 6):[S(1)] (6, 4):[S(1)]": "torch reshapes to (32, 6) for an mm and gathers the inner S(1) first",
    "mv (2, 2) (8, 6):[R(), R()] (6,):[S(0), R()]": "torch's mv decomposition takes the other of two free choices",
}
#: Our refusals where torch gathers silently (indexing or reshaping a sharded dim): the error names the fix.
REFUSALS = ("index only dims that are not sharded", "cannot become shape")


def _key(mshape, op, args):
    return f"{op} {mshape} " + " ".join(f"{tuple(s)}:{p}" for s, p in args)


def compare(torch_results, meshes) -> tuple[int, int, list, list]:
    """(agreeing, compared, differences with a reason, differences without one)."""
    agree, counted, explained, unexplained = 0, 0, [], []
    for (mshape, op, args), theirs in zip(CASES, torch_results):
        if theirs[0] == "error":
            continue  # torch refuses the case: nothing to agree with
        counted += 1
        got = ours(meshes[mshape], op, args)
        if got == _torch(theirs):
            agree += 1
            continue
        key = _key(mshape, op, args)
        shown = got[1][:160] if got[0] == "error" else format_placements(got)
        line = f"{key}: ours {shown}, torch {format_placements(_torch(theirs))}"
        refused = got[0] == "error" and op in ("index", "index0", "flatten") and any(r in got[1] for r in REFUSALS)
        (explained if refused or key in DIFFERENT else unexplained).append(line)
    return agree, counted, explained, unexplained


DATA = pathlib.Path(__file__).parent / "data" / "torch_placements.json"
LIVE_SAMPLE = 300


def _fingerprint() -> str:
    """Names the cases and torch expressions the shipped results were made from."""
    return hashlib.sha256(repr((CASES, {k: v[0] for k, v in OPS.items()})).encode()).hexdigest()[:16]


def _plain(result):
    """A torch result as the JSON file holds it (lists for tuples; an error kept as its kind only)."""
    return ["error"] if result[0] == "error" else json.loads(json.dumps(result))


def _torch_live(tmp, cases):
    return torch_placements(tmp, cases, {k: v[0] for k, v in OPS.items()})


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory):
    saved = json.loads(DATA.read_text())
    assert saved["cases"] == _fingerprint(), (
        f"{DATA.name} was made from other cases or torch expressions than this file's: regenerate it with "
        "torch 2.13 installed: python tests/test_ops_torch_placements.py")
    results = saved["results"]
    if importlib.util.find_spec("torch") is not None:
        picked = random.Random(213).sample(range(len(CASES)), LIVE_SAMPLE)
        live = _torch_live(tmp_path_factory.mktemp("torch_placements"), [CASES[i] for i in picked])
        stale = [(_key(*CASES[i]), _plain(results[i]), _plain(got)) for i, got in zip(picked, live)
                 if _plain(got) != _plain(results[i])]
        assert not stale, (f"the installed torch gives other placements than {DATA.name} (made by torch "
                           f"{saved['torch']}) in {len(stale)}/{LIVE_SAMPLE} sampled cases, e.g. {stale[:3]}: "
                           "regenerate it with python tests/test_ops_torch_placements.py")
    return results


@pytest.fixture(scope="module")
def meshes():
    return {s: spmd.init_device_mesh("cpu", s) for s in {c[0] for c in CASES}}


@pytest.mark.timeout(900)  # torch ~25 s, our side ~80 s alone; more on a loaded machine
def test_output_placements_agree_with_torch(torch_results, meshes):
    agree, counted, explained, unexplained = compare(torch_results, meshes)
    print(f"placements agreeing with torch 2.13: {agree}/{counted} ({len(CASES) - counted} cases torch refuses)")
    for line in explained + unexplained:
        print("  differs:", line)
    assert counted > 4000
    assert agree >= 0.99 * counted, f"{agree}/{counted} agree with torch"
    assert not unexplained, "\n".join(unexplained)
    assert len(explained) == len(DIFFERENT) + 30  # the listed cases and the 30 refused views, no more


SOME_CHEAPER = [  # (case, torch's placements, the cheapest strategy's)
    (((4,), "exp", [((8, 6), "[P()]")]), "R", "S(0)"),
    (((4,), "shift", [((8, 6), "[P()]")]), "R", "S(0)"),
    (((2, 2), "relu", [((8, 6), "[P(), R()]")]), "RR", "S(0)S(1)"),
    (((4,), "mm", [((8, 6), "[S(0)]"), ((6, 4), "[S(0)]")]), "S(0)", "P(sum)"),
    (((4,), "layer_norm", [((8, 8), "[S(1)]")]), "R", "S(0)"),
]


@pytest.mark.parametrize("case,want,cheap", SOME_CHEAPER, ids=[f"{c[1]}-{c[2][0][1]}" for c, _, _ in SOME_CHEAPER])
def test_cheapest_is_an_opt_in(meshes, case, want, cheap):
    """The cheaper choices are there under ``placement_strategy("cheapest")``, and only there."""
    mshape, op, args = case
    assert format_placements(ours(meshes[mshape], op, args)) == want
    assert format_placements(ours(meshes[mshape], op, args, strategy="cheapest")) == cheap
    assert format_placements(ours(meshes[mshape], op, args, strategy="torch")) == want


if __name__ == "__main__":  # regenerate data/torch_placements.json from the installed torch
    import tempfile

    import torch

    got = _torch_live(pathlib.Path(tempfile.mkdtemp()), CASES)
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({"torch": torch.__version__, "cases": _fingerprint(), "results": got},
                               separators=(",", ":")))
    print(f"wrote {DATA}: {len(got)} cases from torch {torch.__version__}", file=sys.stderr)
