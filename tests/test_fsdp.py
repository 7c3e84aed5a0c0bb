"""The fully sharded (FSDP / HSDP) train step: 1-device equivalence, HLO collectives, state bytes, errors.

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
from models._ddp import TrainState, init_train_state
from models._fsdp import make_fsdp_train_step, shard_train_state
from spmd import Replicate, Shard
from spmd.parallel import Rule, hlo_executed_collectives, plan_params, unshard_params

STEPS = 20
BATCH = 16
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
MODELS = {
    # d_model 12 over 8 ranks: chunks 2,2,2,2,2,2,0,0; vocab 7: 1,...,1,0.
    "transformer": (Transformer(vocab_size=7, max_len=6, num_layers=2, d_model=12, num_heads=2, mlp_ratio=2), 6, 6),
    # one-hot input 5 x 7 = 35 rows: 9,9,9,8 over 4 and 18,17 over 2.
    "mlp": (MLP(7, 3, (10, 6)), 5, 3),
}
CONFIGS = [
    ("transformer", (8,), ("fsdp",), 1, True),
    ("transformer", (2, 4), ("dp", "fsdp"), 2, True),
    ("transformer", (2,), ("fsdp",), 1, False),
    ("mlp", (4,), ("fsdp",), 1, True),
    ("mlp", (2,), ("fsdp",), 2, True),
    ("mlp", (2, 4), ("dp", "fsdp"), 1, True),
]


def _ce(logits, batch):
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(nll), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["targets"])}


def _loss_fn(name):
    model = MODELS[name][0]
    return lambda p, b, gather: _ce(model.apply({"params": p}, b["inputs"], gather=gather), b)


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
    loss_fn = _loss_fn(name)
    return train_one_device(params, batches, lambda p, b: loss_fn(p, b, None), OPT, has_aux=True)


@functools.lru_cache(maxsize=None)
def _sharded(config):
    name, shape, names, accum, regather = config
    model = MODELS[name][0]
    params, batches = _data(name)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = plan_params(params, mesh, units=model.fsdp_units(), keep=model.fsdp_keep())
    step = make_fsdp_train_step(_loss_fn(name), OPT, mesh, plan, accum_steps=accum, regather=regather)
    state = shard_train_state(init_train_state(params, OPT), plan, mesh, OPT)
    compiled = step.lower(state, batches[0]).compile()  # one compile: runs the steps and gives the HLO
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    return mesh, plan, losses, state, compiled.as_text()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-accum{c[3]}-regather{c[4]}")
def test_matches_one_device(config):
    mesh, plan, losses, state, _ = _sharded(config)
    ref_losses, ref = _reference(config[0])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    full = unshard_params(state.params, plan, mesh)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref.params), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    opt = unshard_params(state.opt_state, plan, mesh, optimizer=OPT)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(ref.opt_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert int(state.step) == STEPS


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-accum{c[3]}-regather{c[4]}")
def test_collectives_equal_the_table(config):
    mesh, plan, _, _, text = _sharded(config)
    got = hlo_executed_collectives(text)
    want = plan.communication(regather=config[4], accum_steps=config[3])["total"]
    assert got["all-gather"] == want["all-gather"]
    assert got["reduce-scatter"] == want["reduce-scatter"]
    assert got["all-to-all"]["count"] == got["collective-permute"]["count"] == 0
    # Beyond the table, only f32 scalars are all-reduced: per sharded leaf its sum of squares twice (the clip's
    # global norm and the grad_norm metric), plus the loss and the accuracy.
    extra = got["all-reduce"]["bytes"] - want["all-reduce"]["bytes"]
    assert extra == 4 * (2 * len(plan.entries) + 2), (got["all-reduce"], want["all-reduce"])
    if config[3] == 1 and config[0] == "transformer":
        # The root once (embed, pos, one flat buffer of ln_f's vectors), then each of the 2 blocks right before
        # it runs (and again for its backward pass): its 5 arrays of 2+ dims (qkv kernel and bias, proj, fc and
        # fc_out kernels) one by one and its 7 vectors (norms, biases) as one buffer.
        assert got["all-gather"]["count"] == 3 + 2 * 6 * (2 if config[4] else 1)
        assert got["reduce-scatter"]["count"] == 3 + 2 * 6


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3]], ids=["t-fsdp8", "t-dp2fsdp4", "mlp-fsdp4"])
def test_state_bytes_per_device(config):
    mesh, plan, _, state, _ = _sharded(config)
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


def test_bad_inputs_are_clear_errors():
    mesh, plan, _, state, _ = _sharded(CONFIGS[0])
    params, batches = _data("transformer")
    step = make_fsdp_train_step(_loss_fn("transformer"), OPT, mesh, plan)
    odd = {k: v[:12] for k, v in batches[0].items()}
    with pytest.raises(ValueError, match=re.escape(
            "train_step: the batch has 12 examples, not divisible by the data-parallel size fsdp=8 = 8; use a batch "
            "size that is a multiple of 8.")):
        step(state, odd)
    with pytest.raises(ValueError, match=re.escape("train_step: the sharded parameters (padded shapes) do not match the plan")):
        step(init_train_state(params, OPT), batches[0])
    mesh4 = spmd.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    with pytest.raises(ValueError, match=re.escape("make_fsdp_train_step: plan was built for the mesh {'fsdp': 8}, not {'fsdp': 4}")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, mesh4, plan)
    dp_tp = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=re.escape("make_fsdp_train_step: the plan's fsdp dim 'fsdp' is not a dim of the mesh ('dp', 'tp')")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, dp_tp, plan_params(params, dp_tp))
    hsdp = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))
    bad = plan_params(params, hsdp, [Rule("pos", {"dp": Shard(0)})])
    with pytest.raises(ValueError, match=re.escape("make_fsdp_train_step: the plan places parameter 'pos' as S(0) on mesh dim 'dp'")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, hsdp, bad)
    split = plan_params(params, hsdp, [Rule("block_1/.*", {"fsdp": Replicate()})], units=Transformer.fsdp_units())
    with pytest.raises(ValueError, match=re.escape("make_fsdp_train_step: the plan gives the blocks different layouts")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, hsdp, split)
    with pytest.raises(ValueError, match=re.escape("make_fsdp_train_step: accum_steps=0 must be an int >= 1")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, mesh, plan, accum_steps=0)
    with pytest.raises(TypeError, match=re.escape("make_fsdp_train_step: plan=None must be a spmd.parallel.ParamPlan")):
        make_fsdp_train_step(_loss_fn("transformer"), OPT, mesh, None)


def test_checkpoints_restore_across_meshes_bit_for_bit(tmp_path):
    """fsdp=8 -> dp=8 (replicated) -> fsdp=2 -> 1 device: each save written by its own layout."""
    from models._checkpoint import Checkpointer
    from models._fsdp_run import layout_meta, restore_resharded

    mesh8, plan8, _, state8, _ = _sharded(CONFIGS[0])
    params, _ = _data("transformer")
    units = Transformer.fsdp_units()
    abstract = jax.eval_shape(lambda: params)
    logical = jax.device_get(TrainState(state8.step, unshard_params(state8.params, plan8, mesh8),
                                        unshard_params(state8.opt_state, plan8, mesh8, optimizer=OPT)))
    dp8 = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    fsdp2 = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    one = spmd.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    plan2 = plan_params(params, fsdp2, units=units)
    replicated_target = init_train_state(params, OPT)

    def save(name, state, plan):
        ckpt = Checkpointer(tmp_path / name)
        ckpt.save(20, state, {"layout": layout_meta(plan)}, force=True)
        ckpt.close()
        return Checkpointer(tmp_path / name)

    def same(state, plan, mesh):
        got = state if plan is None else TrainState(state.step, unshard_params(state.params, plan, mesh),
                                                     unshard_params(state.opt_state, plan, mesh, optimizer=OPT))
        for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(logical), strict=True):
            np.testing.assert_array_equal(a, b)

    on_dp8, _ = restore_resharded(save("fsdp8", state8, plan8), replicated_target, None, dp8, OPT, abstract, units)
    same(on_dp8, None, dp8)
    assert on_dp8.params["pos"].sharding.is_fully_replicated
    target2 = shard_train_state(replicated_target, plan2, fsdp2, OPT)
    on_fsdp2, _ = restore_resharded(save("dp8", on_dp8, None), target2, plan2, fsdp2, OPT, abstract, units)
    same(on_fsdp2, plan2, fsdp2)
    assert on_fsdp2.params["pos"].shape == (6, 12) and on_fsdp2.params["pos"].sharding.spec[0] == "fsdp"
    on_one, _ = restore_resharded(save("fsdp2", on_fsdp2, plan2), replicated_target, None, one, OPT, abstract, units)
    same(on_one, None, one)
    other = jax.eval_shape(lambda: MODELS["transformer"][0].clone(d_model=8).init(
        jax.random.key(0), np.zeros((2, 6), np.int32))["params"])
    with pytest.raises(ValueError, match=re.escape("restore_resharded: the checkpoint holds parameters of other paths or shapes than the plan was built for")):
        restore_resharded(Checkpointer(tmp_path / "fsdp8"), replicated_target, None, dp8, OPT, other, units)


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
    state: each parameter cut Shard(0) over 8 as torch.chunk cuts (ceil), the scalars (step counts) on every
    device. Parameters and AdamW's two moments make the state bytes."""
    params = jax.tree.leaves(state.params)
    whole = sum(x.nbytes for x in params)
    chunk = sum(-(-x.shape[0] // 8) * int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in params)
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
    # the MLP keeps every unit gathered (fsdp_keep): all 8 padded chunks of every parameter
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

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
