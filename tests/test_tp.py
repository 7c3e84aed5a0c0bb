"""Tensor / sequence parallelism on dp x fsdp x tp meshes: 1-device equivalence, HLO collectives vs the
Megatron / ZeRO table, the styles as plan entries, errors.

Each configuration compiles once (lru_cache) and trains 20 AdamW steps of a tiny transformer whose
heads (6), vocabulary (7) and MLP width do not divide every tp size (torch.chunk shards, zero padded).
AdamW eps=1e-6 for the reason given in tests/test_fsdp.py.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from _one_device import train_one_device
from models import Transformer
from models._ddp import TrainState, init_train_state
from models._fsdp import shard_train_state
from models._tp import transformer_tp_rules
from models._tp_comm import tp_communication
from models._tp_step import make_tp_train_step
from spmd import Replicate, Shard
from spmd.parallel import (ColwiseParallel, RowwiseParallel, Rule, SequenceParallel, hlo_executed_collectives,
                           parallelize_rules, plan_params, unshard_params)

STEPS, BATCH, SEQ = 20, 16, 8
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
MODEL = Transformer(vocab_size=7, max_len=SEQ, num_layers=2, d_model=12, num_heads=6, mlp_ratio=2)
# (mesh shape, dim names, sequence parallel, accum steps)
CONFIGS = [
    ((8,), ("tp",), False, 1),
    ((8,), ("tp",), True, 1),
    ((2, 4), ("dp", "tp"), False, 2),
    ((2, 4), ("dp", "tp"), True, 1),
    ((2, 4), ("fsdp", "tp"), False, 1),
    ((2, 4), ("fsdp", "tp"), True, 2),
    ((2, 2, 2), ("dp", "fsdp", "tp"), False, 1),
    ((2, 2, 2), ("dp", "fsdp", "tp"), True, 2),
]


def _id(c):
    return ",".join(f"{n}={s}" for n, s in zip(c[1], c[0])) + ("-sp" if c[2] else "") + f"-accum{c[3]}"


@functools.lru_cache(maxsize=None)
def _data():
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(STEPS):
        toks = rng.integers(0, 7, (BATCH, SEQ)).astype(np.int32)
        batches.append({"inputs": toks, "targets": np.sort(toks, axis=1)})
    return MODEL.init(jax.random.key(0), batches[0]["inputs"])["params"], batches


@functools.lru_cache(maxsize=None)
def _reference():
    params, batches = _data()

    def loss_fn(p, b):
        logp = jax.nn.log_softmax(MODEL.apply({"params": p}, b["inputs"]))
        return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], axis=-1))

    return train_one_device(params, batches, loss_fn, OPT)


@functools.lru_cache(maxsize=None)
def _run(config, regather=True):
    shape, names, sp, accum = config
    params, batches = _data()
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = plan_params(params, mesh, transformer_tp_rules(sp), units=MODEL.fsdp_units())
    step = make_tp_train_step(MODEL, OPT, mesh, plan, sequence_parallel=sp, accum_steps=accum, regather=regather)
    state = shard_train_state(init_train_state(params, OPT), plan, mesh, OPT)
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    return mesh, plan, losses, state, compiled.as_text()


def _check_matches_one_device(mesh, plan, losses, state):
    ref_losses, ref = _reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(state.params, plan, mesh)), jax.tree.leaves(ref.params), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    opt = unshard_params(state.opt_state, plan, mesh, optimizer=OPT)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_matches_one_device(config):
    mesh, plan, losses, state, _ = _run(config)
    _check_matches_one_device(mesh, plan, losses, state)


def test_keeping_the_gathers_matches_one_device_and_gathers_each_block_once():
    config = CONFIGS[6]  # dp=2,fsdp=2,tp=2: the blocks unrolled, their forward gathers kept for the backward
    mesh, plan, losses, state, text = _run(config, regather=False)
    _check_matches_one_device(mesh, plan, losses, state)
    got = hlo_executed_collectives(text)
    keep = tp_communication(plan, batch=BATCH, seq_len=SEQ, d_model=12, num_layers=2, regather=False)["total"]
    again = tp_communication(plan, batch=BATCH, seq_len=SEQ, d_model=12, num_layers=2)["total"]
    assert got["all-gather"] == keep["all-gather"] and got["reduce-scatter"] == keep["reduce-scatter"]
    # the blocks' re-gathers are gone: one all-gather per gather buffer of a block, per block
    assert again["all-gather"]["count"] - keep["all-gather"]["count"] == 2 * len(plan.gather_buffers(
        plan.unit_entries("block_0")))
    assert keep["all-gather"]["bytes"] == keep["reduce-scatter"]["bytes"]  # every buffer gathered once


def _without_scalar_all_reduces(text: str) -> str:
    """The HLO with the 0-d elements of every all-reduce's result dropped (their bytes are not counted)."""
    scalar = re.compile(r"\b[a-z]+\d+\[\](?!\w)")
    return "\n".join(scalar.sub("", line) if re.search(r"\ball-reduce(-start)?\(", line) else line
                     for line in text.splitlines())


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_collectives_equal_the_megatron_zero_table(config):
    shape, names, sp, accum = config
    mesh, plan, _, _, text = _run(config)
    got = hlo_executed_collectives(text)
    want = tp_communication(plan, batch=BATCH, seq_len=SEQ, d_model=12, num_layers=2, sequence_parallel=sp,
                            accum_steps=accum)
    assert got["all-gather"] == want["total"]["all-gather"]
    assert got["reduce-scatter"] == want["total"]["reduce-scatter"]
    assert got["all-to-all"]["count"] == got["collective-permute"]["count"] == 0
    # All-reduces: the table's bytes exactly once the scalars (loss, metrics, the global norm's per-leaf sums)
    # are left out; XLA fuses scalars into gradient all-reduces, so counts are not compared.
    tensors = hlo_executed_collectives(_without_scalar_all_reduces(text))
    assert tensors["all-reduce"]["bytes"] == want["total"]["all-reduce"]["bytes"]
    assert got["all-reduce"]["bytes"] > tensors["all-reduce"]["bytes"]  # there are scalars
    size = dict(zip(names, shape))
    b = BATCH // (size.get("dp", 1) * size.get("fsdp", 1) * accum)  # one rank's micro-batch
    a = b * SEQ * 12 * 4  # b x T x D activations, f32
    act = want["activations"]
    ce = 16 * b * SEQ  # vocab-parallel cross-entropy: max, argmax, sum-exp + target logit
    if sp:  # Megatron-SP: 4L + 2 all-gather / reduce-scatter pairs of b*T*D per micro-batch
        assert act["all-gather"] == act["reduce-scatter"] == {"count": 10 * accum, "bytes": 10 * accum * a}
        assert act["all-reduce"]["bytes"] == accum * ce
    else:  # Megatron: 2 all-reduces forward + 2 backward per block, the embedding's and the output projection's
        assert act["all-reduce"]["bytes"] == accum * (10 * a + ce)
        assert act["all-gather"]["count"] == act["reduce-scatter"]["count"] == 0


@pytest.mark.parametrize("config", [CONFIGS[4], CONFIGS[6]], ids=_id)
def test_state_bytes_per_device(config):
    mesh, plan, _, state, _ = _run(config)
    dev = mesh.jax_mesh.devices.flat[0]

    def on_dev(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)

    assert on_dev(state.params) == plan.bytes_per_device
    # from the shapes: each dim cut as torch.chunk cuts (ceil) over the mesh dims that shard it (fsdp and tp cut
    # different dims); tp-only and replicated leaves whole on the other dims
    size = dict(zip(mesh.mesh_dim_names, mesh.shape))
    want = 0
    for e in plan.entries:
        cuts = [1] * len(e.shape)
        for name, p in zip(mesh.mesh_dim_names, e.placements):
            if isinstance(p, Shard):
                cuts[p.dim] *= size[name]
        want += int(np.prod([-(-d // c) for d, c in zip(e.shape, cuts)])) * np.dtype(e.dtype).itemsize
    assert plan.bytes_per_device == want


def test_styles_are_plan_entries_mixed_with_fsdp():
    params, _ = _data()
    mesh = {"dp": 2, "fsdp": 2, "tp": 2}
    plan = plan_params(params, mesh, transformer_tp_rules(True), units=MODEL.fsdp_units())
    R, S = Replicate(), Shard
    expect = {
        "embed/embedding": (R, S(1), S(0)),  # vocab on tp, fsdp cuts the other dim
        "block_0/attn/qkv/kernel": (R, S(0), S(2)),  # heads on tp
        "block_0/attn/qkv/bias": (R, S(0), S(1)),
        "block_0/attn/proj/kernel": (R, S(1), S(0)),
        "block_0/attn/proj/bias": (R, S(0), R),
        "block_0/fc/kernel": (R, S(0), S(1)),
        "block_0/fc/bias": (R, R, S(0)),  # 1-d, cut on tp: whole on fsdp
        "block_0/fc_out/kernel": (R, S(1), S(0)),
        "block_1/ln2/scale": (R, S(0), R),
        "pos": (R, S(0), R),
    }
    for path, placements in expect.items():
        assert plan.entry(path).placements == placements, path
    assert plan.entry("block_0/attn/qkv/kernel").local_shape == (6, 3, 3, 2)
    assert plan.entry("block_1/ln2/scale").rule == r"SequenceParallel('block_\\d+/ln[12]|ln_f')"
    # Without tp rules the fsdp default is unchanged: Shard(0) everywhere.
    fs = plan_params(params, {"fsdp": 4})
    assert {e.placements for e in fs.entries} == {(S(0),)}
    rules = parallelize_rules({"a/b": ColwiseParallel(), "c": RowwiseParallel(dim=1), "n": SequenceParallel()}, "mp")
    assert [(r.pattern, r.placements) for r in rules] == [
        ("(?:a/b)/(?:kernel|bias)", (("mp", S(-1)),)),
        ("(?:c)/(?:kernel|embedding)", (("mp", S(1)),)),
        ("(?:n)/(?:scale|bias)", (("mp", R),)),
    ]


def test_uneven_heads_and_bad_layouts_are_clear_errors():
    params, batches = _data()
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    # 6 heads over tp=4: torch.chunk 2, 2, 2, 0 (the last rank's block is one zero-padded head pair).
    plan = plan_params(params, mesh, transformer_tp_rules(), units=MODEL.fsdp_units())
    assert plan.entry("block_0/attn/qkv/kernel").local_shape == (12, 3, 2, 2)
    cut_head_dim = parallelize_rules({r"block_\d+/attn/qkv": ColwiseParallel()}) + transformer_tp_rules()
    with pytest.raises(ValueError, match=re.escape(
            "make_tp_train_step: parameter 'block_0/attn/qkv/bias' of shape (3, 6, 2) is S(2) on 'tp' (tp=4), which "
            "cuts dim 2 (size 2); the tensor-parallel transformer needs it S(1): cut the heads with Shard(1)")):
        make_tp_train_step(MODEL, OPT, mesh, plan_params(params, mesh, cut_head_dim, units=MODEL.fsdp_units()))
    both = plan_params(params, {"fsdp": 2, "tp": 4}, [Rule("embed/embedding", {"fsdp": Shard(0), "tp": Shard(0)}),
                                                      *transformer_tp_rules()])
    fsdp_tp = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("fsdp", "tp"))
    with pytest.raises(ValueError, match=re.escape(
            "make_tp_train_step: parameter 'embed/embedding' of shape (7, 12) is cut on dim 0 by both 'tp' and 'fsdp'")):
        make_tp_train_step(MODEL, OPT, fsdp_tp, both)
    dp8 = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=re.escape("make_tp_train_step: the mesh ('dp',) has no tensor-parallel dim tp='tp'")):
        make_tp_train_step(MODEL, OPT, dp8, plan_params(params, dp8))
    sp = make_tp_train_step(MODEL, OPT, mesh, plan_params(params, mesh, transformer_tp_rules(True)),
                            sequence_parallel=True)
    state = shard_train_state(init_train_state(params, OPT), plan, mesh, OPT)
    short = {k: v[:, :6] for k, v in batches[0].items()}
    with pytest.raises(ValueError, match=re.escape(
            "tp_loss: sequence parallelism cuts the sequence over tp=4, but the input has 6 positions; use a "
            "sequence length that is a multiple of 4, or sequence_parallel=False.")):
        sp(state, short)
    with pytest.raises(TypeError, match=re.escape("parallelize_rules: plan['fc']='col' must be ColwiseParallel()")):
        parallelize_rules({"fc": "col"})
    with pytest.raises(TypeError, match=re.escape("ColwiseParallel: dim=1.5 must be an int")):
        ColwiseParallel(dim=1.5)
    from models import MLP
    from models._tp_step import tp_parts

    with pytest.raises(ValueError, match=re.escape(
            "models.train: a mesh with a 'tp' dim runs the transformer's tensor-parallel layout; MLP has none: use "
            "--model transformer, or a mesh without tp.")):
        tp_parts(MLP(7, 3, (10,)), OPT, mesh, jax.ShapeDtypeStruct((2, 5), jnp.int32))


def test_checkpoints_restore_across_layouts_bit_for_bit(tmp_path):
    """Saved on fsdp=2 x tp=4 (sequence parallel), restored on dp=8, 1 device and dp=2 x fsdp=2 x tp=2, saved
    there again and restored onto dp=2 x tp=4: the logical state is the same bits every time."""
    from models._checkpoint import Checkpointer
    from models._fsdp_run import layout_meta, restore_resharded

    mesh, plan, _, state, _ = _run(CONFIGS[5])
    params, _ = _data()
    units = MODEL.fsdp_units()
    abstract = jax.eval_shape(lambda: params)
    replicated = init_train_state(params, OPT)

    def logical(st, pl, m):
        if pl is None:
            return jax.device_get(st)
        return jax.device_get(TrainState(st.step, unshard_params(st.params, pl, m),
                                         unshard_params(st.opt_state, pl, m, optimizer=OPT)))

    want = logical(state, plan, mesh)

    def save(name, st, pl):
        ckpt = Checkpointer(tmp_path / name)
        ckpt.save(20, st, {"layout": layout_meta(pl)}, force=True)
        ckpt.close()
        return Checkpointer(tmp_path / name)

    def same(got):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)

    saved = save("fsdp2tp4", state, plan)
    for shape, names in [((8,), ("dp",)), ((1,), ("dp",))]:
        m = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
        st, _ = restore_resharded(saved, replicated, None, m, OPT, abstract, units)
        same(logical(st, None, m))
    m3 = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    p3 = plan_params(params, m3, transformer_tp_rules(), units=units)
    st3, _ = restore_resharded(saved, shard_train_state(replicated, p3, m3, OPT), p3, m3, OPT, abstract, units)
    assert tuple(st3.params["embed"]["embedding"].sharding.spec) == ("tp", "fsdp")  # vocab on tp, D on fsdp
    same(logical(st3, p3, m3))
    m2 = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    p2 = plan_params(params, m2, transformer_tp_rules(), units=units)
    st2, _ = restore_resharded(save("3d", st3, p3), shard_train_state(replicated, p2, m2, OPT), p2, m2, OPT,
                               abstract, units)
    same(logical(st2, p2, m2))


def test_job_on_fsdp_tp_mesh_reports_and_restores_anywhere(tmp_path):
    """models.train on fsdp=2 x tp=4 with sequence parallelism: metrics.json's memory and collectives are the
    plan's and the analytic table's; the checkpoint restores bit for bit on dp=8 and on 1 device. (2 layers:
    with one, XLA drops the 1-trip loop and merges the block's re-gather with its forward gather.)"""
    from models.train import Config, restore_state, run
    from models.train._programs import build_mesh, programs

    cfg = Config(mesh="fsdp=2,tp=4", sequence_parallel=True, steps=2, batch_size=16, layers=2, d_model=16, heads=4,
                 length=4, save_every=2, eval_size=16, out=str(tmp_path / "run"), progress=False, log_every=1)
    summary = run(cfg)
    mesh = build_mesh(cfg.mesh)
    plan = programs(cfg, mesh).plan
    state, _ = restore_state(cfg.out, mesh=mesh)
    scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
    assert summary["memory"]["state_bytes_per_device"] == 3 * plan.bytes_per_device + scalars  # params + mu + nu
    want = tp_communication(plan, batch=16, seq_len=8, d_model=16, num_layers=2, sequence_parallel=True)["total"]
    assert summary["collectives"]["all-gather"] == want["all-gather"]
    assert summary["collectives"]["reduce-scatter"] == want["reduce-scatter"]
    logical = jax.device_get(unshard_params(state.params, plan, mesh))
    for shape, names in [((8,), ("dp",)), ((1,), ("dp",))]:
        other, _ = restore_state(cfg.out, mesh=spmd.init_device_mesh("cpu", shape, mesh_dim_names=names))
        for a, b in zip(jax.tree.leaves(jax.device_get(other.params)), jax.tree.leaves(logical), strict=True):
            np.testing.assert_array_equal(a, b)
