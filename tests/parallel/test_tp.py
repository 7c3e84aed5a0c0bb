"""Tensor / sequence parallelism of ``models.Transformer`` on dp x fsdp x tp meshes, through the contract
(``parallelize_module`` with ``models._plans.transformer_tp_plan``, ``fully_shard``, ``make_train_step``):
1-device equivalence, HLO collectives vs the plan, the styles as plan entries, state bytes, checkpoints, errors.

Each configuration compiles once (lru_cache) and trains 20 AdamW steps of a tiny transformer. Its heads (8),
vocabulary (8) and MLP width (32) divide every tp size: ``spmd.parallel`` cuts evenly on tp (the model reads
global shapes); the fsdp cuts stay uneven (torch.chunk, zero padded). AdamW eps=1e-6 for the reason given in
tests/parallel/test_fsdp.py.
"""

import functools
import re

import jax
import numpy as np
import optax
import pytest

import spmd
from _one_device import train_one_device
from _sort_task import sort_loss, sort_task
from models import MLP, Transformer
from models._plans import layout_model, shard_units, transformer_tp_plan
from spmd import Replicate, Shard
from spmd.parallel import (ColwiseParallel, RowwiseParallel, TrainState, executed_collectives, fully_shard, init_train_state,
                           make_train_step, parallelize_module, unshard_params, unshard_tree)

STEPS, BATCH, SEQ = 20, 16, 8
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
MODEL = Transformer(vocab_size=8, max_len=SEQ, num_layers=2, d_model=16, num_heads=8, mlp_ratio=2)
# (mesh shape, dim names, sequence parallel, accum steps)
# tp=8 alone runs as dp=1 x tp=8: spmd.parallel's step on a mesh with no data dim fails to trace
# ("shard_map requires a non-empty mesh"), reported to its owner.
CONFIGS = [
    ((1, 8), ("dp", "tp"), False, 1),
    ((1, 8), ("dp", "tp"), True, 1),
    ((2, 4), ("dp", "tp"), False, 2),
    ((2, 4), ("dp", "tp"), True, 1),
    ((2, 4), ("fsdp", "tp"), False, 1),
    ((2, 4), ("fsdp", "tp"), True, 2),
    ((2, 2, 2), ("dp", "fsdp", "tp"), False, 1),
    ((2, 2, 2), ("dp", "fsdp", "tp"), True, 2),
]


def _id(c):
    return ",".join(f"{n}={s}" for n, s in zip(c[1], c[0])) + ("-sp" if c[2] else "") + f"-accum{c[3]}"


def _cases(configs):
    """Each configuration's tests on one xdist worker (``--dist loadgroup``): they share its cached, compiled run."""
    return [pytest.param(c, id=_id(c), marks=pytest.mark.xdist_group("tp-" + _id(c))) for c in configs]


@functools.lru_cache(maxsize=None)
def _data():
    return sort_task(MODEL, STEPS, BATCH, SEQ, seed=1)


loss_fn = sort_loss(MODEL)


@functools.lru_cache(maxsize=None)
def _reference():
    params, batches = _data()
    return train_one_device(params, batches, loss_fn, OPT)


def _layout(mesh, sp, regather=True):
    if regather:
        return layout_model(MODEL, mesh, sequence_parallel=sp)
    model = parallelize_module(MODEL, mesh["tp"], transformer_tp_plan(sp))
    data = tuple(n for n in mesh.mesh_dim_names if n in ("dp", "fsdp"))
    return fully_shard(model, mesh=mesh[data], units=shard_units(MODEL), reshard_after_forward=False)


@functools.lru_cache(maxsize=None)
def _run(config, regather=True):
    shape, names, sp, accum = config
    params, batches = _data()
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _layout(mesh, sp, regather)
    state = init_train_state(model, OPT, params=params)
    step = make_train_step(model, loss_fn, OPT, accum_steps=accum)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return mesh, model, losses, state, executed_collectives(step, state, batches[0]), step, batches[0]


def _check_matches_one_device(mesh, model, losses, state):
    ref_losses, ref = _reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(unshard_params(model, state)), jax.tree.leaves(ref.params), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    opt = unshard_tree(state.opt_state, state.plan, mesh, optimizer=OPT)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", _cases(CONFIGS))
def test_matches_one_device(config):
    mesh, model, losses, state, *_ = _run(config)
    _check_matches_one_device(mesh, model, losses, state)


@pytest.mark.xdist_group("tp-" + _id(CONFIGS[6]))
def test_keeping_the_gathers_matches_one_device_and_gathers_each_block_once():
    config = CONFIGS[6]  # dp=2,fsdp=2,tp=2: each block's forward gathers kept for its backward pass
    mesh, model, losses, state, keep, *_ = _run(config, regather=False)
    _check_matches_one_device(mesh, model, losses, state)
    again = _run(config)[4]
    plan = state.plan
    # the blocks' re-gathers are gone: re-gathering, each block's backward pass gathers again every gather buffer
    # but the qkv bias's (2-D, a buffer of its own: no gradient reads its value), 2 x 5 of the plan's 2 x 6
    buffers = plan.gather_buffers(plan.unit_entries("block_0"))
    assert [e.path for e in buffers[2]] == ["block_0/attn/qkv/bias"] and len(buffers) == 6
    assert again["all-gather"]["count"] - keep["all-gather"]["count"] == 2 * (len(buffers) - 1)
    assert keep["reduce-scatter"] == again["reduce-scatter"]
    step, batch = _run(config, regather=False)[5:]  # keeping, the table is the HLO too
    got, want = executed_collectives(step, state, batch, scalars=False), step.communication(state, batch)["total"]
    assert {k: (got[k]["buffers"], got[k]["bytes"]) for k in want} == {k: (v["count"], v["bytes"]) for k, v in want.items()}
    assert plan.peak_gathered_bytes() == sum(plan.gathered_bytes(u) for u in plan.units)


@pytest.mark.parametrize("config", _cases(CONFIGS))
def test_collectives_equal_the_megatron_zero_table(config):
    """Every tensor collective of the compiled step (buffers and bytes per kind; scalars aside) is the table's:
    the fsdp / dp terms of the plan and the Megatron terms of the styled calls (``spmd.parallel.cost._comm``)."""
    mesh, model, _, state, _, step, batch = _run(config)
    got = executed_collectives(step, state, batch, scalars=False)
    want = step.communication(state, batch)["total"]
    # One term the table cannot see, under sequence parallelism: the model's own code adds its position
    # table (a raw parameter, whole over tp) to the sequence-cut embedding in global view, and GSPMD
    # all-gathers that parameter's gradient (positions x d_model floats) over tp: once, or twice on tp=8
    # (GSPMD's choice). Everything else is exact.
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        n = got[kind]["buffers"] - want[kind]["count"] if kind == "all-gather" and config[2] else 0
        assert n in ((1, 2) if kind == "all-gather" and config[2] else (0,)), (kind, got, want)
        assert (got[kind]["buffers"], got[kind]["bytes"]) == (want[kind]["count"] + n,
                                                              want[kind]["bytes"] + n * SEQ * MODEL.d_model * 4), \
            (kind, got, want)
    # the all-reduces, from the model (a block's 12 leaves: 6 modules' kernel or scale, and bias):
    # parameters: dp > 1 reduces every leaf (embed, pos, ln_f's 2, the blocks'); fsdp alone only each block's fc
    #   bias (1-D and cut over tp: no dim left for fsdp, so whole over the data dim);
    # activations, per micro-batch: Megatron: the embedding's output, a block's qkv and fc input gradients and
    #   attn.proj and fc_out outputs, the head's input gradient; sequence parallel: the gradients whole over tp
    #   (a block's 2 norms' scale and bias and its 2 row-parallel biases; ln_f's 2)
    sizes, n_layers = dict(zip(config[1], config[0])), MODEL.num_layers
    params = 2 + 12 * n_layers + 2 if sizes.get("dp", 1) > 1 else n_layers if "fsdp" in sizes else 0
    acts = config[3] * (6 * n_layers + 2 if config[2] else 4 * n_layers + 2)
    assert want["all-reduce"]["count"] == params + acts
    assert got["all-to-all"]["count"] == got["collective-permute"]["count"] == 0


@pytest.mark.parametrize("config", _cases([CONFIGS[4], CONFIGS[6]]))
def test_state_bytes_per_device(config):
    mesh, _, _, state, *_ = _run(config)
    plan = state.plan
    dev = mesh.jax_mesh.devices.flat[0]

    def on_dev(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)

    assert on_dev(state.params) == plan.bytes_per_device
    assert on_dev([x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]) == 2 * plan.bytes_per_device
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
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    plan = layout_model(MODEL, mesh, sequence_parallel=True).plan(params)
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
    assert plan.entry("block_0/attn/qkv/kernel").local_shape == (8, 3, 4, 2)
    assert plan.entry("block_1/ln2/scale").rule == "SequenceParallel('block_*.ln2') + fully_shard"
    assert set(plan.units) == {"root", "block_0", "block_1"}
    # Without tp the fsdp default: Shard(0) everywhere.
    fs = layout_model(MODEL, spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))).plan(params)
    assert {e.placements for e in fs.entries} == {(S(0),)}
    # A vocabulary the tp size does not divide keeps the embedding whole (spmd.parallel cuts evenly).
    odd = transformer_tp_plan(vocab_size=11, tp_size=4)
    assert "embed" not in odd and set(transformer_tp_plan()) - set(odd) == {"embed", "embed.attend"}


def test_uneven_heads_and_bad_layouts_are_clear_errors():
    params, batches = _data()
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    six = MODEL.clone(d_model=12, num_heads=6)
    p6 = six.init(jax.random.key(0), batches[0]["inputs"])["params"]
    with pytest.raises(ValueError, match=re.escape(
            "parallelize_module: RowwiseParallel(input_layouts=Shard(dim=2), output_layouts=None, use_local_output=True, "
            "dim=None) on 'block_0.attn.proj' cuts dim 0 of 'block_0/attn/proj/kernel' (shape (6, 2, 12), size 6) "
            "over tp=4, which does not divide it")):
        init_train_state(layout_model(six, mesh), OPT, params=p6)
    with pytest.raises(TypeError, match=re.escape("ColwiseParallel: dim=1.5 must be an int")):
        ColwiseParallel(dim=1.5)
    tied = parallelize_module(MODEL, mesh["tp"], {"embed.attend": RowwiseParallel()})  # a tied head: column-parallel
    step = make_train_step(tied, lambda p, b: loss_fn(p, b), OPT)
    with pytest.raises(ValueError, match=r"parallelize_module: RowwiseParallel\(.*\) on 'embed\.attend': a tied output "
                                         r"projection runs column-parallel on the vocabulary"):
        step(init_train_state(tied, OPT, params=params), batches[0])
    with pytest.raises(ValueError, match=re.escape(
            "models.train: a mesh with a 'tp' dim runs a model's tensor-parallel plan; MLP has none: use "
            "--model transformer, llama or moe, or a mesh without tp.")):
        layout_model(MLP(7, 3, (10,)), mesh)


@pytest.mark.xdist_group("tp-" + _id(CONFIGS[5]))
def test_checkpoints_restore_across_layouts_bit_for_bit(tmp_path):
    """Saved on fsdp=2 x tp=4 (sequence parallel), restored on dp=8, 1 device and dp=2 x fsdp=2 x tp=2, saved
    there again and restored onto dp=2 x tp=4: the logical state is the same bits every time."""
    from models._checkpoint import Checkpointer
    from models._fsdp_run import layout_meta, logical_state, restore_resharded

    mesh, model, _, state, *_ = _run(CONFIGS[5])
    params, _ = _data()

    def logical(st, m):
        return jax.device_get(logical_state(st, m, OPT))

    want = logical(state, mesh)

    def save(name, st):
        ckpt = Checkpointer(tmp_path / name)
        ckpt.save(20, st, {"layout": layout_meta(st.plan)}, force=True)
        ckpt.close()
        return Checkpointer(tmp_path / name)

    def same(got):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)

    def target(m, sp=False):
        return init_train_state(layout_model(MODEL, m, sequence_parallel=sp) if m.ndim > 1 else MODEL, OPT,
                                params=params, mesh=None if m.ndim > 1 else m)

    saved = save("fsdp2tp4", state)
    for shape, names in [((8,), ("dp",)), ((1,), ("dp",))]:
        m = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
        st, _ = restore_resharded(saved, target(m), m, OPT)
        same(logical(st, m))
    m3 = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    st3, _ = restore_resharded(saved, target(m3), m3, OPT)
    assert tuple(st3.params["embed"]["embedding"].sharding.spec) == ("tp", "fsdp")  # vocab on tp, D on fsdp
    same(logical(st3, m3))
    m2 = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    st2, _ = restore_resharded(save("3d", st3), target(m2), m2, OPT)
    same(logical(st2, m2))


def test_job_on_fsdp_tp_mesh_reports_and_restores_anywhere(tmp_path):
    """models.train on fsdp=2 x tp=4 with sequence parallelism: metrics.json's memory is the plan's, its
    collectives the compiled step's; the checkpoint restores bit for bit on dp=8 and on 1 device."""
    from models.train import Config, restore_state, run
    from models.train._programs import build_mesh, programs

    cfg = Config(mesh="fsdp=2,tp=4", sequence_parallel=True, steps=2, batch_size=16, layers=2, d_model=16, heads=4,
                 length=4, save_every=2, eval_size=16, out=str(tmp_path / "run"), progress=False, log_every=1)
    summary = run(cfg)
    mesh = build_mesh(cfg.mesh)
    plan = programs(cfg, mesh).plan
    state, _ = restore_state(cfg.out, mesh=mesh)
    # the same placements (a restore need not say sequence parallel: the parameters are laid out alike)
    assert [(e.path, e.placements, e.local_shape) for e in state.plan.entries] == [
        (e.path, e.placements, e.local_shape) for e in plan.entries]
    scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
    assert summary["memory"]["state_bytes_per_device"] == 3 * plan.bytes_per_device + scalars  # params + mu + nu
    assert summary["memory"]["peak_gathered_bytes"] == plan.peak_gathered_bytes()
    assert summary["collectives"]["reduce-scatter"]["count"] >= plan.communication()["total"]["reduce-scatter"]["count"]
    logical = jax.device_get(unshard_tree(state.params, plan, mesh))
    for shape, names in [((8,), ("dp",)), ((1,), ("dp",))]:
        other, _ = restore_state(cfg.out, mesh=spmd.init_device_mesh("cpu", shape, mesh_dim_names=names))
        for a, b in zip(jax.tree.leaves(jax.device_get(other.params)), jax.tree.leaves(logical), strict=True):
            np.testing.assert_array_equal(a, b)
