"""The training job end to end: outputs, options, bad inputs (in-process and as `python -m models.train`)."""

import json
import os
import re
import subprocess
import sys

import pytest

from models.train import Config, main, parse_args, run

TINY_T = ["--steps", "3", "--batch-size", "16", "--layers", "1", "--d-model", "16", "--heads", "2", "--length", "4",
          "--log-every", "1", "--save-every", "2"]
TINY_M = ["--model", "mlp", "--hidden", "16", "--steps", "3", "--batch-size", "16", "--length", "4", "--save-every", "2"]
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
    right_tokens, right_seqs = final["eval_token_accuracy"] * tokens, final["eval_sequence_accuracy"] * examples
    assert right_tokens == int(right_tokens) and right_seqs == int(right_seqs), final
    assert 0 <= right_seqs * tokens_per_example <= right_tokens <= tokens, final


def test_job_as_a_module_sets_8_cpu_devices_itself(tmp_path):
    """The README command: no XLA_FLAGS given, the job asks for 8 CPU fake devices; progress bar and outputs."""
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "WORLD_SIZE")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "models.train", *TINY_T, "--out", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples_s=" in proc.stderr and "loss=" in proc.stderr and "acc=" in proc.stderr  # the tqdm bar
    assert "held-out token accuracy" in proc.stderr
    summary = _outputs(out)
    assert summary["devices"] == 8 and summary["mesh"] == {"dp": 8}
    assert [h["step"] for h in summary["history"]] == [1, 2, 3]
    assert summary["checkpoints"] == [2, 3]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]


@pytest.mark.parametrize("extra", [["--mesh", "dp=4"], ["--mesh", "dp=2", "--accum-steps", "2"], ["--task", "reverse"]])
def test_job_options(tmp_path, extra):
    out = str(tmp_path)
    assert main([*TINY_M, "--out", out, "--no-progress", *extra]) == 0
    summary = _outputs(out)
    dp = int(extra[1].split("=")[1]) if extra[0] == "--mesh" else 8
    assert summary["mesh"] == {"dp": dp}
    assert summary["task"] == ("reverse 4 digits" if "reverse" in extra else "sort 4 digits")
    final = summary["final"]
    _check_accuracies(summary, tokens_per_example=4)
    assert final["train_loss"] == summary["history"][-1]["loss"] > 0


def test_job_on_a_text_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    out = str(tmp_path / "lm")
    assert main([*TINY_T, "--text", str(text), "--context", "8", "--out", out, "--no-progress"]) == 0
    summary = _outputs(out)
    assert summary["task"] == "text corpus.txt" and len(summary["history"]) == 3
    _check_accuracies(summary, tokens_per_example=8)  # next-byte accuracy on the held-out tenth


def test_cli_parses_every_option():
    cfg = parse_args(["--mesh", "dp=4", "--steps", "7", "--batch-size", "32", "--model", "mlp", "--text", "f.txt",
                      "--out", "o", "--resume", "--save-every", "3", "--seed", "5", "--accum-steps", "2"])
    assert cfg == Config(mesh="dp=4", steps=7, batch_size=32, model="mlp", text="f.txt", out="o", resume=True,
                         save_every=3, seed=5, accum_steps=2)


@pytest.mark.parametrize("argv,exc,message", [
    (["--batch-size", "12"], ValueError,
     "models.train: --batch-size=12 is not divisible by the dp size 8; use a multiple of 8 (e.g. 8)."),
    (["--batch-size", "16", "--accum-steps", "4"], ValueError,
     "--batch-size=16 is not divisible by the dp size 8 times --accum-steps=4; use a multiple of 32"),
    (["--mesh", "tp=2"], ValueError,
     "models.train: --mesh='tp=2' names the mesh dim 'tp', which this job does not know; use the dims ('dp',) "
     "(e.g. --mesh dp=N)."),
    (["--mesh", "dp=16"], ValueError,
     "models.train: --mesh='dp=16' needs 16 devices but only 8 cpu device(s) are visible; use --mesh dp=N with "
     "N <= 8, or set XLA_FLAGS=--xla_force_host_platform_device_count=16 before starting."),
    (["--mesh", "dp"], ValueError, "models.train: --mesh='dp' must look like 'dp=8' (name=size)."),
    (["--mesh", "dp=x"], ValueError, "models.train: --mesh='dp=x' gives dp size 'x', not an int"),
    (["--text", "/no/such/file.txt"], FileNotFoundError,
     "models.train: --text='/no/such/file.txt' does not exist or is not a file"),
    (["--steps", "0"], ValueError, "models.train: --steps=0 must be an int >= 1."),
    (["--d-model", "30"], ValueError, "models.train: --d-model=30 is not divisible by --heads=4"),
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
