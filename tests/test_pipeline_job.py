"""The training job with a ``pp`` mesh dim: ``python -m models.train --mesh pp=2,fsdp=4 --schedule 1f1b`` (and ``pp=2,dp=2,tp=2``).

A short run gives the per-step losses of ``--mesh dp=8`` (same seed, same batches); ``metrics.json`` carries
the schedule, its bubble (formula and the idle ticks of the tick table the step compiled), the activation
stash measured from ``memory_analysis()`` (equal to the schedule's bound) and the compiled step's
temporaries; a run resumes with its saved pipeline flags. Bad pipeline flags are refused before any
compile, naming the flag, the value and the fix.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from models.train import Config, main, run
from models.train._config import SCHEDULES as JOB_SCHEDULES
from models.train._programs import task_dims
from spmd.parallel import build_schedule
from spmd.parallel.pipelining._schedules import SCHEDULES

# tiny: 2 blocks (one per stage), 4 rows per fsdp replica cut into 2 micro-batches
JOB = dict(steps=4, batch_size=16, layers=2, d_model=16, heads=2, length=4, save_every=2, log_every=1, eval_size=16,
           progress=False)
PP = dict(mesh="pp=2,fsdp=4", schedule="1f1b", microbatches=2)
GROUP = pytest.mark.xdist_group("pipeline-job")  # the cached runs on one worker


@functools.lru_cache(maxsize=None)
def _job(mesh: str, **flags) -> dict:
    out = tempfile.mkdtemp(prefix="pipeline_job_")
    summary = run(Config(mesh=mesh, out=out, **JOB, **flags))
    with open(os.path.join(out, "metrics.json")) as f:
        saved = json.load(f)
    return dict(summary=summary, saved=saved, out=out)


def _losses(summary):
    return [h["loss"] for h in summary["history"]]


@GROUP
def test_pp_fsdp_1f1b_job_equals_dp8():
    dp, pp = _job("dp=8"), _job(**PP)
    assert [h["step"] for h in pp["summary"]["history"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(_losses(pp["summary"]), _losses(dp["summary"]), rtol=0, atol=1e-5)
    assert _losses(dp["summary"])[-1] < _losses(dp["summary"])[0]  # the losses move: the comparison means something
    for k in ("eval_token_accuracy", "eval_sequence_accuracy"):
        assert pp["summary"]["final"][k] == pytest.approx(dp["summary"]["final"][k], abs=1e-6)
    assert pp["saved"]["mesh"] == {"pp": 2, "fsdp": 4}
    assert pp["saved"]["parameters"] == dp["saved"]["parameters"]  # the model's count, not the stacked stages'
    cfg = pp["saved"]["config"]
    assert (cfg["schedule"], cfg["microbatches"], cfg["stages_per_rank"]) == ("1f1b", 2, 1)


@GROUP
def test_pp_job_metrics_carry_the_schedule_bubble_and_memory():
    got = _job(**PP)["saved"]["pipeline"]
    pp, m = 2, 2
    s = build_schedule("1f1b", pp, m)
    widths = [max(len(acts) for acts in row) for row in s.ticks]  # F0.0 | F0.1, F1.0 | F1.1+B1.0 | B0.0, B1.1 | B0.1
    idle = sum(w - len(acts) for w, row in zip(widths, s.ticks) for acts in row)
    assert (got["schedule"], got["pp"], got["microbatches"], got["stages_per_rank"]) == ("1f1b", pp, m, 1)
    assert got["bubble_formula"] == (pp - 1) / (m + pp - 1)  # exactly the formula
    assert (got["ticks"], got["tick_units"], got["idle_rank_units"]) == (len(s.ticks), sum(widths), idle) == (5, 6, 4)
    assert got["bubble_measured"] == idle / (sum(widths) * pp) == pytest.approx(got["bubble_formula"], rel=1e-12)
    assert got["bubble_timed_lockstep"] == pytest.approx(got["bubble_formula"], rel=1e-12)
    seq_len = task_dims(Config(**JOB))[1]
    act = (16 // 4 // m) * seq_len * 16 * 4  # one micro-batch's (rows, T, D) float32
    assert got["activation_bytes"] == act
    assert got["activation_slots"] == max(s.x_slots) == min(2 * (pp - 1), m)
    assert got["activation_bound_bytes"] == (max(s.x_slots) + max(s.g_slots)) * act
    # the stash measured from memory_analysis() (spmd.parallel.pipelining._memory; the loop form at M = 2, 3 of
    # gpipe and this 1f1b's M = 2) is the bound to the byte; the job's own step's temp holds it and more
    assert got["activation_bytes_per_slot"] == act
    assert got["activation_measured_bytes"] == got["activation_bound_bytes"]
    assert got["activation_measure_compiles"] == 3
    assert got["peak_temp_bytes"] >= got["activation_bound_bytes"]
    assert got["transfers"] == {"forward": m * (pp - 1), "backward": m * (pp - 1)}
    coll = _job(**PP)["saved"]["collectives"]  # from the compiled step: one permute per micro-batch each way
    assert coll["collective-permute"] == {"count": 2 * m, "bytes": 2 * m * act}
    assert got["bytes_hlo"] == got["bytes_table"] and got["bytes_table"]["collective-permute"] == 2 * m * act


PP_TP = dict(mesh="pp=2,dp=2,tp=2", schedule="1f1b", microbatches=2)


def _stage_floats(d: int, fsdp: bool = False) -> int:
    """A device's tp=2 block of a pp=2 stage's parameters: one of JOB's 2 blocks (mlp_ratio 4): the 12 d x d of
    qkv, attn.proj, fc and fc_out halved; ln1's and ln2's 2 d and the row-parallel biases' d each, whole over tp;
    qkv's 3 d and fc's 4 d biases halved. ``fsdp``: the part cut over fsdp, without fc's bias (1-D and cut over
    tp: no dim left for fsdp)."""
    return 12 * d * d // 2 + (2 + 2 + 1 + 1) * d + (3 + (0 if fsdp else 4)) * d // 2


@GROUP
def test_pp_dp_tp_1f1b_job_equals_dp8():
    """pipeline(parallelize_module(model, mesh['tp'], plan), mesh['pp'], ...): the batch over dp only."""
    dp, pt = _job("dp=8"), _job(**PP_TP)
    assert [h["step"] for h in pt["summary"]["history"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(_losses(pt["summary"]), _losses(dp["summary"]), rtol=0, atol=1e-5)
    assert pt["saved"]["mesh"] == {"pp": 2, "dp": 2, "tp": 2}
    assert pt["saved"]["parameters"] == dp["saved"]["parameters"]
    got = pt["saved"]["pipeline"]
    assert (got["schedule"], got["pp"], got["microbatches"], got["stages_per_rank"]) == ("1f1b", 2, 2, 1)
    assert got["transfers"] == {"forward": 2, "backward": 2}
    assert got["activation_measured_bytes"] == got["activation_bound_bytes"]  # tp stages too: measured = bound
    # the compiled step: one permute per micro-batch each way, a whole (Megatron: replicated over tp) activation
    # of the dp replica's micro-batch; the tp terms' row-parallel all-reduces beside them (tests/test_pipeline_tp
    # checks those against the table exactly)
    m, seq_len = PP_TP["microbatches"], task_dims(Config(**JOB))[1]
    act = (16 // 2 // m) * seq_len * 16 * 4  # (rows of a dp=2 replica's micro-batch, T, D) float32
    coll = pt["saved"]["collectives"]
    assert coll["collective-permute"] == {"count": 2 * m, "bytes": 2 * m * act}
    assert got["bytes_hlo"] == got["bytes_table"]
    # all-reduced: the stage's gradients over dp, the others' over pp x dp (the embedding whole: tp=2 does not
    # divide the vocabulary; pos; ln_f); tp's (Megatron's, no vocabulary-parallel head) of a micro-batch's
    # activation, M times: F(first) 2 (attn.proj, fc_out), B(first) 2 - 1 + 2 (the recomputed fc_out's dead; the
    # qkv and fc input gradients), B(last) 2 + 2
    vocab, d = task_dims(Config(**JOB))[0], JOB["d_model"]
    assert vocab % 2 == 1  # the task's 11 tokens: transformer_tp_plan keeps the embedding whole
    rest = vocab * d + seq_len * d + 2 * d
    assert got["bytes_table"]["all-reduce"] == 4 * (_stage_floats(d) + rest) + m * (2 + (2 - 1 + 2) + (2 + 2)) * act


@GROUP
def test_pp_fsdp_tp_1f1b_job_equals_dp8():
    """pipeline(fully_shard(parallelize_module(model, mesh['tp'], plan), mesh=mesh['fsdp']), mesh['pp'], ...)."""
    dp, ft = _job("dp=8"), _job(mesh="pp=2,fsdp=2,tp=2", schedule="1f1b", microbatches=2)
    np.testing.assert_allclose(_losses(ft["summary"]), _losses(dp["summary"]), rtol=0, atol=1e-5)
    assert ft["saved"]["mesh"] == {"pp": 2, "fsdp": 2, "tp": 2}
    got = ft["saved"]["pipeline"]  # the stages gathered over fsdp once per step, their gradients cut once
    assert got["bytes_hlo"] == got["bytes_table"]
    # a device's tp block of its stage, gathered whole over fsdp (tp gathers none: Megatron, the embedding whole)
    assert got["bytes_table"]["all-gather"] == got["bytes_table"]["reduce-scatter"] == 4 * _stage_floats(
        JOB["d_model"], fsdp=True)


@GROUP
def test_4d_pp_dp_fsdp_tp_job_on_16_devices_equals_dp8(tmp_path):
    """The 4-D mesh pp=2,dp=2,fsdp=2,tp=2: a job in its own process with 16 CPU devices, the same losses."""
    flags = ["--mesh", "pp=2,dp=2,fsdp=2,tp=2", "--schedule", "1f1b", "--microbatches", "2", "--out", str(tmp_path),
             "--no-progress"]
    for k, v in JOB.items():
        if k != "progress":
            flags += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16 --xla_backend_optimization_level=0")
    out = subprocess.run([sys.executable, "-m", "models.train", *flags], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "metrics.json") as f:
        saved = json.load(f)
    assert saved["mesh"] == {"pp": 2, "dp": 2, "fsdp": 2, "tp": 2}
    np.testing.assert_allclose([h["loss"] for h in saved["history"]], _losses(_job("dp=8")["summary"]), rtol=0,
                               atol=1e-5)
    got = saved["pipeline"]
    assert got["bytes_hlo"] == got["bytes_table"]  # every kind, the 4-D terms of the table
    assert got["bytes_table"]["all-gather"] == got["bytes_table"]["reduce-scatter"] == 4 * _stage_floats(
        JOB["d_model"], fsdp=True)  # as on pp=2,fsdp=2,tp=2: dp does not change a device's stage block


@GROUP
def test_pp_job_resumes_with_its_saved_pipeline_flags(tmp_path):
    done = _job(**PP)
    out = str(tmp_path / "run")
    shutil.copytree(done["out"], out)
    shutil.rmtree(os.path.join(out, "checkpoints", "4"))
    assert main(["--resume", "--out", out, "--no-progress"]) == 0  # mesh and pipeline flags from the checkpoint
    with open(os.path.join(out, "metrics.json")) as f:
        again = json.load(f)
    assert again["resumed_from"] == 2 and again["mesh"] == {"pp": 2, "fsdp": 4}
    assert (again["config"]["schedule"], again["config"]["microbatches"]) == ("1f1b", 2)
    np.testing.assert_allclose(_losses(again), _losses(done["summary"]), rtol=0, atol=1e-6)


def test_job_schedules_are_spmds():
    assert JOB_SCHEDULES == SCHEDULES


@pytest.mark.parametrize("flags,message", [
    (dict(mesh="fsdp=8", schedule="1f1b"), "--schedule='1f1b' runs a pipeline over the pp mesh dim, but "
     "--mesh='fsdp=8' has no pp dim; add one (e.g. --mesh pp=2,fsdp=4) or drop --schedule."),
    (dict(mesh="dp=8", microbatches=4), "--microbatches=4 runs a pipeline over the pp mesh dim, but --mesh='dp=8' "
     "has no pp dim"),
    (dict(mesh="pp=2,fsdp=4", schedule="zero"), "--schedule='zero' is unknown; use one of gpipe, 1f1b, interleaved, looped_bfs."),
    (dict(mesh="pp=2,fsdp=4", microbatches=1), "--microbatches=1 is below pp=2; --schedule 1f1b needs at least one "
     "micro-batch per stage: use --microbatches >= 2."),
    (dict(mesh="pp=2,fsdp=4", microbatches=3, schedule="interleaved", stages_per_rank=2),
     "--microbatches=3 is not a multiple of pp=2; --schedule interleaved runs micro-batches in groups of pp: use "
     "--microbatches 4."),
    (dict(mesh="pp=2,fsdp=4", stages_per_rank=2), "--stages-per-rank=2 needs --schedule interleaved or looped_bfs (got '1f1b')"),
    (dict(mesh="pp=2,fsdp=4", schedule="interleaved", stages_per_rank=2, layers=3),
     "--layers=3 is fewer than the 4 pipeline stages (pp=2 x --stages-per-rank=2); use --layers >= 4"),
    (dict(mesh="pp=2,fsdp=4", model="mlp"), "--mesh='pp=2,fsdp=4' pipelines the transformer's blocks over pp, but --model='mlp'"),
    (dict(mesh="pp=2,dp=2,tp=2", batch_size=6), "--microbatches=2 does not divide the 3 examples each "
     "data-parallel replica runs per step (--batch-size=6 over the dp size 2); use --microbatches from [3] or a "
     "--batch-size that is a multiple of 4."),
    (dict(mesh="pp=2,fsdp=4", microbatches=3), "--microbatches=3 does not divide the 4 examples each data-parallel "
     "replica runs per step (--batch-size=16 over the fsdp size 4); use --microbatches from [2, 4] or a "
     "--batch-size that is a multiple of 12."),
])
def test_job_refuses_bad_pipeline_flags(tmp_path, flags, message):
    tiny = {**JOB, "layers": 4, **flags}
    with pytest.raises(ValueError, match=re.escape("models.train: " + message)):
        run(Config(out=str(tmp_path / "run"), **tiny))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")  # refused before anything ran


def test_cli_pipeline_flags_reach_the_config(capsys):
    from models.train import parse_args

    cfg = parse_args(["--mesh", "pp=2,fsdp=4", "--schedule", "interleaved", "--microbatches", "8",
                      "--stages-per-rank", "2"])
    assert (cfg.schedule, cfg.microbatches, cfg.stages_per_rank) == ("interleaved", 8, 2)
    assert main(["--mesh", "dp=8", "--schedule", "gpipe", "--out", "/nonexistent/never"]) == 2
    assert "--schedule='gpipe' runs a pipeline over the pp mesh dim" in capsys.readouterr().err
