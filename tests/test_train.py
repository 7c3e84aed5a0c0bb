"""The training job end to end: outputs, options, bad inputs (in-process and as `python -m models.train`)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from models import CheckpointError
from models.train import Config, main, parse_args, run

TINY_T = ["--steps", "3", "--batch-size", "16", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
          "--log-every", "1", "--save-every", "2"]
TINY_M = ["--model", "mlp", "--hidden", "16", "--steps", "3", "--batch-size", "16", "--seq-len", "4", "--save-every", "2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outputs(out):
    with open(os.path.join(out, "metrics.json")) as f:
        summary = json.load(f)
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    with open(os.path.join(out, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return summary


def _check_accuracies(summary, tokens_per_example):
    """The held-out accuracies are counts over the eval set: a whole number of right tokens out of
    examples * tokens, a whole number of right sequences out of examples, and no more right
    sequences than the all-right tokens allow."""
    final, examples = summary["final"], summary["eval_examples"]
    tokens = examples * tokens_per_example
    if "eval_sequence_accuracy" not in final:  # a text run: no sequences to count (issue 21.4)
        right_tokens = final["eval_token_accuracy"] * tokens
        assert right_tokens == int(right_tokens) and right_tokens <= tokens, final
        return
    right_tokens, right_seqs = final["eval_token_accuracy"] * tokens, final["eval_sequence_accuracy"] * examples
    assert right_tokens == int(right_tokens) and right_seqs == int(right_seqs), final
    assert right_seqs * tokens_per_example <= right_tokens <= tokens, final


def test_job_as_a_module_sets_8_cpu_devices_itself(tmp_path):
    """The README command: no XLA_FLAGS given, the job asks for 8 CPU fake devices; progress bar and outputs."""
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WORLD_SIZE")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "models.train", *TINY_T, "--out", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples_s=" in proc.stderr and "loss=" in proc.stderr and "acc=" in proc.stderr  # the progress
    # stderr is a pipe here: whole progress lines, none glued to the header (issue 21.6)
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    header = [line for line in lines if "state bytes per device" in line]
    assert len(header) == 1 and header[0].startswith("models.train: transformer ("), proc.stderr
    assert any(line.startswith("models.train: step 3/3 loss=") for line in lines), proc.stderr
    assert "held-out token accuracy" in proc.stderr
    summary = _outputs(out)
    assert summary["devices"] == 8 and summary["mesh"] == {"dp": 8}
    assert [h["step"] for h in summary["history"]] == [1, 2, 3]
    assert summary["checkpoints"] == [2, 3]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]


@pytest.mark.parametrize("extra", [["--mesh", "dp=4", "--devices", "4"], ["--devices", "2", "--accum-steps", "2"],
                                   ["--task", "reverse"]])
def test_job_options(tmp_path, extra):
    out = str(tmp_path)
    assert main([*TINY_M, "--out", out, "--no-progress", *extra]) == 0
    summary = _outputs(out)
    dp = int(extra[extra.index("--devices") + 1]) if "--devices" in extra else 8  # --devices N alone: dp=N
    assert summary["mesh"] == {"dp": dp}
    assert summary["task"] == ("reverse 4 digits" if "reverse" in extra else "sort 4 digits")
    final = summary["final"]
    _check_accuracies(summary, tokens_per_example=4)
    assert final["train_loss"] == summary["history"][-1]["loss"]
    # 3 steps from a near-uniform start: the loss is still close to ln(vocab size = 10)
    assert abs(summary["history"][0]["loss"] - math.log(10)) < 0.5, summary["history"]


def _recomputed(summary):
    """(units, policy) of the activation checkpointing of the model the run's programs laid out, or None."""
    from models.train import build_mesh
    from models.train._programs import programs

    cfg = Config(**{k: v for k, v in summary["config"].items() if k in Config.__dataclass_fields__})
    remat = getattr(programs(cfg, build_mesh(cfg.mesh, cfg.devices)).layout, "remat", None)
    return None if remat is None else (remat.units, remat.policy)


@pytest.mark.parametrize("argv, policies, units, regathered", [
    # after fully_shard and parallelize_module; the qkv bias [3, heads 2 / tp 2, 16 / 2] padded to 4 rows (fsdp=2)
    ([*TINY_T, "--mesh", "fsdp=2,tp=2", "--devices", "4"], ("full", "dots"), ("block_*",), 4 * 1 * 8 * 4),
    ([*TINY_M, "--log-every", "1"], ("full",), ("hidden_*", "out"), 0),  # DDP: the plain model and the step's mesh
])
def test_activation_checkpointing_trains_as_without_it(tmp_path, argv, policies, units, regathered):
    """--activation-checkpointing recomputes the blocks (the model's fully_shard units) in the backward pass:
    the same per-step losses and data-parallel collectives as the run without it (``full`` runs the tp ones again),
    the flag recorded in metrics.json. Re-gathering
    FSDP units aside: without checkpointing their backward pass gathers again only the buffers a gradient reads,
    not the qkv bias (``regathered`` bytes gathered, one buffer a block); a recomputation reads it, gathered again."""
    runs = {}
    for ac in (None, *policies):
        out = str(tmp_path / str(ac))
        assert main([*argv, "--out", out, "--no-progress", *(["--activation-checkpointing", ac] if ac else [])]) == 0
        runs[ac] = _outputs(out)
    want = [h["loss"] for h in runs[None]["history"]]
    assert len(want) == 3 and want[-1] != want[0]  # the losses move: the comparison means something
    assert runs[None]["config"]["activation_checkpointing"] is None and _recomputed(runs[None]) is None
    for ac in policies:
        got = runs[ac]
        assert got["config"]["activation_checkpointing"] == ac
        assert _recomputed(got) == (units, ac)  # the flag reached the laid-out model: its blocks, its policy
        assert [h["loss"] for h in got["history"]] == pytest.approx(want, rel=0, abs=1e-6), ac
        same = json.loads(json.dumps(runs[None]["collectives"]))
        if regathered:  # the recomputation repeats no other data-parallel collective
            same["all-gather"]["count"] += 1  # --layers 1
            same["all-gather"]["bytes"] += regathered
            if ac == "full":  # torch's full AC: the block's attention all-reduce over tp again (its output, which
                # ln2's backward reads, is not kept), of its [8 rows, 8, 16] float32 activation
                same["all-reduce"]["count"] += 1
                same["all-reduce"]["bytes"] += 8 * 8 * 16 * 4
        assert got["collectives"] == same, ac


def test_job_on_a_text_file(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    out = str(tmp_path / "lm")
    assert main([*TINY_T, "--text", str(text), "--out", out, "--no-progress"]) == 0
    # every context window of a text is one "sequence": its share right means nothing, and is not printed
    err = capsys.readouterr().err
    assert "held-out token accuracy" in err and "sequence accuracy" not in err, err
    summary = _outputs(out)
    assert "eval_sequence_accuracy" not in summary["final"]
    assert summary["task"] == "text corpus.txt" and len(summary["history"]) == 3
    _check_accuracies(summary, tokens_per_example=8)  # next-byte accuracy on the held-out tenth


def test_cli_parses_every_option():
    cfg = parse_args(["--mesh", "dp=4", "--steps", "7", "--batch-size", "32", "--model", "mlp", "--text", "f.txt",
                      "--out", "o", "--resume", "--save-every", "3", "--seed", "5", "--accum-steps", "2"])
    assert cfg == Config(mesh="dp=4", steps=7, batch_size=32, model="mlp", text="f.txt", out="o", resume=True,
                         save_every=3, seed=5, accum_steps=2)


@pytest.mark.parametrize("argv,want", [
    (["--seq-len", "64"], {"length": 32, "context": 64}),  # 32 digits, then their answer: 64 tokens
    (["--model", "mlp", "--seq-len", "6"], {"length": 6, "context": 64}),  # the mlp's window of digits
    (["--text", "f.txt", "--seq-len", "128"], {"length": 8, "context": 128}),  # bytes of context
    ([], {"length": 8, "context": 64}),
])
def test_seq_len_is_the_tokens_per_example(argv, want):
    from models.train._programs import task_dims

    cfg = parse_args(argv)
    assert {"length": cfg.length, "context": cfg.context} == want
    assert task_dims(cfg)[1] == (int(argv[-1]) if argv else 16)


@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "63"], "argument --seq-len: 63 is odd; the digit task's sequence is its digits followed by their "
                          "answer, 2 x --length tokens: use an even --seq-len (e.g. 64)"),
    (["--seq-len", "0"], "argument --seq-len: 0 must be an int >= 1"),
    (["--seq-len", "8", "--length", "4"], "argument --seq-len: give the sequence length once (--seq-len 8, not with "
                                          "--length)"),
])
def test_bad_seq_len_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,exc,message", [
    (["--batch-size", "12"], ValueError,
     "models.train: --batch-size=12 is not divisible by the dp size 8; use a multiple of 8 (e.g. 8)."),
    (["--batch-size", "16", "--accum-steps", "4"], ValueError,
     "--batch-size=16 is not divisible by the dp size 8 times --accum-steps=4; use a multiple of 32"),
    (["--mesh", "xp=2"], ValueError,
     "models.train: --mesh='xp=2' names the mesh dim 'xp', which this job does not know; use the dims ('dp', "
     "'fsdp', 'tp', 'pp', 'cp', 'ep') (e.g. --mesh dp=N)."),
    (["--mesh", "dp=8", "--sequence-parallel"], ValueError,
     "models.train: --sequence-parallel cuts the sequence over the tp mesh dim, but --mesh='dp=8' has no tp dim of "
     "size >= 2; add one (e.g. --mesh dp=2,tp=4) or drop the flag."),
    (["--mesh", "dp=16"], ValueError,
     "models.train: --mesh='dp=16' needs 16 devices but only 8 cpu device(s) are visible; use --mesh dp=N with "
     "N <= 8, or set XLA_FLAGS=--xla_force_host_platform_device_count=16 before starting."),
    (["--mesh", "dp"], ValueError, "models.train: --mesh='dp' must look like 'dp=8' (name=size)."),
    (["--mesh", "dp=x"], ValueError, "models.train: --mesh='dp=x' gives dp size 'x', not an int"),
    (["--text", "/no/such/file.txt"], FileNotFoundError,
     "models.train: --text='/no/such/file.txt' does not exist or is not a file"),
    (["--steps", "0"], ValueError, "models.train: --steps=0 must be an int >= 1."),
    (["--d-model", "30"], ValueError, "models.train: --d-model=30 is not divisible by --heads=4"),
    # Silent acceptances and raw tracebacks found by the reliability pass (issue 10.11, 10.12).
    (["--lr", "inf"], ValueError, "models.train: --lr=inf must be a finite number > 0.0."),
    (["--lr", "nan"], ValueError, "models.train: --lr=nan must be a finite number > 0.0."),
    (["--lr", "0"], ValueError, "models.train: --lr=0.0 must be a finite number > 0.0."),
    (["--lr=-1e-3"], ValueError, "models.train: --lr=-0.001 must be a finite number > 0.0."),
    (["--clip-norm", "0"], ValueError, "models.train: --clip-norm=0.0 must be a finite number > 0.0."),
    (["--weight-decay=-0.1"], ValueError, "models.train: --weight-decay=-0.1 must be a finite number >= 0.0."),
    (["--lr-floor", "1.5"], ValueError, "models.train: --lr-floor=1.5 must be a finite number >= 0.0 and <= 1.0."),
    (["--mesh", "dp=2,dp=4"], ValueError,
     "models.train: --mesh='dp=2,dp=4' gives the mesh dim 'dp' twice; name each dim once (e.g. --mesh dp=4)."),
    (["--seed", "99999999999999999999"], ValueError,
     "models.train: --seed=99999999999999999999 must be an int in [0, 2**63 - 1]; e.g. --seed 0."),
    (["--seed=-1"], ValueError, "models.train: --seed=-1 must be an int in [0, 2**63 - 1]; e.g. --seed 0."),
    (["--seq-len", "200000"], ValueError,
     "models.train: --seq-len=200000 (tokens per example) needs at least 19,073.8 GiB per device for one "
     "train step (parameters, gradients, optimizer state and the logits and attention scores of 16 examples per "
     "device), more than the "),
    (["--eval-size", "100"], ValueError,
     "models.train: --eval-size=100 is not divisible by the dp size 8; use a multiple of 8 (e.g. 96)."),
    # a mesh of part of the devices is said, not run unsaid (issue 45.6)
    (["--mesh", "dp=2,fsdp=2"], ValueError,
     "models.train: --mesh='dp=2,fsdp=2' uses 4 devices but 8 cpu device(s) are visible; give a mesh of 8 devices "
     "(e.g. --mesh dp=4,fsdp=2), or --devices 4 to train on 4 of them."),
    (["--mesh", "dp=2", "--devices", "4"], ValueError,
     "models.train: --mesh='dp=2' uses 2 devices but --devices=4; give a mesh of 4 devices (e.g. --mesh dp=4), or "
     "--devices 2."),
    (["--devices", "16"], ValueError,
     "models.train: --devices=16 but only 8 cpu device(s) are visible; use --devices N with N <= 8, or leave "
     "--devices out to use them all."),
    (["--devices", "0"], ValueError, "models.train: --devices=0 must be an int >= 1."),
    (["--mesh", "auto", "--devices", "4"], ValueError,
     "models.train: --devices=4 with --mesh auto, which weighs the layouts of every visible device; drop --devices"),
])
def test_bad_inputs(tmp_path, capsys, argv, exc, message):
    cfg = parse_args([*argv, "--out", str(tmp_path)])
    with pytest.raises(exc, match=re.escape(message)):
        run(cfg)
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(os.path.join(tmp_path, "metrics.json"))


def test_refuses_to_replace_a_run_unless_told(tmp_path):
    out = str(tmp_path)
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 0
    with pytest.raises(ValueError, match=re.escape(f"models.train: --out={out!r} already holds checkpoints")):
        run(parse_args([*TINY_M, "--out", out]))
    assert main([*TINY_M, "--out", out, "--no-progress", "--overwrite", "--seed", "1"]) == 0
    assert _outputs(out)["config"]["seed"] == 1


def test_out_naming_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    message = (f"models.train: --out={str(path)!r} is a file, not a folder; give a folder for the run's outputs "
               "(it is created if missing).")
    with pytest.raises(ValueError, match=re.escape(message)):
        run(parse_args([*TINY_M, "--out", str(path)]))
    assert main([*TINY_M, "--out", str(path)]) == 2 and message in capsys.readouterr().err
    assert path.read_text() == "mine"


def test_hyper_parameters_reach_the_optimizer():
    """--lr, --warmup, --lr-floor, --clip-norm, --weight-decay against a NumPy AdamW with global-norm
    clipping on the warmup-cosine schedule (gradients alternating above and below the clip norm)."""
    import jax.numpy as jnp
    import numpy as np

    from models.train._programs import make_optimizer

    cfg = parse_args(["--steps", "20", "--warmup", "2", "--lr", "0.1", "--lr-floor", "0.25", "--clip-norm", "0.5",
                      "--weight-decay", "0.2"])
    assert (cfg.lr_floor, cfg.clip_norm, cfg.weight_decay) == (0.25, 0.5, 0.2)
    opt = make_optimizer(cfg)
    w = np.array([1.0, -2.0, 0.5, 3.0])
    params, state = {"w": jnp.asarray(w, jnp.float32)}, None
    state = opt.init(params)
    mu, nu = np.zeros(4), np.zeros(4)
    for t in range(22):
        g = np.array([3.0, -4.0, 0.0, 0.0]) * (1.0 if t % 2 else 0.01)  # norm 5 (clipped to 0.5) or 0.05
        updates, state = opt.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
        params = {"w": params["w"] + updates["w"]}
        g = g * min(1.0, 0.5 / np.linalg.norm(g))
        lr = 0.1 * t / 2 if t < 2 else 0.1 * (0.25 + 0.75 * 0.5 * (1 + np.cos(np.pi * min(t - 2, 18) / 18)))
        mu, nu = 0.9 * mu + 0.1 * g, 0.999 * nu + 0.001 * g * g
        step = (mu / (1 - 0.9 ** (t + 1))) / (np.sqrt(nu / (1 - 0.999 ** (t + 1))) + 1e-8) + 0.2 * w
        w = w - lr * step
        np.testing.assert_allclose(np.asarray(params["w"]), w, rtol=1e-4, atol=1e-5)  # float32 vs float64
    assert lr == 0.1 * 0.25  # the last steps ran at the floor


def test_a_second_run_into_the_same_out_is_refused_with_the_holders_pid(tmp_path, capsys):
    """The lock on --out (issue 10.2): a live holder's PID is named at once; it is gone after the holder is
    killed (no stale lock), and a finished run releases it."""
    out = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from models.train._outdir import RunLock; RunLock(sys.argv[1]).acquire(); "
         "print('locked', flush=True); sys.stdin.read()", out],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        from models.train import RunLockedError

        message = (f"models.train: --out={out!r} is in use by another run (PID {holder.pid}, lock "
                   f"{os.path.join(out, '.lock')!r}); wait for that run to end (or stop it), or choose another --out.")
        with pytest.raises(RunLockedError, match=re.escape(message)):
            run(parse_args([*TINY_M, "--out", out]))
        assert main([*TINY_M, "--out", out, "--no-progress"]) == 2 and message in capsys.readouterr().err
        assert sorted(os.listdir(out)) == [".lock"]  # nothing else written
    finally:
        holder.kill()  # SIGKILL: the OS drops the lock
        holder.wait(timeout=30)
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 0
    assert main([*TINY_M, "--out", out, "--no-progress", "--overwrite"]) == 0  # the first run released it


def test_a_run_without_checkpoints_is_not_replaced_silently(tmp_path):
    """Issue 10.10: checkpoints/ deleted, metrics.json and loss.png remain: a new run is refused, --resume
    says there is nothing to resume and points at --overwrite, --overwrite replaces the run."""
    out = str(tmp_path)
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 0
    shutil.rmtree(os.path.join(out, "checkpoints"))
    before = open(os.path.join(out, "metrics.json")).read()
    with pytest.raises(ValueError, match=re.escape(
            f"models.train: --out={out!r} already holds the outputs of a run (metrics.json, loss.png) but no finished "
            "checkpoint; pass --overwrite to replace it (there is nothing to --resume), or choose another --out.")):
        run(parse_args([*TINY_M, "--out", out]))
    with pytest.raises(CheckpointError, match=re.escape(
            "only the outputs of a run (metrics.json, loss.png); there is nothing to resume: pass --overwrite instead "
            "of --resume")):
        run(parse_args([*TINY_M, "--out", out, "--resume"]))
    assert open(os.path.join(out, "metrics.json")).read() == before
    assert main([*TINY_M, "--out", out, "--no-progress", "--overwrite", "--seed", "2"]) == 0
    assert _outputs(out)["config"]["seed"] == 2


def test_advice_after_a_kill_during_the_first_save_is_not_circular(tmp_path):
    """Issue 10.10: SIGKILL during the first save leaves only checkpoints/2.orbax-checkpoint-tmp; without
    flags the job points at --overwrite (not --resume), with --resume it points at --overwrite too."""
    out = str(tmp_path)
    tmp = os.path.join(out, "checkpoints", "2.orbax-checkpoint-tmp")
    os.makedirs(os.path.join(tmp, "state"))
    with pytest.raises(ValueError, match=re.escape(
            f"models.train: --out={out!r} already holds an unfinished checkpoint save (2.orbax-checkpoint-tmp: the "
            "run stopped while saving) but no finished checkpoint; pass --overwrite to replace it")) as plain:
        run(parse_args([*TINY_M, "--out", out]))
    with pytest.raises(CheckpointError, match=re.escape(
            "only an unfinished checkpoint save (2.orbax-checkpoint-tmp: the run stopped while saving); there is "
            "nothing to resume: pass --overwrite instead of --resume")) as resumed:
        run(parse_args([*TINY_M, "--out", out, "--resume"]))
    assert "pass --resume" not in str(plain.value) and "without --resume" not in str(resumed.value)
    assert main([*TINY_M, "--out", out, "--no-progress", "--overwrite"]) == 0
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_batch_split_over_every_data_dim_of_a_2d_mesh(model):
    """The batch layout comes from batch_placements over all data dims: on a (2, 4) mesh whose two dims are
    both data-parallel each device holds 1/8 of the batch, and the held-out accuracies equal a NumPy count
    over the whole batch (greedy generation for the transformer)."""
    import jax
    import numpy as np

    import spmd
    from models import batch_placements
    from models.train._eval import make_eval_step
    from models.train._programs import layout, make_model, make_task, place_batch

    cfg = parse_args(["--model", model, "--hidden", "16", "--layers", "1", "--d-model", "16", "--heads", "2",
                      "--length", "3"])
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))
    pl = batch_placements(mesh, ("dp", "fsdp"))
    assert pl == [spmd.Shard(0), spmd.Shard(0)]
    host = make_task(cfg).batch(0, 0, 32, layout(cfg), stream=1)
    placed = place_batch(host, mesh, pl)
    assert [t.shape for t in placed["inputs"].local_tensors()] == [(4, host["inputs"].shape[1])] * 8
    np.testing.assert_array_equal(np.asarray(placed["targets"].full_tensor()), host["targets"])

    net = make_model(cfg)
    params = net.init(jax.random.key(1), host["inputs"][:2])["params"]
    got = make_eval_step(net, mesh, ("dp", "fsdp"), digits=3 if model == "transformer" else None)(params, placed)
    if model == "transformer":  # greedy generation, one digit at a time, on the host
        buf, preds = host["inputs"].copy(), np.zeros((32, 3), np.int32)
        buf[:, 4:] = 0  # digits and SEP kept; 6 input positions
        for i in range(3):
            preds[:, i] = np.argmax(np.asarray(net.apply({"params": params}, buf))[:, 3 + i], -1)
            if 4 + i < buf.shape[1]:
                buf[:, 4 + i] = preds[:, i]
        right = preds == host["targets"][:, 3:]
    else:
        right = np.argmax(np.asarray(net.apply({"params": params}, host["inputs"])), -1) == host["targets"]
    np.testing.assert_allclose(float(got["token_accuracy"]), right.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(got["sequence_accuracy"]), right.all(axis=1).mean(), rtol=1e-6)


def test_importing_the_job_leaves_the_environment_alone():
    """Only the CLI entry point asks for 8 CPU devices; importing models.train (and its names) does not."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WORLD_SIZE")}
    code = ("import os, sys; from models.train import Config, run, restore_state, main; "
            "print(os.environ.get('XLA_FLAGS'), 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "True"], out.stderr[-2000:]
    from models.train._cli import default_cpu_devices

    environ = {"XLA_FLAGS": "--xla_cpu_foo"}
    assert default_cpu_devices(environ, modules={}) and environ["XLA_FLAGS"] == (
        "--xla_cpu_foo --xla_force_host_platform_device_count=8")
    for environ, modules in [({}, {"jax": None}), ({"WORLD_SIZE": "2"}, {}), ({"SPMD_DEVICES_PER_PROC": "4"}, {}),
                             ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, {})]:
        before = dict(environ)
        assert not default_cpu_devices(environ, modules) and environ == before


@pytest.mark.parametrize("mesh,need", [("dp=8", "8.5"), ("fsdp=8", "3.2"), ("dp=2,fsdp=4", "4.3")])
def test_a_state_too_large_for_the_devices_is_refused(mesh, need):
    """The MLP at --seq-len 100000 has 563M parameters: 4 copies (parameters, gradients, Adam's moments) per
    device, split over fsdp plus the largest parameter gathered whole with its gradient. Checked on the
    bound alone (run() would start allocating if the check regressed); 2.9 GiB stands for a device."""
    from models.train._programs import build_mesh, check_fits

    cfg = parse_args(["--model", "mlp", "--seq-len", "100000", "--mesh", mesh])
    with pytest.raises(ValueError, match=re.escape(
            f"models.train: --seq-len=100000 (tokens per example) needs at least {need} GiB per device for one "
            "train step (parameters, gradients, optimizer state and the logits of ")):
        check_fits(cfg, build_mesh(mesh), int(2.9 * 2**30))
    check_fits(parse_args(["--model", "mlp", "--mesh", mesh]), build_mesh(mesh), int(2.9 * 2**30))  # the default fits


def test_the_memory_floor_keeps_one_layers_attention_scores_under_full_recomputation():
    """The transformer at --seq-len 2000 keeps 2 layers x 16 examples x 4 heads x 2000^2 float32 attention scores
    (1.9 GiB per device); --activation-checkpointing full keeps one layer's at a time (fits 1.5 GiB), dots
    keeps every layer's (a matmul output), and the refusal names full as a fix."""
    from models.train._programs import build_mesh, check_fits

    mesh, memory = build_mesh("dp=8"), int(1.5 * 2**30)
    for ac in ([], ["--activation-checkpointing", "dots"]):
        with pytest.raises(ValueError, match=re.escape(
                "models.train: --seq-len=2000 (tokens per example) needs at least 1.9 GiB per device for one "
                "train step (parameters, gradients, optimizer state and the logits and attention scores of 16 "
                "examples per device), more than the 1.5 GiB a device has; use a smaller --seq-len, --batch-size, "
                "--layers or --d-model, or more --accum-steps (or --activation-checkpointing full).")):
            check_fits(parse_args(["--seq-len", "2000", *ac]), mesh, memory)
    check_fits(parse_args(["--seq-len", "2000", "--activation-checkpointing", "full"]), mesh, memory)


def test_out_of_device_memory_during_the_run_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """What the fit check cannot foresee: XLA's RESOURCE_EXHAUSTED becomes the job's ValueError (exit 2), the
    lock is released, and any other runtime error passes through unchanged."""
    import jax

    import models.train._run as job

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 44.1TiB.\nmore")

    monkeypatch.setattr(job, "train_loop", oom)
    out = str(tmp_path)
    message = ("models.train: the run does not fit in device memory (XLA: RESOURCE_EXHAUSTED: Out of memory while "
               "trying to allocate 44.1TiB.); the checkpoints saved so far are kept. Use a smaller --batch-size (or "
               "more --accum-steps), --seq-len or model, or a mesh that shards the state (--mesh fsdp=N).")
    with pytest.raises(ValueError, match=re.escape(message)):
        run(parse_args([*TINY_M, "--out", out, "--no-progress"]))
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 2 and message in capsys.readouterr().err

    def other(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(job, "train_loop", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        run(parse_args([*TINY_M, "--out", out, "--no-progress"]))


# --- the command line a newcomer types (issue 21.4, 21.6) ------------------------------------------
def _stop_at(k):
    def hook(step, state):
        if step == k:
            raise KeyboardInterrupt

    return hook


def test_resume_takes_the_runs_flags_and_reports_this_invocation(tmp_path, capsys):
    """--resume with no other flag continues the run as it was started (its model, sizes and steps come from
    the checkpoint), says where it resumed, and reports the steps it ran itself with a measured throughput."""
    out = str(tmp_path / "run")
    flags = [*TINY_M, "--steps", "8", "--seed", "3", "--out", out, "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        run(parse_args(flags), on_step=_stop_at(2))
    capsys.readouterr()
    assert main(["--resume", "--out", out, "--no-progress", "--log-every", "1"]) == 0
    err = capsys.readouterr().err
    assert f"models.train: resumed from step 2 (of 8) in {os.path.join(out, 'checkpoints')!r}" in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(r"models\.train: 6 steps \(steps 3-8\) in \d+\.\d s \([\d,]+ samples/s\); train loss ", last), last
    assert "nan" not in err
    summary = _outputs(out)
    assert summary["steps_run"] == 6 and summary["resumed_from"] == 2 and summary["steps"] == 8
    assert (summary["config"]["model"], summary["config"]["hidden"], summary["config"]["seed"]) == ("mlp", 16, 3)
    assert [h["step"] for h in summary["history"]] == list(range(1, 9))


def test_resume_takes_the_saved_mesh_unless_given(tmp_path, capsys):
    """The layout flags come from the checkpoint too, but a resume may change them (another mesh)."""
    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run(parse_args([*TINY_M, "--steps", "4", "--mesh", "dp=4", "--devices", "4", "--out", out, "--no-progress"]),
            on_step=_stop_at(2))
    assert main(["--resume", "--out", out, "--no-progress"]) == 0  # --mesh dp=4 --devices 4 from the checkpoint
    assert _outputs(out)["mesh"] == {"dp": 4}
    shutil.rmtree(os.path.join(out, "checkpoints", "4"))
    os.remove(os.path.join(out, "metrics.json"))
    assert main(["--resume", "--out", out, "--no-progress", "--mesh", "dp=2", "--devices", "2"]) == 0
    assert _outputs(out)["mesh"] == {"dp": 2}


def test_resume_refuses_a_flag_given_with_another_value(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 0
    capsys.readouterr()
    # the same value again is fine (and a finished run has nothing to do); another names both values
    assert main(["--resume", "--out", out, "--no-progress", "--model", "mlp", "--steps", "3"]) == 0
    assert main(["--resume", "--out", out, "--no-progress", "--steps", "6", "--hidden", "16"]) == 2
    assert (f"models.train: --resume continues the run in {os.path.join(out, 'checkpoints')!r} with its saved "
            "flags, but the command line gives --steps 6 where the run was saved with --steps 3; leave --steps out "
            "to continue that run, or start a new run in another --out.") in capsys.readouterr().err


def test_resume_of_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main([*TINY_M, "--out", out, "--no-progress"]) == 0
    before = _outputs(out)
    capsys.readouterr()
    assert main(["--resume", "--out", out]) == 0
    err = capsys.readouterr().err
    assert (f"models.train: the run in {out!r} is finished (step 3 of --steps 3); nothing to do. Its results are in "
            "metrics.json and loss.png there") in err, err
    assert "nan" not in err and "samples/s" not in err and "resumed from" not in err
    assert _outputs(out) == before  # left as the run wrote them


def test_help_names_every_parallelism(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Data-parallel training" not in text
    assert "data parallel (dp: DDP), fully sharded (fsdp: FSDP / ZeRO-3) and tensor parallel (tp: Megatron" in text


def test_progress_without_a_terminal_is_whole_lines():
    import io

    from models.train._loop import LineProgress, progress_bar

    stream = io.StringIO()
    bar = progress_bar(total=100, initial=40, desc="mlp dp=8", stream=stream)
    assert isinstance(bar, LineProgress)  # a StringIO is not a terminal
    for step in range(41, 101):
        bar.set_postfix(loss=f"{1 / step:.4f}", refresh=False)
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and stream.getvalue().endswith("\n")
    assert lines[0] == "models.train: step 46/100 loss=0.0217" and lines[-1] == "models.train: step 100/100 loss=0.0100"
    assert len(lines) == 10


def test_throughput_times_steps_alone_not_the_saves_between_them(monkeypatch):
    """Each step takes 1 s of the fake clock and each save 10 s: the timed windows (the first step, which
    compiles, left out) hold the steps alone, so the median step time is 1 s and the mean throughput the
    batch size per second."""
    import types

    import models.train._loop as loop

    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def train_step(state, batch):
        clock[0] += 1.0
        return state, {"loss": 1.0, "accuracy": 0.5}

    class Saves:
        save_every = 2

        def save(self, *a, **k):
            clock[0] += 10.0

    log = loop.MetricLog(start=0, batch_size=32, history=[])
    loop.train_loop(None, start=0, steps=9, log_every=3, train_step=train_step, next_batch=lambda s: None,
                    log=log, checkpointer=Saves(), meta=dict, on_step=None, interrupted=print)
    assert [h["step"] for h in log.history] == list(range(1, 10))
    assert log.step_s == 1.0 and log.samples_per_s == 32.0
    assert log.timed_windows == 6  # flushed after steps 2 (a save), 3 (log_every), 4, 6, 8 (saves), 9 (the end)


def test_a_ctrl_c_during_a_step_saves_the_state_that_step_returned():
    """The job's step donates the state it is passed (its buffers deleted): a Ctrl-C arriving while step 2 runs is
    held until the step has returned, then raised, and the loop saves step 2's state, not the deleted one it
    passed in (which it would have saved at step 1)."""
    import os
    import signal

    import models.train._loop as loop

    def train_step(state, batch):
        if state == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 2 runs
        return state + 1, {"loss": 1.0, "accuracy": 0.5}

    saved = []

    class Saves:
        save_every = 1000

        def save(self, step, state, meta, force=False):
            saved.append((step, state))

        def wait(self):
            pass

    log = loop.MetricLog(start=0, batch_size=32, history=[])
    stopped = []
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever a worker set
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.train_loop(0, start=0, steps=5, log_every=1, train_step=train_step, next_batch=lambda s: None,
                            log=log, checkpointer=Saves(), meta=dict, on_step=None, interrupted=stopped.append)
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, outer)
    assert saved == [(2, 2)] and stopped == [2] and [h["step"] for h in log.history] == [1, 2]
    assert handler is signal.default_int_handler  # Python's own handler back


def test_each_progress_line_carries_its_own_steps_metrics():
    """Lines every 6 steps of 60, metrics read every 10: each line still shows the metrics of the step it names
    (the loop reads them at a line's step), not those of the last read (issue 45.6)."""
    import io

    import models.train._loop as loop

    def train_step(state, batch):
        n = state + 1
        return n, {"loss": n / 1000, "accuracy": 0.5}

    class NoSaves:
        save_every = 1000

        def save(self, *a, **k):
            pass

    stream = io.StringIO()
    log = loop.MetricLog(start=0, batch_size=32, history=[], bar=loop.LineProgress(total=60, stream=stream))
    loop.train_loop(0, start=0, steps=60, log_every=10, train_step=train_step, next_batch=lambda s: None, log=log,
                    checkpointer=NoSaves(), meta=dict, on_step=None, interrupted=print)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    for line in lines:
        m = re.fullmatch(r"models\.train: step (\d+)/60 loss=(\S+) acc=0\.500( samples_s=\S+)?", line)
        step, loss = m.groups()[:2]
        assert loss == f"{int(step) / 1000:.4f}", line


@pytest.mark.parametrize("argv", [["--memory-budget", "-1GiB"], ["--memory-budget=-1GiB"], ["--memory-budget", "-1"]])
def test_a_negative_memory_budget_is_named(argv, capsys):
    """argparse took '-1GiB' for an option ('expected one argument'); the message names the flag, the value and the
    fix (issue 47)."""
    with pytest.raises(SystemExit):
        parse_args(["--mesh", "auto", *argv])
    value = argv[-1].split("=", 1)[-1]
    assert (f"error: argument --memory-budget: --memory-budget={value!r} is not a size in bytes; give a positive "
            "number with an optional unit B, KB, MB, GB, KiB, MiB, GiB (e.g. --memory-budget 2GiB).") in capsys.readouterr().err

