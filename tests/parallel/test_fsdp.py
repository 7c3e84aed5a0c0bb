"""FSDP / HSDP of the project models through the contract (fully_shard, init_train_state, make_train_step):
1-device equivalence, HLO collectives vs the plan, state bytes, peak gathered bytes, errors, checkpoints, the job.

Each configuration compiles once (lru_cache) and trains 20 AdamW steps on a
tiny model whose dims do not divide the fsdp size (uneven torch.chunk shards).
AdamW uses eps=1e-6: the attention key bias has a zero gradient in exact
arithmetic (softmax is shift invariant), and with eps=1e-8 Adam turns its
float noise (~1e-9, which depends on the summation order) into full +-lr steps
in any two runs that sum in a different order (DDP too).
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
from models import MLP, Transformer
from models._plans import layout_model, reshard_after_forward, shard_units
from spmd.parallel import TrainState, executed_collectives, fully_shard, init_train_state, make_train_step, unshard_tree

STEPS = 20
BATCH = 16
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
MODELS = {
    # d_model 12 over 8 ranks: chunks 2,2,2,2,2,2,0,0; vocab 7: 1,...,1,0.
    "transformer": (Transformer(vocab_size=7, max_len=6, num_layers=2, d_model=12, num_heads=2, mlp_ratio=2), 6, 6),
    # one-hot input 5 x 7 = 35 rows: 9,9,9,8 over 4 and 18,17 over 2.
    "mlp": (MLP(7, 3, (10, 6)), 5, 3),
}
# (model, mesh shape, dim names, accum steps, reshard_after_forward); the job's choice
# (models._plans.reshard_after_forward): the transformer's blocks re-gather, the MLP keeps its layers' gathers.
CONFIGS = [
    ("transformer", (8,), ("fsdp",), 1, True),
    ("transformer", (2, 4), ("dp", "fsdp"), 2, True),
    ("transformer", (2,), ("fsdp",), 1, False),
    ("mlp", (4,), ("fsdp",), 1, False),
    ("mlp", (2,), ("fsdp",), 2, False),
    ("mlp", (2, 4), ("dp", "fsdp"), 1, False),
    ("mlp", (4,), ("fsdp",), 1, True),
]


def _ce(logits, batch):
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(nll), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["targets"])}


def _loss_fn(name):
    model = MODELS[name][0]
    return lambda p, b: _ce(model.apply({"params": p}, b["inputs"]), b)


@functools.lru_cache(maxsize=None)
def _data(name):
    model, seq, out = MODELS[name]
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(STEPS):
        toks = rng.integers(0, 7, (BATCH, seq)).astype(np.int32)
        batches.append({"inputs": toks, "targets": np.sort(toks, axis=1)[:, :out]})
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    return params, batches


@functools.lru_cache(maxsize=None)
def _reference(name):
    """1 device, the whole batch: losses and the final state."""
    params, batches = _data(name)
    return train_one_device(params, batches, _loss_fn(name), OPT, has_aux=True)


def _layout(name, mesh, reshard):
    model = MODELS[name][0]
    if reshard == reshard_after_forward(model):
        return layout_model(model, mesh)  # the job's layout
    return fully_shard(model, mesh=mesh, units=shard_units(model), reshard_after_forward=reshard)


@functools.lru_cache(maxsize=None)
def _sharded(config):
    name, shape, names, accum, reshard = config
    params, batches = _data(name)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _layout(name, mesh, reshard)
    step = make_train_step(model, _loss_fn(name), OPT, accum_steps=accum)
    state = init_train_state(model, OPT, params=params)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return mesh, model, step, losses, state, executed_collectives(step, state, batches[0])


def _logical(state, mesh):
    return TrainState(state.step, unshard_tree(state.params, state.plan, mesh),
                      unshard_tree(state.opt_state, state.plan, mesh, optimizer=OPT), state.plan)


def _ids(c):
    return f"{c[0]}-{'x'.join(map(str, c[1]))}-accum{c[3]}-reshard{c[4]}"


def _cases(configs):
    """Each configuration's tests on one xdist worker (``--dist loadgroup``): they share its cached, compiled run."""
    return [pytest.param(c, id=_ids(c), marks=pytest.mark.xdist_group("fsdp-" + _ids(c))) for c in configs]


@pytest.mark.parametrize("config", _cases(CONFIGS))
def test_matches_one_device(config):
    mesh, model, _, losses, state, _ = _sharded(config)
    ref_losses, ref = _reference(config[0])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    full = _logical(state, mesh)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(ref.params), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(full.opt_state), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert int(state.step) == STEPS


@pytest.mark.parametrize("config", _cases(CONFIGS))
def test_collectives_equal_the_table(config):
    mesh, _, step, _, state, got = _sharded(config)
    plan = state.plan
    # the step's table: re-gathering units gather again the buffers their gradients read, off its backward pass
    # (the plan's counts every buffer twice, torch's FSDP2: 12 all-gathers for the MLP, 27 for the transformer)
    want = step.communication(state, _data(config[0])[1][0])["total"]
    if config[0] == "mlp" and config[4]:
        # The MLP resharded after forward: no re-gather of what nobody reads backward (hidden_0's kernel: its
        # one-hot input has no gradient; every bias): 6 forward + 2 kernels again.
        assert got["all-gather"]["count"] == 8 and plan.communication(dp="dp")["total"]["all-gather"]["count"] == 12

    def cb(d):
        return {"count": d["count"], "bytes": d["bytes"]}

    assert cb(got["all-gather"]) == want["all-gather"]
    assert cb(got["reduce-scatter"]) == want["reduce-scatter"]
    assert got["all-to-all"]["count"] == got["collective-permute"]["count"] == 0
    # Beyond the table, only f32 scalars are all-reduced: per sharded leaf its sum of squares twice (the clip's
    # global norm and the grad_norm metric), plus the loss and the accuracy.
    extra = got["all-reduce"]["bytes"] - want["all-reduce"]["bytes"]
    assert extra == 4 * (2 * len(plan.entries) + 2), (extra, got["all-reduce"], want["all-reduce"])
    if config[3] == 1 and config[0] == "transformer":
        # The root once (embed, pos, one flat buffer of ln_f's vectors), then each of the 2 blocks right before
        # it runs: its 5 arrays of 2+ dims (qkv kernel and bias, proj, fc and fc_out kernels) one by one and its
        # 7 vectors (norms, biases) as one buffer; re-gathering, again for its backward pass all but the qkv
        # bias, which no gradient reads.
        assert got["all-gather"]["count"] == 3 + 2 * 6 + (2 * 5 if config[4] else 0)
        assert got["reduce-scatter"]["count"] == 3 + 2 * 6
    if config[0] == "mlp" and config[3] == 1:  # 3 units (hidden_0, hidden_1, out) of 2 buffers (kernel, bias)
        assert got["all-gather"]["count"] == 6 + (2 if config[4] else 0) and got["reduce-scatter"]["count"] == 6


@pytest.mark.parametrize("config", _cases([CONFIGS[0], CONFIGS[1], CONFIGS[3]]))
def test_state_bytes_per_device(config):
    mesh, _, _, _, state, _ = _sharded(config)
    plan = state.plan
    n = mesh.size("fsdp")
    dev = mesh.jax_mesh.devices.flat[0]

    def on_dev(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)

    assert on_dev(state.params) == plan.bytes_per_device
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert on_dev(moments) == 2 * plan.bytes_per_device  # AdamW's mu and nu follow their parameter
    # total / N up to padding: every parameter cut on dim 0 (the default) as torch.chunk cuts, from the params' shapes
    params, _ = _data(config[0])
    assert plan.bytes_per_device == sum(-(-x.shape[0] // n) * int(np.prod(x.shape[1:])) * x.dtype.itemsize
                                        for x in jax.tree.leaves(params))
    # the peak of gathered parameters: the root held, plus one other unit at a time (resharded after forward), or
    # every unit (the MLP keeps its layers' gathers)
    others = [plan.gathered_bytes(u) for u in plan.units if u != "root"]
    assert plan.peak_gathered_bytes() == plan.gathered_bytes("root") + (max(others) if config[4] else sum(others))


@pytest.mark.xdist_group("fsdp-" + _ids(CONFIGS[0]))
def test_bad_inputs_are_clear_errors():
    mesh, model, step, _, state, _ = _sharded(CONFIGS[0])
    params, batches = _data("transformer")
    odd = {k: v[:12] for k, v in batches[0].items()}
    with pytest.raises(ValueError, match=re.escape(
            "train_step: the batch has 12 examples, not divisible by the data-parallel size fsdp=8 = 8; use a batch "
            "size that is a multiple of 8.")):
        step(state, odd)
    mesh4 = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    other = init_train_state(layout_model(MODELS["transformer"][0], mesh4), OPT, params=params)
    with pytest.raises(ValueError, match=re.escape("train_step: the state was laid out for another model or plan")):
        step(other, batches[0])
    with pytest.raises(ValueError, match=re.escape("make_train_step: accum_steps=0 must be an int >= 1")):
        make_train_step(model, _loss_fn("transformer"), OPT, accum_steps=0)
    with pytest.raises(ValueError, match=re.escape("fully_shard: unit 'layers_*' matches no module of the model")):
        init_train_state(fully_shard(MODELS["transformer"][0], mesh=mesh, units=["layers_*"]), OPT, params=params)


@pytest.mark.xdist_group("fsdp-" + _ids(CONFIGS[0]))
def test_checkpoints_restore_across_meshes_bit_for_bit(tmp_path):
    """fsdp=8 -> dp=8 (replicated) -> fsdp=2 -> 1 device: each save written by its own layout."""
    from models._checkpoint import Checkpointer
    from models._fsdp_run import layout_meta, restore_resharded

    mesh8, _, _, _, state8, _ = _sharded(CONFIGS[0])
    model = MODELS["transformer"][0]
    params, _ = _data("transformer")
    logical = jax.device_get(_logical(state8, mesh8))
    dp8 = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    fsdp2 = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    one = spmd.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))

    def save(name, state):
        ckpt = Checkpointer(tmp_path / name)
        ckpt.save(20, state, {"layout": layout_meta(state.plan)}, force=True)
        ckpt.close()
        return Checkpointer(tmp_path / name)

    def same(state, mesh):
        for a, b in zip(jax.tree.leaves(jax.device_get(_logical(state, mesh))), jax.tree.leaves(logical), strict=True):
            np.testing.assert_array_equal(a, b)

    on_dp8, _ = restore_resharded(save("fsdp8", state8), init_train_state(model, OPT, params=params, mesh=dp8), dp8, OPT)
    same(on_dp8, dp8)
    assert on_dp8.params["pos"].sharding.is_fully_replicated
    on_fsdp2, _ = restore_resharded(save("dp8", on_dp8), init_train_state(layout_model(model, fsdp2), OPT,
                                                                          params=params), fsdp2, OPT)
    same(on_fsdp2, fsdp2)
    assert on_fsdp2.params["pos"].shape == (6, 12) and on_fsdp2.params["pos"].sharding.spec[0] == "fsdp"
    on_one, _ = restore_resharded(save("fsdp2", on_fsdp2), init_train_state(model, OPT, params=params, mesh=one),
                                  one, OPT)
    same(on_one, one)
    other = model.clone(d_model=8).init(jax.random.key(0), np.zeros((2, 6), np.int32))["params"]
    with pytest.raises(ValueError, match=re.escape("restore_resharded: the checkpoint holds parameters of other paths or shapes than the plan was built for")):
        restore_resharded(Checkpointer(tmp_path / "fsdp8"), init_train_state(model.clone(d_model=8), OPT, params=other,
                                                                              mesh=dp8), dp8, OPT)


# The MLP keeps the job tests fast (the transformer's sharded step is checked above, against 1 device).
JOB = dict(model="mlp", hidden=16, steps=4, batch_size=16, length=4, save_every=2, log_every=1)


@functools.lru_cache(maxsize=None)
def _job_dp8():
    """The reference run of the job tests: --mesh dp=8 (summary, with its --out as "out")."""
    import tempfile

    from models.train import Config, run

    out = tempfile.mkdtemp(prefix="fsdp_job_dp8_")
    return dict(run(Config(mesh="dp=8", out=out, progress=False, **JOB)), out=out)


def _job_state_bytes(state):
    """(whole parameter bytes, one device's fsdp=8 chunk of them, optimizer scalar bytes) of a restored job
    state: each parameter cut over 8 as torch.chunk cuts (ceil), the scalars (step counts) on every device.
    Parameters and AdamW's two moments make the state bytes. The job gives init_train_state example inputs, so a
    Dense kernel [in, out] is cut on its output dim as torch's FSDP cuts a Linear weight [out, in], where 8
    divides it or divides neither dim (docs/training/any-model.md); every other parameter on dim 0."""
    params = jax.tree.leaves(state.params)
    whole = sum(x.nbytes for x in params)

    def dim(x):
        return 1 if x.ndim == 2 and (x.shape[1] % 8 == 0 or x.shape[0] % 8 != 0) else 0

    chunk = sum(-(-x.shape[dim(x)] // 8) * x.size // x.shape[dim(x)] * x.dtype.itemsize for x in params)
    return whole, chunk, sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if np.ndim(x) == 0)


def test_training_job_fsdp_and_hsdp_match_dp_and_resume_across_layouts(tmp_path):
    """`--mesh fsdp=8` gives the per-step losses of `--mesh dp=8` (same seed); a run saved on fsdp=8
    resumes on dp=2,fsdp=4 and continues the dp=8 run's losses; metrics.json reports memory and collectives."""
    import json
    import shutil

    from models.train import Config, restore_state, run

    tiny = dict(JOB, progress=False)
    dp = _job_dp8()
    fs = run(Config(mesh="fsdp=8", out=str(tmp_path / "fsdp"), **tiny))
    losses = [h["loss"] for h in dp["history"]]
    np.testing.assert_allclose([h["loss"] for h in fs["history"]], losses, rtol=0, atol=1e-5)
    assert fs["final"]["eval_token_accuracy"] == pytest.approx(dp["final"]["eval_token_accuracy"], abs=1e-6)
    with open(tmp_path / "fsdp" / "metrics.json") as f:
        saved = json.load(f)
    mem, comm = saved["memory"], saved["collectives"]
    one = spmd.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    want, _ = restore_state(dp["out"], mesh=one)
    params = jax.tree.leaves(want.params)
    whole, chunk, scalars = _job_state_bytes(want)
    assert whole == 4 * saved["parameters"] and len(params) == 6  # kernel and bias of hidden_0, hidden_1, out
    assert mem["state_bytes_total"] == dp["memory"]["state_bytes_total"] == 3 * whole + scalars
    assert dp["memory"]["state_bytes_per_device"] == 3 * whole + scalars
    assert mem["state_bytes_per_device"] == 3 * chunk + scalars
    # the MLP keeps every layer gathered (models._plans.reshard_after_forward): all 8 padded chunks of every parameter
    assert mem["peak_gathered_bytes"] == 8 * chunk and dp["memory"]["peak_gathered_bytes"] == 0
    assert comm["all-gather"] == comm["reduce-scatter"] == {"count": 6, "bytes": 8 * chunk}  # one per parameter
    # fsdp=8 all-reduces scalars only (the clip's and the grad_norm metric's per-leaf sums, loss, accuracy);
    # dp=8 all-reduces every gradient byte, with the loss and accuracy
    assert comm["all-reduce"]["bytes"] == 4 * (2 * len(params) + 2)
    assert dp["collectives"]["all-reduce"]["bytes"] == whole + 4 * 2
    # Resume the fsdp=8 run from step 2 on dp=2,fsdp=4.
    shutil.rmtree(tmp_path / "fsdp" / "checkpoints" / "4")
    hs = run(Config(mesh="dp=2,fsdp=4", out=str(tmp_path / "fsdp"), resume=True, **tiny))
    assert hs["resumed_from"] == 2 and hs["mesh"] == {"dp": 2, "fsdp": 4}
    np.testing.assert_allclose([h["loss"] for h in hs["history"]], losses, rtol=0, atol=1e-5)
    # The final (dp=2,fsdp=4) state restores whole on one device and on dp=8, bit for bit, close to the dp=8 run's.
    got, _ = restore_state(str(tmp_path / "fsdp"), mesh=one)
    again, _ = restore_state(str(tmp_path / "fsdp"))
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5)


@pytest.mark.timeout(240)
def test_training_job_fsdp_under_spmdrun_matches_dp(tmp_path):
    """`spmdrun --nproc-per-node 2 --devices-per-proc 4 -m models.train --mesh fsdp=8`: each process holds
    its 4 devices' shards; the per-step losses are the one-process dp=8 run's."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    drop = ("XLA_FLAGS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "SPMD_DEVICES_PER_PROC")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in JOB.items()]
    out = tmp_path / "mp"
    proc = subprocess.run([sys.executable, "-m", "spmd.run", "--standalone", "--nproc-per-node", "2",
                           "--devices-per-proc", "4", "-m", "models.train", "--mesh", "fsdp=8", *flags, "--no-progress",
                           "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "metrics.json") as f:
        summary = json.load(f)
    assert summary["processes"] == 2 and summary["mesh"] == {"fsdp": 8}
    dp = _job_dp8()
    np.testing.assert_allclose([h["loss"] for h in summary["history"]], [h["loss"] for h in dp["history"]],
                               rtol=0, atol=1e-5)
    from models.train import restore_state

    whole, chunk, scalars = _job_state_bytes(restore_state(dp["out"])[0])
    assert summary["memory"]["state_bytes_per_device"] == 3 * chunk + scalars  # each process's devices hold chunks
    assert dp["memory"]["state_bytes_per_device"] == 3 * whole + scalars


def _compiled_layout(model, params, batch, lay):
    """``(compiled step, ParamPlan)`` of ``lay`` on ``model`` for the shape structs ``params`` and ``batch``
    (nothing allocated)."""
    from spmd.parallel.auto._measure import _built

    step, state, b = _built(model, OPT, lambda m: (lambda p, x: _ce(m.apply({"params": p}, x["inputs"]), x)),
                            params, batch, jax.devices(), lay, abstract=True)
    return step.lower(state, b).compile(), state.plan


def _tp_layout_plan(variant: str, tp: int, vocab: int):
    """The ``tp_plan`` of a laid-out tiny Transformer: ``variant`` "plain", "sp" (sequence parallel) or "ws"
    (weight-stationary)."""
    from models._plans import transformer_tp_plan
    from spmd.parallel.auto._layout import tp_plan_for

    return tp_plan_for(lambda sequence_parallel, tp_size: transformer_tp_plan(sequence_parallel, vocab_size=vocab,
                                                                              tp_size=tp_size),
                       variant == "sp", tp, weight_stationary=variant == "ws")


@pytest.mark.parametrize("mesh", ["fsdp=8", "dp=2,fsdp=4", "fsdp=4,tp=2 sp", "fsdp=4,tp=2 ws"])
def test_regathering_holds_one_unit_at_a_time(mesh):
    """``reshard_after_forward``: the compiled step holds the root and about one block's gathered parameters,
    not every block's: XLA would otherwise run every block's forward all-gather at the start of the step
    (they read nothing but the stored shards), so a re-gathering layout held them all, as a keeping one
    does (the d384x6 Transformer's ``dp=2,fsdp=4`` step: 104 MiB where it needs 71). 6 blocks, one row per
    device (two under ``ws``, which cuts each replica's rows over tp): the activations are a few KiB, the
    gathered parameters 90-180 KiB a block. It holds under plans that cut the activations over tp too
    (sequence parallel, weight-stationary), where the tie's zero is summed on each device's own block."""
    from spmd.parallel import Layout
    from spmd.parallel.auto._layout import infer_units

    model = Transformer(vocab_size=8, max_len=6, num_layers=6, d_model=64, num_heads=2, mlp_ratio=2)
    shape, _, variant = mesh.partition(" ")
    dims = {k: int(v) for k, v in (kv.split("=") for kv in shape.split(","))}
    rows = dims.get("dp", 1) * dims["fsdp"] * (2 if variant == "ws" else 1)
    batch = {"inputs": jax.ShapeDtypeStruct((rows, 6), jnp.int32), "targets": jax.ShapeDtypeStruct((rows, 6),
                                                                                                    jnp.int32)}
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    tp = dims.get("tp", 1)
    extra = dict(tp=tp, tp_plan=_tp_layout_plan(variant, tp, 8), sequence_parallel=variant == "sp",
                 weight_stationary=variant == "ws") if tp > 1 else {}
    temp = {}
    for regather in (True, False):
        lay = Layout(dp=dims.get("dp", 1), fsdp=dims["fsdp"], units=infer_units(params),  # ("block_*",)
                     reshard_after_forward=regather, **extra)
        compiled, plan = _compiled_layout(model, params, batch, lay)
        temp[regather] = compiled.memory_analysis().temp_size_in_bytes
    blocks = [plan.gathered_bytes(u) for u in plan.units if u.startswith("block_")]
    assert len(blocks) == 6 and min(blocks) == max(blocks)
    block = blocks[0]
    # keeping holds the 6 blocks at the end of the forward pass; re-gathering holds at most 2 at once (the
    # block whose backward runs, its gradients before their reduce-scatters) and the root
    assert temp[False] >= 6 * block
    assert temp[True] <= temp[False] - 3 * block, (temp, block)


@pytest.mark.parametrize("variant", ["plain", "sp", "ws"])
def test_regathering_ties_add_no_collective(variant, monkeypatch):
    """The ties of a unit's gathers to its input (forward) and to its cotangent (backward: the re-gather) add no
    collective, scalars counted: the re-gathering step's all-reduces and reduce-scatters are the keeping
    step's, and without the forward tie its collectives are the same. Under a plan that cuts the activations
    over tp (sequence parallel, weight-stationary) a tie's sum in global view would be an all-reduce over tp
    per unit (``_fully_shard._zero_from``)."""
    import spmd.parallel.styles._fully_shard as fully_shard_style
    from spmd.parallel import Layout
    from spmd.parallel.auto._layout import infer_units
    from spmd.parallel.cost._hlo import hlo_executed_collectives

    model = Transformer(vocab_size=16, max_len=8, num_layers=2, d_model=32, num_heads=4, mlp_ratio=2)
    batch = {"inputs": jax.ShapeDtypeStruct((16, 8), jnp.int32), "targets": jax.ShapeDtypeStruct((16, 8), jnp.int32)}
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])

    def collectives(regather: bool) -> dict:
        lay = Layout(fsdp=4, tp=2, units=infer_units(params), sequence_parallel=variant == "sp",
                     weight_stationary=variant == "ws", tp_plan=_tp_layout_plan(variant, 2, 16),
                     reshard_after_forward=regather)
        return hlo_executed_collectives(_compiled_layout(model, params, batch, lay)[0].as_text(), scalars=True)

    tied, keep = collectives(True), collectives(False)
    for kind in ("all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        assert tied[kind] == keep[kind], (kind, tied[kind], keep[kind])
    assert tied["all-gather"]["count"] > keep["all-gather"]["count"]  # the backward pass's re-gathers
    monkeypatch.setattr(fully_shard_style, "_after", lambda hooks, shards, arrays: shards)
    assert collectives(True) == tied


_TRANSCENDENTAL = re.compile(r" (exponential|rsqrt|sqrt|logistic|tanh|sine|cosine|log)\(")


@pytest.mark.slow
def test_regathering_recomputes_nothing_but_the_gather():
    """A re-gathering unit's backward pass gathers its parameters again and recomputes nothing else (torch's
    FSDP2 frees the gathered parameters and keeps every activation autograd saves): on a Llama block (RMSNorm,
    rotary, softmax, SwiGLU) the compiled step's all-gathers are the table's, the keeping step's plus each
    block's parameters once more (bytes from the shapes, no padding at d32 over 8), and its backward pass
    (the named scope ``REGATHER``) runs no exp, rsqrt, sigmoid or sine: the forward pass's ones, as many as
    the keeping step's. Under a policy saving the matmul outputs alone, the norms, the softmax and the SiLU ran
    again in every block's backward pass (8 exp and rsqrt of the 17 each in the d256x4 Llama's step)."""
    from models import Llama, LlamaConfig
    from spmd.parallel.cost._hlo import hlo_executed_collectives
    from spmd.parallel.styles._fully_shard import REGATHER

    model = Llama(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                              num_kv_heads=2))
    x = jnp.zeros((16, 8), jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    batch = {"inputs": x, "targets": x}
    got, text, table = {}, {}, {}
    for regather in (True, False):
        laid = fully_shard(model, mesh=mesh, units=["layers_*"], reshard_after_forward=regather)
        step = make_train_step(laid, lambda p, b, m=laid: _ce(m.apply({"params": p}, b["inputs"]), b), OPT)
        state = init_train_state(laid, OPT, x, params=params)
        text[regather] = step.lower(state, batch).compile().as_text()
        got[regather] = hlo_executed_collectives(text[regather])
        table[regather] = state.plan.communication(dp="dp")["total"]
    for regather in (True, False):
        for kind in ("all-gather", "reduce-scatter"):
            assert {k: got[regather][kind][k] for k in ("count", "bytes")} == table[regather][kind], (regather, kind)
    blocks = [v for k, v in params.items() if k.startswith("layers_")]
    again = sum(4 * v.size for v in jax.tree.leaves(blocks))  # every block parameter, f32, gathered once more
    # per block: 7 kernels one by one, the 2 norm scales as one buffer
    assert got[True]["all-gather"]["count"] == got[False]["all-gather"]["count"] + 2 * 8
    assert got[True]["all-gather"]["bytes"] == got[False]["all-gather"]["bytes"] + again
    assert got[True]["reduce-scatter"] == got[False]["reduce-scatter"]
    backward = [line for line in text[True].splitlines() if _TRANSCENDENTAL.search(line) and REGATHER in line]
    assert backward == [], backward[:3]
    for op in ("exponential", "rsqrt"):
        counts = [len(re.findall(rf" {op}\(", text[r])) for r in (True, False)]
        assert counts[0] == counts[1] > 0, (op, counts)


@pytest.mark.slow
def test_fully_shards_unit_is_a_style_the_hooks_dispatch(monkeypatch):
    """``fully_shard``'s unit is an ordinary ``ParallelStyle`` (``FullyShardUnit``): its ``param_placements`` are
    the plan's cut over fsdp (moved here to each kernel's dim 1, the plan follows), and the hooks hand each
    unit's call to its ``run_call``, as they hand a tensor-parallel style's (the root is gathered by the step)."""
    from placements import Replicate, Shard
    from spmd.parallel import ParallelStyle
    from spmd.parallel.styles._fully_shard import FullyShardUnit

    model_def, *_ = MODELS["transformer"]
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    model = fully_shard(model_def, mesh=mesh["fsdp"], units=["block_*"])
    assert isinstance(model.fsdp.unit_style, ParallelStyle)
    assert model.fsdp.unit_style.param_placements("block_0.fc", {"kernel": (12, 24), "bias": (24,), "s": ()}) == {
        "kernel": Shard(0), "bias": Shard(0), "s": Replicate()}  # torch's: dim 0
    calls, run_call = [], FullyShardUnit.run_call

    def counted(self, call):
        calls.append(call.fqn)
        return run_call(self, call)

    monkeypatch.setattr(FullyShardUnit, "run_call", counted)
    monkeypatch.setattr(FullyShardUnit, "param_placements", lambda self, path, params, module_type=None: {
        n: Shard(1) if len(s) >= 2 else Replicate() for n, s in params.items()})
    batch = {"inputs": np.zeros((BATCH, 6), np.int32), "targets": np.zeros((BATCH, 6), np.int32)}
    params = model_def.init(jax.random.key(0), batch["inputs"])["params"]
    state = init_train_state(model, OPT, params=params)
    fi = state.plan.mesh_dim_names.index("fsdp")
    got = {e.path: e.placements[fi] for e in state.plan.entries}
    assert got["block_0/fc/kernel"] == Shard(1) and got["block_1/fc/bias"] == Replicate(), got
    make_train_step(model, _loss_fn("transformer"), OPT).communication(state, batch)  # traces the step
    # each trace of the step (the gather rule reads the backward pass once before the table's) calls each unit
    assert calls and calls == ["block_0", "block_1"] * (len(calls) // 2), calls
