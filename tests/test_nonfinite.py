"""A non-finite loss or gradient norm: ``make_train_step(..., check_finite=)`` in a user's loop, and the job's
stop at the first such step (``--skip-nonfinite``: its update skipped)."""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from models import MLP
from models._data import DigitTask
from models.train import main
from models.train._programs import cross_entropy
from spmd.parallel import fully_shard, init_train_state, make_train_step, unshard_params

BAD = 3  # the step (1-based) whose batch holds an inf


def _batches(n=5):
    """Batches of the digit task; batch ``BAD`` has an inf in its mask (its loss is NaN)."""
    task = DigitTask("sort", 4)
    out = [task.batch(0, i, 16, "window") for i in range(n)]
    out[BAD - 1]["mask"][0, 0] = np.inf
    return out


def _setup(layout):
    model = MLP(11, 4, (16,))
    params = model.init(jax.random.key(0), _batches()[0]["inputs"])["params"]
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",) if layout == "ddp" else ("fsdp",))
    laid = model if layout == "ddp" else fully_shard(model, mesh=mesh, units=[])
    return model, laid, params, (mesh if layout == "ddp" else None)


def _loss(model):
    return lambda p, b: cross_entropy(model.apply({"params": p}, b["inputs"]), b)


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_skip_keeps_the_state_of_the_step_before(layout):
    model, laid, params, mesh = _setup(layout)
    opt = optax.adam(1e-2)
    plain = make_train_step(laid, _loss(model), opt, mesh=mesh)
    skip = make_train_step(laid, _loss(model), opt, mesh=mesh, check_finite="skip")
    state = ref = init_train_state(laid, opt, params=params, mesh=mesh)
    flags = []
    for i, b in enumerate(_batches()):
        if i + 1 == BAD:
            before = _numpy(unshard_params(laid, state))
        state, m = skip(state, b)
        flags.append(float(m["nonfinite"]))
        if i + 1 == BAD:
            assert not np.isfinite(float(m["loss"]))
            jax.tree.map(np.testing.assert_array_equal, _numpy(unshard_params(laid, state)), before)
        ref, _ = plain(ref, b)
    assert flags == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert int(state.step) == 5  # the step counts the batches consumed
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(_numpy(unshard_params(laid, state))))
    # without the check the same loop ends with NaN parameters
    assert not all(np.isfinite(x).all() for x in jax.tree.leaves(_numpy(unshard_params(laid, ref))))


def test_check_raises_naming_the_step_and_leaves_the_state_alone():
    model, laid, params, mesh = _setup("ddp")
    opt = optax.sgd(0.1)
    step = make_train_step(laid, _loss(model), opt, mesh=mesh, check_finite=True)
    state = init_train_state(laid, opt, params=params, mesh=mesh)
    with pytest.raises(FloatingPointError, match=re.escape(f"train_step: step {BAD} (from state.step={BAD - 1}) has "
                                                           "a non-finite loss (nan)")) as e:
        for b in _batches():
            before = _numpy(unshard_params(laid, state))
            state, _ = step(state, b)
    assert "check_finite='skip'" in str(e.value)
    assert int(state.step) == BAD - 1
    jax.tree.map(np.testing.assert_array_equal, _numpy(unshard_params(laid, state)), before)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(16)(x))


class _Deep(nn.Module):
    """The digit task's window model with two blocks of one shape (pipeline stages stack them)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Dense(16, name="inp")(jax.nn.one_hot(tokens, 11).reshape(tokens.shape[0], -1))
        for i in range(2):
            x = _Block(name=f"layers_{i}")(x)
        return nn.Dense(4 * 11, name="out")(x).reshape(x.shape[0], 4, 11)


def test_pipeline_skip_runs_in_the_one_step_program_as_the_plain_step():
    """A pipeline's step with check_finite='skip' keeps or drops the update inside its own jitted program (the
    compiled step returns metrics['nonfinite']: no second program holding a second state) and trains as the
    plain data-parallel step with the same check: the inf batch skipped, the other four applied."""
    from spmd.parallel import pipeline

    model = _Deep()
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    opt = optax.adam(1e-2)
    dp = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    pp = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    piped = pipeline(model, pp, units="layers_*", num_microbatches=2)
    step = make_train_step(piped, _loss(model), opt, check_finite="skip")
    plain = make_train_step(model, _loss(model), opt, mesh=dp, check_finite="skip")
    state = init_train_state(piped, opt, params=params)
    ref = init_train_state(model, opt, params=params, mesh=dp)
    assert "nonfinite" in step.compiled(state, batches[0]).out_info[1]  # the keep-or-drop is in the step's program
    flags = []
    for b in batches:
        state, m = step(state, b)
        ref, _ = plain(ref, b)
        flags.append(float(m["nonfinite"]))
    assert flags == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert int(state.step) == 5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                 _numpy(unshard_params(piped, state)), _numpy(unshard_params(model, ref)))


def test_pipeline_check_raises_naming_the_step():
    from spmd.parallel import pipeline

    model = _Deep()
    batches = _batches()
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    pp = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    piped = pipeline(model, pp, units="layers_*", num_microbatches=2)
    opt = optax.sgd(0.1)
    step = make_train_step(piped, _loss(model), opt, check_finite=True)
    state = init_train_state(piped, opt, params=params)
    with pytest.raises(FloatingPointError, match=re.escape(f"train_step: step {BAD} (from state.step={BAD - 1}) has "
                                                           "a non-finite loss (nan)")):
        for b in batches:
            before = _numpy(unshard_params(piped, state))
            state, _ = step(state, b)
    assert int(state.step) == BAD - 1
    jax.tree.map(np.testing.assert_array_equal, _numpy(unshard_params(piped, state)), before)


@pytest.mark.parametrize("value, exc", [("yes", ValueError), (1, TypeError), (None, TypeError)])
def test_check_finite_of_another_kind_is_refused(value, exc):
    model, laid, params, mesh = _setup("ddp")
    with pytest.raises(exc, match=re.escape(f"make_train_step: check_finite={value!r} must be False (no check), "
                                            "'skip'")):
        make_train_step(laid, _loss(model), optax.sgd(0.1), mesh=mesh, check_finite=value)


JOB = ["--model", "mlp", "--hidden", "16", "--steps", "6", "--batch-size", "16", "--length", "4", "--save-every", "2",
       "--log-every", "10", "--no-progress"]
JOB_BAD = 5


class _InfAt:
    """The job's task, with an inf in the mask of training step ``JOB_BAD``'s batch (its loss is NaN)."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def batch(self, seed, step, batch_size, layout="lm", **kw):
        b = self.task.batch(seed, step, batch_size, layout, **kw)
        if not kw and step + 1 == JOB_BAD:
            b = {**b, "mask": b["mask"].copy()}
            b["mask"][0, 0] = np.inf
        return b


@pytest.fixture
def inf_at_step(monkeypatch):
    import models.train._run as run_mod

    make = run_mod.make_task
    monkeypatch.setattr(run_mod, "make_task", lambda cfg: _InfAt(make(cfg)))


def _summary(out):
    import json

    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def test_the_job_stops_at_the_first_nonfinite_step_and_resumes_skipping_it(tmp_path, capsys, inf_at_step):
    out = str(tmp_path / "run")
    assert main([*JOB, "--out", out]) == 1
    err = capsys.readouterr().err
    ckpt = os.path.join(out, "checkpoints")
    assert sorted(int(n) for n in os.listdir(ckpt)) == [2, 4]  # nothing saved from the bad step on
    assert re.search(re.escape(f"error: models.train: step {JOB_BAD} has a non-finite loss (nan) or gradient norm ("),
                     err), err
    assert (f"the run stopped there and saved nothing from step {JOB_BAD} on. The last good checkpoint is step 4 in "
            f"{ckpt!r}; continue from it, skipping the update of such steps, with: python -m models.train --out {out} "
            "--resume --skip-nonfinite") in err
    assert not os.path.exists(os.path.join(out, "metrics.json"))
    # the advice works: the resume skips the bad step's update and finishes
    assert main(["--out", out, "--resume", "--skip-nonfinite", "--no-progress"]) == 0
    summary = _summary(out)
    assert summary["nonfinite_steps"] == [JOB_BAD] and summary["checkpoints"][-1] == 6
    assert "1 non-finite step skipped (step 5)" in capsys.readouterr().err
    assert all(np.isfinite(h["loss"]) for h in summary["history"] if h["step"] != JOB_BAD)


def test_skip_nonfinite_runs_through(tmp_path, inf_at_step):
    out = str(tmp_path / "run")
    assert main([*JOB, "--out", out, "--skip-nonfinite"]) == 0
    summary = _summary(out)
    assert summary["nonfinite_steps"] == [JOB_BAD] and summary["checkpoints"] == [2, 4, 6]
    assert [h["nonfinite"] for h in summary["history"]] == [0, 0, 0, 0, 1, 0]
    assert np.isfinite(summary["history"][-1]["loss"]) and np.isfinite(summary["final"]["eval_token_accuracy"])
