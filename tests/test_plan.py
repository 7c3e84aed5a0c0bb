"""The redistribute planner: pure Python, no JAX. A plan is a value; the search is optimal."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from placements import LATENCY_BYTES, Partial, Replicate, Shard, plan
from placements._plan import _plan_cached, make_step, torch_greedy_steps

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def test_plan_is_an_immutable_cached_value():
    p = plan((2, 4), (16, 16), 4, (S0, S1), (R, S0))
    # The steps chain src to dst: each starts where the last ended.
    assert (p.src, p.dst) == ((S0, S1), (R, S0)) and p.steps[0].before == p.src and p.steps[-1].after == p.dst
    assert all(a.after == b.before for a, b in zip(p.steps, p.steps[1:]))
    assert p is plan((2, 4), (16, 16), 4, (S0, S1), (R, S0))
    assert hash(p) == hash(plan((2, 4), (16, 16), 4, [S0, S1], [R, S0]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.steps = ()
    assert str(p).splitlines()[0].startswith("S(0)S(1) -> RS(0)  (")
    assert re.fullmatch(r"  0\. S\(0\)S\(1\) -> .*\[mesh dim \d: .* B\]", str(p).splitlines()[1])
    assert "Plan(S(0)S(1) -> RS(0), mesh_shape=(2, 4)" in repr(p)
    c = p.cost()
    assert c.bytes == sum(s.bytes for s in p.steps) and c.collectives == len(p.collectives)
    assert _plan_cached.cache_info().hits >= 2


def test_identity_plan_is_empty():
    p = plan((8,), (4,), 4, (S0,), (S0,))
    assert p.steps == () and p.cost().bytes == 0 and p.cost().collectives == 0


@pytest.mark.parametrize(
    "src,dst,collectives,nbytes",
    [
        (R, S0, (), 0),
        (R, S1, (), 0),
        (R, Partial("sum"), (), 0),
        (R, Partial("max"), (), 0),
        (S0, R, ("all_gather",), 16 * 8 * 4),  # gathered result
        (S1, R, ("all_gather",), 16 * 8 * 4),
        (Partial("sum"), R, ("all_reduce",), 16 * 8 * 4),  # buffer
        (Partial("avg"), R, ("all_reduce",), 16 * 8 * 4),
        (Partial("max"), R, ("all_reduce",), 16 * 8 * 4),
        (Partial("product"), R, ("all_gather",), 8 * 16 * 8 * 4),  # gather + local product
        (Partial("sum"), S0, ("reduce_scatter",), 16 * 8 * 4),  # input
        (Partial("avg"), S1, ("reduce_scatter",), 16 * 8 * 4),
        (Partial("min"), S0, ("all_to_all",), 16 * 8 * 4),
        (S0, S1, ("all_to_all",), 2 * 8 * 4),  # buffer = the local block
        (S1, S0, ("all_to_all",), 16 * 1 * 4),
        (S0, Partial("sum"), (), 0),  # local: the block at its offset, zeros elsewhere
    ],
)
def test_one_dim_lowering(src, dst, collectives, nbytes):
    p = plan((8,), (16, 8), 4, (src,), (dst,))
    assert p.collectives == collectives
    assert p.cost().bytes == nbytes
    assert len(p.steps) == 1


def test_uneven_bytes_count_padding():
    # 10 rows over 8 ranks: chunks of 2, padded: the gather moves 8 * 2 rows.
    assert plan((8,), (10, 3), 4, (S0,), (R,)).cost().bytes == 8 * 2 * 3 * 4
    # 5 over 4 -> chunks 2, 2, 1, 0; reduce-scatter input padded to 4 * 2 rows.
    assert plan((4,), (5, 3), 2, (Partial("sum"),), (S0,)).cost().bytes == 4 * 2 * 3 * 2


def test_s_to_avg_partial_goes_through_replicate():
    p = plan((8,), (16,), 4, (S0,), (Partial("avg"),))
    assert [str(s.dst) for s in p.steps] == ["R", "P(avg)"]


@pytest.mark.parametrize(
    "src,dst,max_collectives,flattened",
    [
        ((S0, S1), (S0, S0), 1, False),
        ((S0, S1), (S1, S0), 2, False),
        ((S0, S0), (S1, S1), 1, True),  # one all_to_all over the flattened 8 devices
        ((Partial("sum"), Partial("sum")), (R, R), 1, True),
        ((S0, S0), (R, R), 1, True),
        ((Partial("sum"), Partial("sum")), (S0, S0), 1, True),
    ],
)
def test_two_dim_plans(src, dst, max_collectives, flattened):
    p = plan((2, 4), (16, 32), 4, src, dst)
    assert p.cost().collectives <= max_collectives
    assert any(len(s.mesh_dims) == 2 for s in p.steps) == flattened


def test_nesting_rule_is_respected():
    """No step touches a tensor dim that a later mesh dim outside its group shards."""
    for src, dst in itertools.product(itertools.product([R, S0, S1, Partial("sum")], repeat=3), repeat=2):
        for s in plan((2, 2, 2), (5, 3), 4, src, dst).steps:
            lo = s.mesh_dims[0]
            for d in {p.dim for p in (s.src, s.dst) if isinstance(p, Shard)}:
                assert not any(
                    j > lo and j not in s.mesh_dims and s.before[j] == Shard(d) for j in range(3)
                ), (src, dst, str(s))


# --- optimality ----------------------------------------------------------------------------
def key(steps):
    traffic = sum(s[3] for s in steps)
    coll = sum(1 for s in steps if s[2] is not None)
    return traffic + LATENCY_BYTES * coll


def one_dim_steps(state, mesh_shape, shape, itemsize, cands):
    for i, c in enumerate(state):
        for t in cands:
            s = make_step(mesh_shape, shape, itemsize, state, (i,), t)
            if s is None:
                continue
            if any(j > i and state[j] == Shard(d) for d in {p.dim for p in (c, t) if isinstance(p, Shard)} for j in range(len(state))):
                continue
            yield s.after, (i, c, s.collective, s.traffic)


def brute_force(mesh_shape, shape, src, dst, depth):
    cands = [R, S0, S1]
    best = None
    frontier = [(src, ())]
    for _ in range(depth):
        nxt = []
        for state, steps in frontier:
            for after, st in one_dim_steps(state, mesh_shape, shape, 4, cands):
                s2 = steps + (st,)
                if after == dst and (best is None or key(s2) < best):
                    best = key(s2)
                nxt.append((after, s2))
        frontier = nxt
    return best


@pytest.mark.parametrize("shape", [(16, 32), (10, 7)])
def test_search_beats_every_one_dim_step_sequence(shape):
    """Brute force over all sequences of up to 4 single-mesh-dim steps: the plan is never worse."""
    lists = list(itertools.product([R, S0, S1], repeat=2))
    for src, dst in itertools.product(lists, repeat=2):
        if src == dst:
            continue
        p = plan((2, 4), shape, 4, src, dst)
        got = p.cost().traffic + LATENCY_BYTES * p.cost().collectives
        bf = brute_force((2, 4), shape, src, dst, 4)
        assert bf is not None and got <= bf + 1e-9, (src, dst, str(p), bf)


@pytest.mark.parametrize(
    "mesh_shape,shape", [((2, 4), (16, 32)), ((2, 4), (10, 7)), ((2, 4), (1024, 2048)), ((2, 2, 2), (6, 5))]
)
def test_never_worse_than_torch_greedy(mesh_shape, shape):
    pls = [R] + [Shard(d) for d in range(len(shape))] + [Partial("sum")]
    lists = list(itertools.product(pls, repeat=len(mesh_shape)))
    worse = 0
    for src, dst in itertools.product(lists, repeat=2):
        if any(isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
            continue  # torch refuses redistributing to Partial
        t_traffic, t_coll = 0.0, 0
        for m, c, t, before in torch_greedy_steps(src, dst):
            s = make_step(mesh_shape, shape, 4, before, (m,), t)
            t_traffic += s.traffic
            t_coll += s.collective is not None
        p = plan(mesh_shape, shape, 4, src, dst)
        ours = p.cost().traffic + LATENCY_BYTES * p.cost().collectives
        assert ours <= t_traffic + LATENCY_BYTES * t_coll + 1e-9, (src, dst, str(p))
        worse += p.cost().traffic > t_traffic + 1e-9
    if shape == (1024, 2048):  # 8 MiB: bytes dominate the latency term, never more traffic than torch
        assert worse == 0


def test_partial_switch_and_mix_refused():
    with pytest.raises(ValueError, match=re.escape("placements[0]=P(max) would switch mesh dim 0 from P(sum) to P(max)")):
        plan((8,), (4,), 4, (Partial("sum"),), (Partial("max"),))
    with pytest.raises(ValueError, match=re.escape("mixes Partial ops ['max', 'sum']")):
        plan((2, 4), (4,), 4, (Partial("sum"), Partial("max")), (R, R))
    # sum and avg may mix (as in torch); an op may change across mesh dims through Replicate
    assert plan((2, 4), (4,), 4, (Partial("sum"), Partial("avg")), (R, R)).cost().collectives == 2
    p = plan((2, 4), (4,), 4, (Partial("sum"), R), (R, Partial("max")))
    assert [str(s.dst) for s in p.steps] == ["R", "P(max)"]


TORCH_PLANNER = '''
import itertools, json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
out = {}
for mshape, shape in [((2, 4), (10, 7)), ((2, 2, 2), (5, 3))]:
    mesh = init_device_mesh("cpu", mshape)
    meta = TensorMeta(torch.Size(shape), (shape[1], 1), torch.float32)
    pls = [Replicate(), Shard(0), Shard(1), Partial("sum")]
    for src in itertools.product(pls, repeat=len(mshape)):
        for dst in itertools.product(pls, repeat=len(mshape)):
            if any(isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
                continue
            infos = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta))
            key = "".join(map(str, src)) + "|" + "".join(map(str, dst))
            out[key] = [[i.mesh_dim, str(i.src_dst_placements[0]), str(i.src_dst_placements[1])] for i in infos]
print(json.dumps(out))
'''


def test_torch_greedy_emulation_matches_torch_planner():
    """The torch plan used for comparisons (here and in benchmarks/redistribute.py) is torch's own:
    torch 2.13's planner on a fake 8-rank process group gives the same steps."""
    pytest.importorskip("torch")
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", TORCH_PLANNER], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_plans = json.loads(proc.stdout.strip().splitlines()[-1])
    pls = [R, S0, S1, Partial("sum")]
    n = 0
    for nd in (2, 3):
        for src, dst in itertools.product(itertools.product(pls, repeat=nd), repeat=2):
            if any(isinstance(b, Partial) and a != b for a, b in zip(src, dst)):
                continue
            key = "".join(map(str, src)) + "|" + "".join(map(str, dst))
            ours = [[m, str(c), str(t)] for m, c, t, _ in torch_greedy_steps(src, dst)]
            assert ours == torch_plans[key], key
            n += 1
    assert n == len(torch_plans)


@pytest.mark.parametrize("n", [8, 64, 1021, 1024, 4096, 16384])
def test_swapping_two_shards_takes_at_most_two_collectives_at_every_size(n):
    # (S0,S1) -> (S1,S0) on a 2x4 mesh: all_gather + all_to_all, never 3 all_to_alls.
    p = plan((2, 4), (n, n), 4, (Shard(0), Shard(1)), (Shard(1), Shard(0)))
    assert p.cost().collectives <= 2


# --- the transition table -----------------------------------------------------------------------
def test_transition_table_drives_planner_lowering_and_simulator():
    """Every entry has a JAX lowering and a NumPy simulation of the same name; the planner's steps
    carry their entry's collective and lowering; pairs absent from the table are never planned."""
    from placements import TRANSITIONS, transition
    from spmd.tensor._lower import LOWERINGS
    from spmd.testing._simulate import SIMULATIONS

    names = {t.lowering for t in TRANSITIONS.values()}
    assert set(LOWERINGS) == names == set(SIMULATIONS)
    ops = ("sum", "avg", "max", "min", "product")
    assert transition(S0, Partial("avg")) is None  # S -> P(avg) goes through R
    assert all(transition(Partial(a), Partial(b)) is None for a in ops for b in ops)  # never switch a Partial op
    pls = [R, S0, S1] + [Partial(op) for op in ops]
    seen = set()
    for src, dst in itertools.product(itertools.product(pls, repeat=2), repeat=2):
        try:
            p = plan((2, 4), (10, 7), 4, src, dst)
        except ValueError:
            continue
        for s in p.steps:
            t = transition(s.src, s.dst)
            assert t is not None and s.lowering == t.lowering, str(s)
            assert s.collective == t.collective, str(s)  # every group here has more than one device
            seen.add((t.src, t.dst))
    assert seen == set(TRANSITIONS)  # every entry is used by some plan


def test_make_step_costs_one_step_as_the_planner_does():
    # 10 rows over 4 ranks: padded block 3 x 7; all_gather result 12 x 7 float32; ring traffic 3/4 of it
    s = make_step((4,), (10, 7), 4, (S0,), (0,), R)
    assert (s.collective, s.lowering, s.bytes, s.traffic) == ("all_gather", "all_gather", 12 * 7 * 4, 12 * 7 * 4 * 0.75)
    s = make_step((4,), (10, 7), 4, (Partial("sum"),), (0,), R)  # all_reduce: two ring passes
    assert (s.collective, s.bytes, s.traffic) == ("all_reduce", 10 * 7 * 4, 10 * 7 * 4 * 0.75 * 2)
    s = make_step((4,), (10, 7), 4, (Partial("product"),), (0,), R)  # gather the 4 blocks, multiply locally
    assert (s.collective, s.lowering, s.bytes) == ("all_gather", "all_reduce", 4 * 10 * 7 * 4)
    assert make_step((4,), (10, 7), 4, (S0,), (0,), Partial("avg")) is None
    assert make_step((1,), (10, 7), 4, (S0,), (0,), R).collective is None  # a group of one moves nothing
