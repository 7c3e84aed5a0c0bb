"""A pipelined run's checkpoint restores across pp layouts, bit for bit.

``--mesh pp=2,fsdp=4`` saves the model's own (unstacked) parameters and optimizer state, laid out like any
layout's; it restores onto ``fsdp=8`` and onto 1 device (and from ``fsdp=8`` onto 1 device again) with every
value equal to the pipelined run's own state, unstacked; a ``fsdp=8`` checkpoint restores onto
``pp=2,fsdp=4`` stacked per stage; ``--resume`` changes the mesh either way and continues the per-step
losses of the uninterrupted run.
"""

from __future__ import annotations

import os
import re
import shutil

import jax
import numpy as np
import pytest

import spmd
from models._checkpoint import Checkpointer
from models._fsdp_run import layout_meta, logical_state, restore_job_state, restore_resharded
from models.train import Config, restore_state, run
from models.train._config import parse_mesh
from models.train._programs import build_mesh, programs, task_dims
from spmd.parallel import path_str

# tiny: 2 blocks (one per stage), 4 rows per fsdp replica cut into 2 micro-batches
JOB = dict(steps=4, batch_size=16, layers=2, d_model=16, heads=2, length=4, save_every=2, log_every=1, eval_size=16,
           progress=False)
PP = dict(mesh="pp=2,fsdp=4", schedule="1f1b", microbatches=2)
pytestmark = pytest.mark.xdist_group("pipeline-checkpoint")  # the module's runs compile once, on one worker


def _mesh(shape, names):
    return spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _run(out: str, **flags) -> dict:
    """A run of ``JOB`` into ``out``, with its final state as the step loop held it."""
    last = {}
    summary = run(Config(out=out, **JOB, **flags), on_step=lambda step, state: last.update(state=state))
    progs = programs(Config(**JOB, **flags), build_mesh(flags["mesh"]))
    return dict(out=out, summary=summary, state=last["state"], progs=progs)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    got = _run(str(tmp_path_factory.mktemp("pp") / "run"), **PP)
    progs = got["progs"]
    got["own"] = jax.device_get(progs.layout.unstack_state(got["state"], progs.optimizer))
    return got


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("fsdp") / "run"), mesh="fsdp=8")


def _leaves(tree) -> dict:
    return {path_str(kp): np.asarray(x) for kp, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def _same(got, want) -> None:
    """Every leaf of ``got`` (params and opt_state) equal to ``want``'s, bit for bit, path by path."""
    a, b = _leaves((got.step, got.params, got.opt_state)), _leaves((want.step, want.params, want.opt_state))
    assert sorted(a) == sorted(b)
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def _losses(summary) -> list[float]:
    return [h["loss"] for h in summary["history"]]


def test_pipelined_checkpoint_holds_the_models_own_tree(pp_run):
    """The saved tree is the model's (block_0/..., embed/...), its values the stacked stages' rows."""
    with Checkpointer(os.path.join(pp_run["out"], "checkpoints")) as ckpt:
        meta = ckpt.restore_meta(4)
    own_paths = set(_leaves(pp_run["own"].params))
    assert set(meta["layout"]["shapes"]) == own_paths and meta["layout"]["mesh"] == {"pp": 2, "fsdp": 4}
    assert {p.split("/")[0] for p in own_paths} >= {"block_0", "block_1", "embed", "pos"}
    # the unstacked values, read straight from the stacked arrays: stages/<name>[i] is block_i/<name>
    stacked = _leaves((pp_run["state"].params, pp_run["state"].opt_state))
    own = _leaves((pp_run["own"].params, pp_run["own"].opt_state))
    tops = {p.split("/")[0] for p in own_paths}  # the model's top-level names
    for path, x in own.items():
        m = re.fullmatch(r"(.*?)block_(\d+)/(.*)", path)
        if m:
            row = stacked[f"{m[1]}stages/{m[3]}"][int(m[2])]
        elif path in stacked:  # the optimizer's step counts
            row = stacked[path]
        else:
            parts = path.split("/")
            i = next(i for i, c in enumerate(parts) if c in tops)
            row = stacked["/".join(parts[:i] + ["rest"] + parts[i:])]
        np.testing.assert_array_equal(x, row, err_msg=path)
    assert len(own) > len(stacked)  # each stacked array is two blocks' arrays
    # the parameters agree with the pipeline's own unshard_params
    for a, b in zip(jax.tree.leaves(pp_run["own"].params),
                    jax.tree.leaves(jax.device_get(pp_run["progs"].logical(pp_run["state"].params))), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pipelined_checkpoint_restores_on_fsdp8_then_one_device_bitwise(pp_run, tmp_path):
    fsdp8, one = build_mesh("fsdp=8"), _mesh((1,), ("dp",))
    on_fsdp8, meta = restore_state(pp_run["out"], mesh=fsdp8)
    assert on_fsdp8.plan == programs(Config(**JOB, mesh="fsdp=8"), fsdp8).plan  # laid out as the fsdp=8 job is
    assert meta["history"] == pp_run["summary"]["history"]
    opt = pp_run["progs"].optimizer
    _same(logical_state(on_fsdp8, fsdp8, opt), pp_run["own"])
    # saved again by the fsdp=8 layout, restored on 1 device
    ckpt = Checkpointer(tmp_path / "fsdp8")
    ckpt.save(4, on_fsdp8, {"layout": layout_meta(on_fsdp8.plan)}, force=True)
    ckpt.close()
    target = jax.eval_shape(programs(Config(**JOB), one).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((2, task_dims(Config(**JOB))[1]), np.int32))
    on_one, _ = restore_resharded(Checkpointer(tmp_path / "fsdp8"), target, one, opt)
    _same(on_one, pp_run["own"])
    direct, _ = restore_state(pp_run["out"], mesh=one)  # and straight from the pipelined checkpoint
    _same(direct, pp_run["own"])


def test_pipelined_checkpoint_restores_on_its_own_layout(pp_run):
    mesh = build_mesh(PP["mesh"])
    state, _ = restore_state(pp_run["out"], mesh=mesh)  # stacked again, with the run's saved pipeline flags
    assert state.plan == pp_run["state"].plan
    _same(state, pp_run["state"])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(pp_run["state"]), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def test_a_checkpoint_of_the_stacked_stages_restores_on_its_own_layout(pp_run, tmp_path):
    """A checkpoint holding the stacked stages themselves (as pipelined runs saved before they saved the
    model's own tree) restores onto the layout that stored them."""
    state, progs = pp_run["state"], pp_run["progs"]
    ckpt = Checkpointer(tmp_path / "stacked")
    ckpt.save(4, state, {"layout": layout_meta(state.plan)}, force=True)
    ckpt.close()
    got, _ = restore_job_state(Checkpointer(tmp_path / "stacked"), state, state.plan, build_mesh(PP["mesh"]),
                               progs.optimizer, progs.layout)
    _same(got, state)


def test_fsdp8_checkpoint_restores_on_pp2_fsdp4_bitwise(fsdp_run, pp_run):
    mesh = build_mesh(PP["mesh"])
    on_pp, _ = restore_state(fsdp_run["out"], mesh=mesh)
    assert on_pp.plan == pp_run["state"].plan  # the stacked stages, as the pipelined job lays them out
    opt = fsdp_run["progs"].optimizer
    want = logical_state(fsdp_run["state"], build_mesh("fsdp=8"), opt)
    _same(pp_run["progs"].layout.unstack_state(on_pp, opt), want)


def test_resume_changes_the_mesh_to_and_from_the_pipeline(fsdp_run, pp_run, tmp_path):
    """fsdp=8 saved at step 2 resumes on pp=2,fsdp=4, and pp=2,fsdp=4 on fsdp=8: the uninterrupted losses."""
    want = _losses(fsdp_run["summary"])
    np.testing.assert_allclose(_losses(pp_run["summary"]), want, rtol=0, atol=1e-5)
    assert want[-1] < want[0]  # the losses move: the comparison means something
    for done, flags in ((fsdp_run, PP), (pp_run, dict(mesh="fsdp=8"))):
        out = str(tmp_path / flags["mesh"])
        shutil.copytree(done["out"], out)
        shutil.rmtree(os.path.join(out, "checkpoints", "4"))
        again = run(Config(out=out, resume=True, **JOB, **flags))
        assert again["resumed_from"] == 2 and again["mesh"] == dict(parse_mesh(flags["mesh"]))
        assert [h["step"] for h in again["history"]] == [1, 2, 3, 4]
        np.testing.assert_allclose(_losses(again), want, rtol=0, atol=1e-5)


def test_restore_state_refuses_a_mesh_the_run_cannot_pipeline_on(pp_run):
    mesh = _mesh((4, 2), ("pp", "fsdp"))
    message = "restore_state: mesh='pp=4,fsdp=2' cannot pipeline the run saved in "
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        restore_state(pp_run["out"], mesh=mesh)
    assert "--layers=2 is fewer than the 4 pipeline stages (pp=4 x --stages-per-rank=1)" in str(e.value)


def test_stack_and_unstack_refuse_the_other_tree(pp_run, fsdp_run):
    pm, opt = pp_run["progs"].layout, pp_run["progs"].optimizer
    with pytest.raises(ValueError, match=re.escape("PipelineModule.stack_state: state holds stacked pipeline stages "
                                                   "already ('stages', 'rest'); pass the model's own tree")):
        pm.stack_state(pp_run["state"], opt)
    with pytest.raises(ValueError, match=re.escape("PipelineModule.unstack_state: state is not laid out by this "
                                                   "pipeline")):
        pm.unstack_state(fsdp_run["state"], opt)
    with pytest.raises(TypeError, match=re.escape("PipelineModule.unstack_state: state=dict must be the TrainState")):
        pm.unstack_state({}, opt)
