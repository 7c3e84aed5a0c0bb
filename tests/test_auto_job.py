"""The training job with ``--mesh auto``: ``spmd.parallel.auto_layout`` picks the layout, the job prints the
top 5 and why, runs the pick as its explicit flags and records predicted vs measured in ``metrics.json``.

One short auto run (module fixture) on a tiny transformer, ranked on a fixed calibration written into a
private calibration cache (so the ranking is the same on every machine and nothing is measured): its table,
its ``"layout"`` entry (the pick is the table's first row; the measured peak is the compiled step's
``memory_analysis``; the compiled step's collectives are the pick's table), its checkpoint's flags (a
resume reuses the pick), and its loss curve equal to the same job run with the pick's explicit flags.
``--memory-budget`` too small is the job's clear error; the flag rules are refused before any work.
Timings never decide a test: the measured step time is only checked to be there.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models._checkpoint import Checkpointer
from models.train import Config, main
from models.train._config import check_config, parse_bytes, resume_config
from spmd import DeviceMesh
from spmd.parallel import Calibration, hlo_executed_collectives
from spmd.parallel.cost._calibrate import VERSION

pytestmark = pytest.mark.xdist_group("auto-job")  # the module's runs share a calibration cache and programs

JOB = ["--steps", "6", "--batch-size", "32", "--layers", "2", "--d-model", "32", "--heads", "4", "--length", "4",
       "--log-every", "1", "--save-every", "3", "--eval-size", "32", "--no-progress"]
# a machine like this one's measurements (calibrate() on 8 CPU fake devices), fixed
CAL = Calibration(collectives={"all-gather": (7e-5, 1.5e9), "reduce-scatter": (1e-5, 4e8), "all-reduce": (1.8e-4, 6e8),
                               "collective-permute": (1e-5, 4e8)},
                  matmul_flops_per_s=1.1e10, elementwise_bytes_per_s=1.1e10, dispatch_s=9e-4, group_size=8)


def _main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


@functools.lru_cache(maxsize=None)
def _calibration_root() -> str:
    return tempfile.mkdtemp(prefix="spmd_calibration_")


# The module's expensive results are cached in the module, not only in module fixtures: xdist may run
# another module's test between two of this group's, and pytest then tears module fixtures down and
# builds them again (the auto run cost its ~55 s twice).
@pytest.fixture(scope="module")
def cache():
    """A calibration cache holding ``CAL`` for these devices (what ``calibrate()`` reads)."""
    root = _calibration_root()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPMD_CACHE_DIR", str(root))
        path = Calibration.cache_path(jax.devices())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"version": VERSION, "quick": False, "calibration": CAL.to_json()}, f)
        yield path


@functools.lru_cache(maxsize=None)
def _auto_run() -> dict:
    out = tempfile.mkdtemp(prefix="auto_job_")
    rc, err = _main(["--mesh", "auto", "--out", out, *JOB])
    assert rc == 0, err
    with open(os.path.join(out, "metrics.json")) as f:
        return dict(out=out, err=err, metrics=json.load(f))


@pytest.fixture(scope="module")
def auto(cache):
    return _auto_run()


def _rows(err: str) -> list[list[str]]:
    """The printed table's rows (after its header), split on runs of 2+ spaces."""
    lines = err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#  layout"))
    rows = []
    for line in lines[head + 1:]:
        if not re.match(r"\d+ ", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_auto_prints_the_top_5_and_why_the_pick_won(auto):
    err, layout = auto["err"], auto["metrics"]["layout"]
    n = int(re.search(r"auto_layout: (\d+) candidates ranked by predicted step time", err)[1])
    assert n == len(layout["candidates"]) > 5
    rows = _rows(err)
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"]
    assert [r[1] for r in rows] == [c["layout"] for c in layout["candidates"][:5]]
    pred = [float(r[2]) for r in rows]
    assert pred == sorted(pred) == [float(f"{c['predicted_ms']:.2f}") for c in layout["candidates"][:5]]
    assert f"pick: {layout['pick']}. {layout['why']}" in err
    assert f"picked {layout['pick']}: the same run as {layout['flags']}" in err
    assert re.search(rf"--mesh auto: {re.escape(layout['pick'])} predicted [\d.]+ ms/step and [\d.]+ MiB per device; "
                     r"measured [\d.]+ ms/step \(median of \d+ timed windows\) and [\d.]+ MiB", err)


def _compiled(cfg: Config, mesh: DeviceMesh):
    """The run's train step compiled for its (abstract) state and its batch, as the job compiles it."""
    from models.train._programs import layout, make_task, place_batch, programs, task_dims

    progs = programs(cfg, mesh)
    state = jax.eval_shape(progs.init, jax.random.key(0), jax.ShapeDtypeStruct((2, task_dims(cfg)[1]), jnp.int32))
    batch = place_batch(make_task(cfg).batch(cfg.seed, 0, cfg.batch_size, layout(cfg)), mesh, progs.batch_placements)
    return progs.train_step.lower(state, batch).compile()


def test_auto_metrics_layout_entry_is_the_pick_predicted_and_measured(auto):
    from models.train import build_mesh

    m = auto["metrics"]
    layout = m["layout"]
    first = layout["candidates"][0]
    assert layout["pick"] == first["layout"] == _rows(auto["err"])[0][1]
    assert first["fits"] and layout["memory_budget"] is None and layout["hardware"] is None
    # the run ran the pick: its config is the pick's flags, its mesh the pick's
    cfg = Config(**{k: v for k, v in m["config"].items() if k in Config.__dataclass_fields__})
    mesh_flag = shlex.split(layout["flags"])[1]
    assert cfg.mesh == mesh_flag and ",".join(f"{k}={v}" for k, v in m["mesh"].items()) == mesh_flag
    assert layout["pick"].split(" ")[0] == mesh_flag
    p, meas = layout["predicted"], layout["measured"]
    assert p["step_ms"] == pytest.approx(first["predicted_ms"]) and p["peak_bytes"] == first["peak_bytes"]
    # the measured step time is the one the run printed, a median over its timed windows
    assert meas["timed_windows"] >= 3
    assert f"measured {meas['step_ms']:.2f} ms/step (median of {meas['timed_windows']} timed windows)" in auto["err"]
    assert layout["measured_over_predicted"]["peak"] == pytest.approx(meas["peak_bytes"] / p["peak_bytes"])
    # the measured peak is the compiled step's memory_analysis (arguments + outputs + temporaries - aliased)
    compiled = _compiled(cfg, build_mesh(cfg.mesh))
    ma = compiled.memory_analysis()
    assert meas["peak_bytes"] == (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                                  - ma.alias_size_in_bytes)
    assert meas["argument"] == ma.argument_size_in_bytes and meas["temp"] == ma.temp_size_in_bytes
    # what the chooser costed is what ran: the compiled step moves the pick's bytes
    hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
    for kind, nbytes in first["bytes"].items():
        assert hlo[kind]["bytes"] == nbytes, (layout["pick"], kind, hlo[kind], nbytes)
    assert set(first["bytes"]) >= {"all-gather", "reduce-scatter", "all-reduce"}  # every kind was compared


def test_auto_checkpoint_records_the_pick_for_resume(auto):
    flags = shlex.split(auto["metrics"]["layout"]["flags"])
    checkpointer = Checkpointer(os.path.join(auto["out"], "checkpoints"))
    try:
        meta = checkpointer.restore_meta()
    finally:
        checkpointer.close()
    resumed = resume_config(meta["config"], Config(resume=True, out=auto["out"]), frozenset({"resume", "out"}),
                            auto["out"], meta["flags"])
    assert resumed.mesh == flags[1] == meta["flags"]["mesh"]
    want = {"sequence_parallel": "--sequence-parallel" in flags, "weight_stationary": "--weight-stationary" in flags,
            "reshard_after_forward": (False if "--no-reshard-after-forward" in flags else
                                      True if "--reshard-after-forward" in flags else None)}
    assert {k: getattr(resumed, k) for k in want} == want
    check_config(resumed)  # a resume of the pick is a valid explicit run


def test_auto_losses_equal_the_explicit_flags_of_its_pick(auto, tmp_path):
    rc, err = _main([*shlex.split(auto["metrics"]["layout"]["flags"]), "--out", str(tmp_path), *JOB])
    assert rc == 0, err
    with open(tmp_path / "metrics.json") as f:
        explicit = json.load(f)
    assert "layout" not in explicit and "auto_layout" not in err
    got = [h["loss"] for h in auto["metrics"]["history"]]
    want = [h["loss"] for h in explicit["history"]]
    assert len(got) == 6 and got[-1] < got[0]  # the losses move: the comparison means something
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert explicit["collectives"] == auto["metrics"]["collectives"]


def test_weight_stationary_job_moves_the_chooser_bytes_and_trains_equal(auto, tmp_path):
    """The job's --weight-stationary is the chooser's ws layout: the compiled step moves that candidate's bytes,
    and it trains as the pick does."""
    rc, err = _main(["--mesh", "dp=2,tp=4", "--weight-stationary", "--out", str(tmp_path), *JOB])
    assert rc == 0, err
    with open(tmp_path / "metrics.json") as f:
        ws = json.load(f)
    from models.train import build_mesh

    row = next(c for c in auto["metrics"]["layout"]["candidates"] if c["layout"] == "dp=2,tp=4 ws")
    cfg = Config(**{k: v for k, v in ws["config"].items() if k in Config.__dataclass_fields__})
    assert cfg.weight_stationary and ws["mesh"] == {"dp": 2, "tp": 4}
    hlo = hlo_executed_collectives(_compiled(cfg, build_mesh(cfg.mesh)).as_text(), scalars=False)
    assert {k: hlo[k]["bytes"] for k in row["bytes"]} == row["bytes"] and row["bytes"]["all-gather"] > 0
    np.testing.assert_allclose([h["loss"] for h in ws["history"]], [h["loss"] for h in auto["metrics"]["history"]],
                               rtol=0, atol=1e-5)


def test_auto_memory_budget_no_layout_fits_is_a_clear_error(cache, tmp_path):
    rc, err = _main(["--mesh", "auto", "--memory-budget", "1KiB", "--model", "mlp", "--hidden", "32",
                     "--out", str(tmp_path), *JOB])
    assert rc == 2
    # below the state's bytes over the 8 devices: refused before any layout is weighed
    assert "error: models.train: --memory-budget=1,024 B (0.00 MiB) per device fits no layout --mesh auto weighs: " \
           "no layout fits memory_budget_bytes=1,024: the state alone, the parameters (" in err
    assert re.search(r"needs at least ([\d,]+) B per device even cut over all 8 devices; give a budget above \1 B", err)
    assert not os.path.exists(tmp_path / "metrics.json")


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "auto", "--sequence-parallel"], "--sequence-parallel=True fixes part of the layout, which --mesh auto "
                                                "chooses itself"),
    (["--mesh", "auto", "--schedule", "1f1b"], "--schedule='1f1b' fixes part of the layout"),
    (["--mesh", "dp=8", "--memory-budget", "2GiB"], "--memory-budget=2147483648 bounds the layout --mesh auto picks, "
                                                    "but --mesh='dp=8' is explicit; use --mesh auto"),
    (["--mesh", "dp=8", "--weight-stationary"], "--weight-stationary cuts the weights (the activations on the batch) "
                                                "over the tp mesh dim, but --mesh='dp=8' has no tp dim"),
    (["--mesh", "dp=2,tp=4", "--weight-stationary", "--sequence-parallel"], "give one of them"),
    (["--mesh", "dp=8", "--no-reshard-after-forward"], "--no-reshard-after-forward says when fully_shard gathers the "
                                                       "units again, but --mesh='dp=8' has no fsdp dim"),
    (["--mesh", "auto", "--activation-checkpointing", "full"],
     "--activation-checkpointing='full' fixes part of the layout, which --mesh auto chooses itself (the pipeline's "
     "schedule too); drop --activation-checkpointing, or give the layout yourself with an explicit --mesh"),
    (["--mesh", "pp=2,fsdp=4", "--activation-checkpointing", "dots"],
     "--activation-checkpointing='dots' with --mesh='pp=2,fsdp=4': a pipeline's backward pass already recomputes "
     "each stage from its stashed input; drop --activation-checkpointing, or use a mesh without pp"),
])
def test_auto_and_layout_flags_are_refused_naming_the_flag(argv, message, capsys):
    assert main([*argv, "--out", "/nonexistent/never"]) == 2
    assert message in capsys.readouterr().err


def test_activation_checkpointing_policies_are_spmds_and_others_are_refused(tmp_path, capsys):
    from models.train import run
    from models.train._config import CHECKPOINTING
    from spmd.parallel.styles._remat import POLICIES

    assert CHECKPOINTING == tuple(POLICIES)
    with pytest.raises(SystemExit):
        main(["--activation-checkpointing", "some", "--out", "/nonexistent/never"])
    assert "argument --activation-checkpointing: invalid choice: 'some' (choose from" in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape("models.train: --activation-checkpointing='some' is not a policy; "
                                                   "use one of full, dots, selective, minimal, save_dot_except_mlp, "
                                                   "save_dot_except_mlpwi, save_qkv_proj, offload, or leave the flag out")):
        run(Config(activation_checkpointing="some", out=str(tmp_path / "run")))
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("lay, flags", [
    (dict(fsdp=8, activation_checkpointing="full"), "--mesh fsdp=8 --activation-checkpointing full"),
    (dict(dp=2, fsdp=4, reshard_after_forward=False, activation_checkpointing="dots"),
     "--mesh dp=2,fsdp=4 --no-reshard-after-forward --activation-checkpointing dots"),
    (dict(dp=8, activation_checkpointing="full"), "--mesh dp=8 --activation-checkpointing full"),
])
def test_a_recomputing_pick_runs_as_its_explicit_flags(lay, flags):
    """A layout auto_layout picks with activation_checkpointing becomes --activation-checkpointing; those flags
    typed by hand are that config again."""
    from models.train import parse_args
    from models.train._auto import layout_config, layout_flags
    from models.train._programs import make_model
    from spmd.parallel import Layout

    cfg = Config(steps=6, batch_size=32, layers=2, d_model=32, heads=4, length=4)
    picked = layout_config(cfg, Layout(units=("block_*",), **lay), make_model(cfg))
    assert picked.activation_checkpointing == lay["activation_checkpointing"]
    assert layout_flags(picked) == flags
    check_config(picked)  # the job takes it as an explicit run
    typed = parse_args([*shlex.split(flags), "--steps", "6", "--batch-size", "32", "--layers", "2", "--d-model", "32",
                        "--heads", "4", "--length", "4"])
    assert typed == picked


def test_resume_keeps_the_saved_activation_checkpointing_unless_the_mesh_cannot_take_it():
    """A checkpoint records --activation-checkpointing (job_flags); a resume without it keeps it, with another
    value takes that one, and with a --mesh that refuses it (a pp dim, auto) drops it."""
    from models.train._config import job_flags

    saved = Config(mesh="fsdp=8", activation_checkpointing="full", out="o")
    flags = job_flags(saved)
    assert flags["activation_checkpointing"] == "full"

    def resumed(**given):
        cfg = Config(resume=True, out="o", **given)
        return resume_config({}, cfg, frozenset({"resume", "out", *given}), "o", flags)

    assert (resumed().mesh, resumed().activation_checkpointing) == ("fsdp=8", "full")
    assert resumed(activation_checkpointing="dots").activation_checkpointing == "dots"
    assert resumed(mesh="dp=2,tp=4").activation_checkpointing == "full"
    for mesh in ("pp=2,fsdp=4", "auto"):
        again = resumed(mesh=mesh)
        assert again.activation_checkpointing is None, mesh
        check_config(again)


def test_memory_budget_sizes(capsys):
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match=re.escape("--memory-budget='lots' is not a size in bytes; give a positive "
                                                   "number with an optional unit")):
        parse_bytes("lots")
    with pytest.raises(SystemExit):
        main(["--mesh", "auto", "--memory-budget=0B"])
    assert "argument --memory-budget: --memory-budget='0B' is not a size in bytes" in capsys.readouterr().err


def test_a_pipelined_pick_runs_as_the_explicit_pipeline_flags(auto):
    """--mesh auto weighs the pipelines too; a pipelined pick becomes --mesh pp=... --schedule --microbatches."""
    from models.train._auto import layout_config, layout_flags
    from models.train._programs import make_model
    from spmd.parallel import Layout

    rows = [c for c in auto["metrics"]["layout"]["candidates"] if c["layout"].startswith("pp=2,")]
    assert {r["layout"] for r in rows} >= {"pp=2,dp=4 1f1b M=2", "pp=2,fsdp=4 1f1b M=4"}
    cfg = Config(**{k: v for k, v in auto["metrics"]["config"].items() if k in Config.__dataclass_fields__})
    from models.train._programs import layout as task_layout
    from models.train._programs import make_task

    seq = make_task(cfg).batch(cfg.seed, 0, cfg.batch_size, task_layout(cfg))["inputs"].shape[1]
    for r in rows:  # M micro-batches x one boundary x both ways: a replica's rows of [T, d_model] float32, twice
        if r["layout"].split()[0] in ("pp=2,dp=4", "pp=2,fsdp=4", "pp=2,dp=2,fsdp=2"):
            assert r["bytes"]["collective-permute"] == 2 * (32 // 4) * seq * 32 * 4, r
    lay = Layout(pp=2, fsdp=4, units=("block_*",), reshard_after_forward=False, microbatches=4,
                 schedule="interleaved", stages_per_rank=1)
    picked = layout_config(cfg, lay, make_model(cfg))
    assert (picked.mesh, picked.schedule, picked.microbatches, picked.reshard_after_forward) == \
        ("pp=2,fsdp=4", "interleaved", 4, None)
    assert layout_flags(picked) == "--mesh pp=2,fsdp=4 --schedule interleaved --microbatches 4"
    check_config(picked)  # the job takes it as an explicit run


class _Ranked(Exception):
    """Raised by the stubbed ``auto_layout`` with the keyword arguments the job gave it."""


@pytest.mark.parametrize("measured", [True, False])
def test_auto_times_the_top_3_on_a_measured_calibration(monkeypatch, measured):
    """On a measured calibration (a real machine) and one process the job asks ``auto_layout`` to compile
    and time its top 3 before picking (``measure=3``); on a hand-built one (these tests) it ranks by the
    prediction alone, deterministically."""
    import dataclasses

    import models.train._auto as job

    def stub(*args, **kwargs):
        raise _Ranked(kwargs)

    monkeypatch.setattr(job, "calibrate", lambda devices: dataclasses.replace(CAL, measured=measured))
    monkeypatch.setattr(job, "auto_layout", stub)
    cfg = Config(mesh="auto", steps=6, batch_size=32, layers=2, d_model=32, heads=4, length=4)
    with pytest.raises(_Ranked) as e:
        job.choose_layout(cfg, lead=False)
    assert e.value.args[0]["measure"] == (job.MEASURE if measured else 0) and job.MEASURE == 3


def test_hardware_plans_for_a_built_in_without_calibrating_this_machine(monkeypatch, capsys):
    """``--hardware h100``: ``auto_layout(hardware="h100")``, no calibration made or read and nothing timed
    (``measure=0``); the names are ``spmd.parallel.HARDWARE``'s, and an explicit mesh refuses the flag."""
    import models.train._auto as job
    from models.train._cli import parse_args
    from models.train._config import HARDWARE as JOB_HARDWARE
    from spmd.parallel import HARDWARE

    def stub(*args, **kwargs):
        raise _Ranked(kwargs)

    def refuse(devices):
        raise AssertionError("calibrated under --hardware")

    monkeypatch.setattr(job, "calibrate", refuse)
    monkeypatch.setattr(job, "auto_layout", stub)
    cfg = parse_args(["--mesh", "auto", "--hardware", "h100", "--steps", "6", "--batch-size", "32", "--layers", "2",
                      "--d-model", "32", "--heads", "4", "--length", "4"])
    with pytest.raises(_Ranked) as e:
        job.choose_layout(cfg, lead=False)
    got = e.value.args[0]
    assert (got["hardware"], got["calibration"], got["measure"], got["memory_budget_bytes"]) == ("h100", None, 0, None)
    assert JOB_HARDWARE == tuple(sorted(HARDWARE))
    assert main(["--mesh", "dp=8", "--hardware", "h100", "--out", "/nonexistent/never"]) == 2
    assert "--hardware='h100' is the hardware --mesh auto plans for, but --mesh='dp=8' is explicit; use --mesh auto " \
           "or drop --hardware." in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--mesh", "auto", "--hardware", "h9000"])
    assert "invalid choice: 'h9000' (choose from 'a100-80g', 'h100', 'h200', 'tpu-v5p')" in capsys.readouterr().err
