"""The job on cp and ep meshes: ``--model llama --mesh dp=2,cp=4``, ``--mesh dp=2,cp=4`` (the transformer's own
einsum attention, run on the sequence gathered over cp), ``--model moe --mesh dp=2,ep=4`` and ``--model moe
--moe-every 1 --mesh pp=2,ep=2,dp=2`` / ``pp=2,tp=2,ep=2`` (experts inside pipeline stages, with tp stages) train equal per step
to ``--mesh dp=8`` of the same model within 1e-5 (3 steps of AdamW, the job's own loss and data), their
metrics.json recording the ring's permutes, the gathers and the experts' all-to-alls; ``--mesh pp=2,fsdp=2,cp=2`` (the transformer's blocks in 2
pipeline stages, the sequence cut over cp inside them) equals ``--mesh dp=8`` per step too; meshes the job does not
offer (cp on the mlp, ep without experts) are refused by name."""

import json
import os
import re

import pytest

from models.train import Config, main
from models.train._config import check_config

TINY = ["--steps", "3", "--batch-size", "16", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16",
        "--log-every", "1", "--save-every", "3", "--no-progress"]


def _losses_and_collectives(tmp_path, argv):
    out = str(tmp_path / re.sub(r"\W", "_", " ".join(argv)))
    assert main([*TINY, *argv, "--out", out]) == 0
    with open(os.path.join(out, "metrics.json")) as f:
        summary = json.load(f)
    return [h["loss"] for h in summary["history"]], summary["collectives"]


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,kind", [("llama", "dp=2,cp=4", "collective-permute"),
                                             ("transformer", "dp=2,cp=4", "all-gather"),
                                             ("moe", "dp=2,ep=4", "all-to-all")])
def test_job_on_cp_and_ep_equals_dp8(tmp_path, model, mesh, kind):
    want, _ = _losses_and_collectives(tmp_path, ["--model", model, "--mesh", "dp=8"])
    got, collectives = _losses_and_collectives(tmp_path, ["--model", model, "--mesh", mesh])
    assert len(want) == 3 and want[-1] != want[0]  # the losses move: the comparison means something
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert collectives[kind]["count"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["pp=2,ep=2,dp=2", "pp=2,tp=2,ep=2"])
def test_job_moe_pipeline_with_experts_over_ep_equals_dp8(tmp_path, mesh):
    """``--model moe --moe-every 1 --mesh pp=2,ep=2,dp=2``: the blocks (experts in each) in 2 pipeline stages,
    their experts cut over ep inside the stages; ``pp=2,tp=2,ep=2``: the attention's projections over tp inside the
    stages too (``models._plans.decoder_tp_plan``); each equal per step to ``--mesh dp=8``, the compiled step's bytes
    of every kind (the experts' all-to-alls among them) equal to the pipeline's table."""
    moe = ["--model", "moe", "--moe-every", "1"]
    want, _ = _losses_and_collectives(tmp_path, [*moe, "--mesh", "dp=8"])
    out = str(tmp_path / "pp")
    assert main([*TINY, *moe, "--mesh", mesh, "--out", out]) == 0
    with open(os.path.join(out, "metrics.json")) as f:
        summary = json.load(f)
    got = [h["loss"] for h in summary["history"]]
    assert len(want) == 3 and want[-1] != want[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    # the drops each block sows in its stage reach the history (one scalar per unit and name)
    assert {k for k in summary["history"][0] if k.startswith("intermediates/")} == {
        f"intermediates/layers_{i}/mlp/{n}" for i in range(2) for n in ("dropped", "load_balancing")}
    pipe = summary["pipeline"]
    assert pipe["bytes_hlo"] == pipe["bytes_table"]
    assert pipe["bytes_table"]["all-to-all"] > 0 and summary["collectives"]["all-to-all"]["count"] > 0


@pytest.mark.slow
def test_job_pipeline_with_the_sequence_over_cp_equals_dp8(tmp_path):
    """``--mesh pp=2,fsdp=2,cp=2``: the transformer's blocks in 2 pipeline stages (cut over fsdp), the batch's
    sequence cut over cp inside them; equal per step to ``--mesh dp=8``, the pipeline's sends in the compiled step
    (the activations cut over cp) equal to the pipeline's table."""
    want, _ = _losses_and_collectives(tmp_path, ["--mesh", "dp=8"])
    out = str(tmp_path / "pp-cp")
    assert main([*TINY, "--mesh", "pp=2,fsdp=2,cp=2", "--out", out]) == 0
    with open(os.path.join(out, "metrics.json")) as f:
        summary = json.load(f)
    got = [h["loss"] for h in summary["history"]]
    assert len(want) == 3 and want[-1] != want[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    pipe = summary["pipeline"]
    assert pipe["bytes_hlo"]["collective-permute"] == pipe["bytes_table"]["collective-permute"] > 0


@pytest.mark.parametrize("model,mesh,message", [
    ("mlp", "dp=2,cp=4", "--model mlp reads a flat window of digits: use --model transformer, llama or moe"),
    ("llama", "dp=2,ep=4", "cuts experts over ep; --model llama has none: use --model moe"),
    ("moe", "pp=2,ep=2,dp=2", "--model moe with --moe-every=2 has blocks of two shapes (experts in one block of every 2); "
                              "pipeline stages stack blocks of one shape: give --moe-every 1"),
])
def test_meshes_the_job_does_not_offer_are_refused(model, mesh, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(Config(model=model, mesh=mesh))


@pytest.mark.slow
def test_job_scanned_moe_over_ep_equals_dp8(tmp_path):
    """``--model moe --moe-every 1 --scan-layers --mesh dp=2,ep=4``: the blocks as one nn.scan stack (experts
    ``layers.mlp.experts`` [L, E, d, f] cut over ep on their experts dim), equal per step to ``--mesh dp=8`` of the
    same scanned model within 1e-5; the compiled step exchanges both layers' tokens (dispatch and combine, forward
    and backward: 8 all-to-alls)."""
    moe = ["--model", "moe", "--moe-every", "1", "--scan-layers"]
    want, _ = _losses_and_collectives(tmp_path, [*moe, "--mesh", "dp=8"])
    got, collectives = _losses_and_collectives(tmp_path, [*moe, "--mesh", "dp=2,ep=4"])
    assert len(want) == 3 and want[-1] != want[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert collectives["all-to-all"]["count"] == 8


def test_the_scanned_model_is_the_scan_of_the_listed_one():
    """``--scan-layers`` gives the model its blocks as one nn.scan stack, laid out by the same plans on ``layers``."""
    from models._plans import decoder_tp_plan, shard_units
    from models.train._programs import make_model

    model = make_model(Config(model="moe", moe_every=1, scan_layers=True, layers=2, d_model=16, heads=2))
    assert model.cfg.scan_layers and shard_units(model) == ["layers"]
    assert "layers.self_attn.q_proj" in decoder_tp_plan(model)
    assert shard_units(make_model(Config(model="llama", layers=2, d_model=16, heads=2))) == ["layers_*"]


@pytest.mark.parametrize("model,moe_every,message", [
    ("transformer", 2, "--scan-layers stacks a decoder's blocks in one nn.scan; --model transformer has no such form: "
                       "use --model llama or moe, or drop --scan-layers"),
    ("moe", 2, "--scan-layers stacks blocks of one shape, but --model moe with --moe-every=2 has experts in one block "
               "of every 2: give --moe-every 1"),
])
def test_scan_layers_the_job_does_not_offer_is_refused(model, moe_every, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(Config(model=model, moe_every=moe_every, scan_layers=True))
