"""The parameter placement plan (spmd.parallel): rules, defaults, uneven chunks, table, communication."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from models import MLP, Transformer
from spmd import Replicate, Shard
from spmd.parallel import Rule, hlo_executed_collectives, plan_params, replicate, shard_rule

TRANSFORMER_UNITS = (r"block_\d+",)  # plan_params' units are path regexes
MLP_UNITS = (r"hidden_\d+", "out")


@pytest.fixture(scope="module")
def fsdp8():
    return spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))


@pytest.fixture(scope="module")
def hsdp():
    return spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))


def _abstract(model, seq):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, seq), jnp.int32))["params"])


TOY = {"block_0": {"w": jax.ShapeDtypeStruct((10, 4), jnp.float32)},
       "block_1": {"w": jax.ShapeDtypeStruct((10, 4), jnp.float32)},
       "head": jax.ShapeDtypeStruct((3,), jnp.float32),
       "scale": jax.ShapeDtypeStruct((), jnp.float32)}


def test_default_is_fully_shard_with_torch_chunks(fsdp8):
    params = _abstract(Transformer(vocab_size=11, max_len=9, num_layers=2, d_model=20, num_heads=2), 9)
    plan = plan_params(params, fsdp8, units=TRANSFORMER_UNITS)
    leaves = jax.tree_util.tree_leaves(params)
    assert len(plan.entries) == len(leaves)
    for e, x in zip(plan.entries, leaves):
        assert e.placements == (Shard(0),)
        assert e.shape == x.shape
        assert e.local_shape == (math.ceil(x.shape[0] / 8),) + x.shape[1:]  # torch.chunk: the first chunk is largest
        assert e.rule == "default"
    assert plan.units == ("block_0", "block_1", "root")
    assert plan.entry("pos").unit == "root" and plan.entry("block_1/fc/kernel").unit == "block_1"
    assert plan.total_bytes == sum(int(np.prod(x.shape)) * 4 for x in leaves)
    assert plan.bytes_per_device == sum(math.ceil(x.shape[0] / 8) * int(np.prod(x.shape[1:])) * 4 for x in leaves)
    # Uneven: d_model=20 over 8 gives chunks of 3 (3,3,3,3,3,3,2,0); the padding is at most one chunk row per leaf.
    assert plan.bytes_per_device >= plan.total_bytes / 8
    assert plan.entry("block_0/fc/kernel").local_shape == (3, 80)
    assert plan.padded_shape(plan.entry("block_0/fc/kernel")) == (24, 80)


def test_hsdp_replicates_on_dp(hsdp):
    plan = plan_params(TOY, hsdp)
    assert plan.entry("block_0/w").placements == (Replicate(), Shard(0))
    assert plan.entry("block_0/w").local_shape == (3, 4)
    assert plan.entry("scale").placements == (Replicate(), Replicate())  # 0-d: nothing to cut
    assert plan.units == ("root",)  # no units given: one unit, gathered at once


def test_rules_first_match_wins_and_compose_with_the_default(hsdp):
    rules = [replicate(r".*/w"), shard_rule(r"block_\d+/w", dim=1), Rule("head", {"dp": Replicate()})]
    plan = plan_params(TOY, hsdp, rules[:1] + [Rule("head", {"dp": Replicate()})], units=(r"block_\d+",))
    assert plan.entry("block_0/w").placements == (Replicate(), Replicate())
    assert plan.entry("block_0/w").rule == "replicate('.*/w')"
    # head's rule names dp only: fsdp keeps the default Shard(0).
    assert plan.entry("head").placements == (Replicate(), Shard(0))
    assert plan.entry("head").local_shape == (1,)
    plan2 = plan_params(TOY, hsdp, [rules[1], rules[0]])
    assert plan2.entry("block_1/w").placements == (Replicate(), Shard(1))
    assert plan2.entry("block_1/w").local_shape == (10, 1)


def test_communication_table_by_hand(hsdp, fsdp8):
    mesh4 = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    plan = plan_params(TOY, mesh4, units=(r"block_\d+",))
    # block: 4 ranks x (3, 4) f32 = 192 B gathered; root: head 4 x 1 x 4 = 16 B, scale replicated (4 B).
    assert plan.gathered_bytes("block_0") == 192 and plan.gathered_bytes("root") == 16
    comm = plan.communication()["total"]
    assert comm["all-gather"] == {"count": 5, "bytes": 2 * 2 * 192 + 16}  # blocks twice (regather), root once
    assert comm["reduce-scatter"] == {"count": 3, "bytes": 2 * 192 + 16}
    assert comm["all-reduce"] == {"count": 1, "bytes": 4}  # the replicated scalar's gradient
    keep = plan.communication(regather=False)["total"]
    assert keep["all-gather"] == {"count": 3, "bytes": 2 * 192 + 16}
    assert plan.communication(accum_steps=4)["total"] == keep
    held = plan_params(TOY, mesh4, units=(r"block_\d+",), keep=(".*",))  # a model that holds every unit
    assert held.communication()["total"] == keep and held.peak_gathered_bytes() == 16 + 2 * 192
    assert plan.peak_gathered_bytes() == 16 + 192 and plan.peak_gathered_bytes(regather=False) == 16 + 2 * 192
    hs = plan_params(TOY, hsdp, units=(r"block_\d+",)).communication()["total"]
    assert hs["all-reduce"] == {"count": 2, "bytes": (2 * 48 + 4) + 4}  # shard bytes over dp, the scalar over both


def test_gather_buffers_matrices_alone_vectors_together(fsdp8):
    f32, bf16 = jnp.float32, jnp.bfloat16
    unit = {"a": jax.ShapeDtypeStruct((16, 4), f32), "b": jax.ShapeDtypeStruct((8,), f32),
            "c": jax.ShapeDtypeStruct((9,), bf16), "d": jax.ShapeDtypeStruct((3, 2, 2), f32),
            "e": jax.ShapeDtypeStruct((5,), f32), "f": jax.ShapeDtypeStruct((4,), f32)}
    plan = plan_params(unit, fsdp8, [replicate("f")])
    bufs = plan.gather_buffers(plan.unit_entries("root"))
    # In first-seen order: each array of 2+ dims alone, the sharded vectors one flat buffer per dtype;
    # the replicated vector travels in none.
    assert [[e.path for e in b] for b in bufs] == [["a"], ["b", "e"], ["c"], ["d"]]
    comm = plan.communication()["total"]  # the root is held: gathered once
    # gathered bytes: a 16 x 4 x 4, b + e 8 x (1 + 1) x 4, c 8 x 2 x 2 (bf16, chunks of 2), d 8 x 2 x 2 x 4
    nbytes = 256 + 64 + 32 + 128
    assert comm["all-gather"] == comm["reduce-scatter"] == {"count": 4, "bytes": nbytes}
    regather = plan_params(unit, fsdp8, [replicate("f")], keep=()).communication()["total"]
    assert regather["all-gather"] == {"count": 8, "bytes": 2 * nbytes}
    assert plan_params(unit, {"dp": 8}).gather_buffers(plan.entries) == ()  # no fsdp dim: nothing gathered


def test_table_lists_every_parameter_and_totals(fsdp8):
    params = _abstract(MLP(7, 5, (10, 6)), 5)
    plan = plan_params(params, fsdp8, [replicate(r"out/bias")], units=MLP_UNITS)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "ParamPlan on mesh (fsdp=8), fsdp dim 'fsdp'"
    row = next(line for line in lines if line.startswith("hidden_0/kernel"))
    assert re.split(r"\s{2,}", row) == ["hidden_0/kernel", "(35, 10)", "S(0)", "(5, 10)", "200", "hidden_0", "default"]
    row = next(line for line in lines if line.startswith("out/bias"))
    assert re.split(r"\s{2,}", row)[2:5] == ["R", "(35,)", "140"]
    total = next(line for line in lines if line.startswith("total"))
    assert f"{plan.bytes_per_device:,}" in total and f"of {plan.total_bytes:,} (fsdp=8)" in total
    # hidden_1: kernel (10, 6) in chunks of 2 rows over 8 = 16 x 6 x 4 B, bias (6,) in chunks of 1 = 8 x 4 B;
    # regathered for the backward pass (the plan's default keep is the root only).
    assert "  hidden_1: 416 B gathered in 2 buffers: all-gather x4, reduce-scatter x2" in lines


def test_bad_rules_and_params_are_clear_errors(fsdp8, hsdp):
    with pytest.raises(ValueError, match=re.escape("plan_params: rules[0] ('nothing/.*' -> fsdp=R) matches no parameter")):
        plan_params(TOY, fsdp8, [Rule("nothing/.*", {"fsdp": Replicate()})])
    with pytest.raises(ValueError, match=re.escape("places mesh dim 'tp', which the mesh {'fsdp': 8} lacks")):
        plan_params(TOY, fsdp8, [Rule("head", {"tp": Shard(0)})])
    with pytest.raises(ValueError, match=re.escape("puts Shard(dim=2) on mesh dim 'fsdp' for parameter 'block_0/w' of shape (10, 4)")):
        plan_params(TOY, fsdp8, [shard_rule(r"block_0/w", dim=2)])
    with pytest.raises(ValueError, match=re.escape("Rule('w'): placements['fsdp']=Partial(reduce_op='sum'); a parameter is one value")):
        Rule("w", {"fsdp": spmd.Partial()})
    with pytest.raises(ValueError, match=re.escape("Rule: pattern='(' is not a valid regular expression")):
        Rule("(", {})
    with pytest.raises(TypeError, match=re.escape("plan_params: rules[0]='head' must be a spmd.parallel.Rule")):
        plan_params(TOY, fsdp8, ["head"])
    assert plan_params(TOY, {"dp": 2, "fsdp": 4}) == plan_params(TOY, hsdp)  # a mesh by its dims (a saved run's)
    with pytest.raises(TypeError, match=re.escape("plan_params: mesh=(8,) must be a spmd.DeviceMesh")):
        plan_params(TOY, (8,))
    plan = plan_params(TOY, fsdp8)
    other = dict(TOY, head=jax.ShapeDtypeStruct((5,), jnp.float32))
    with pytest.raises(ValueError, match=re.escape("check: the parameters do not match the plan (first differences, path and shape: [('head', (3,)), ('head', (5,))])")):
        plan.check_params(other, "check")


def test_executed_collectives_scale_loop_bodies_by_trip_count():
    mesh = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))

    def body(c, _):
        return spmd.all_reduce(c, group="x") * 0.5, None

    f = spmd.spmd(lambda x: jax.lax.scan(body, spmd.all_reduce(x, group="x"), None, length=5)[0], mesh,
                  in_placements=[Shard(0)], out_placements=[Replicate()])
    x = jnp.arange(8.0)
    text = jax.jit(f).lower(x).compile().as_text()
    static, executed = spmd.collectives(f, x)["all-reduce"], hlo_executed_collectives(text)["all-reduce"]
    assert static["count"] == 2
    assert executed == {"count": 6, "bytes": 6 * 2 * 4, "buffers": 6}
    np.testing.assert_allclose(f(x), np.asarray(x).reshape(4, 2).sum(0) * 4 ** 5 * 0.5 ** 5)
