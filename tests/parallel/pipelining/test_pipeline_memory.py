"""A pipeline schedule's activation stash, measured from ``compiled.memory_analysis()``, equals its bound.

``spmd.parallel.pipelining._memory.measure_activation_stash`` (its module doc: the method) on the Llama of
test_pipeline.py (4 layers, hidden 16) over pp=2 (2 devices), one micro-batch of 2 x 8 x 16 float32
(1 KiB): the temp bytes of the looped, donated step at several M fit a line whose slope is exactly one
activation per stash slot, and each schedule's measured stash is exactly its slot count x the activation
bytes: gpipe M activations (+1 gradient), 1f1b 2 (pp - 1) (+1) at every M >= pp, interleaved v=2 its own
count (fitted on looped BFS, GPipe over the two chunks).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd.parallel import build_schedule, init_train_state, make_train_step, pipeline
from spmd.parallel.pipelining._memory import measure_activation_stash
from tests.third_party.llama import Llama, LlamaConfig

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1, eps=1e-6))
VOCAB, ROWS, T, D = 32, 2, 8, 16
ACT = ROWS * T * D * 4  # one micro-batch's activation, float32
pytestmark = pytest.mark.xdist_group("pipeline-memory")  # the cached measurements on one worker


@functools.lru_cache(maxsize=None)
def _setup(schedule: str, m: int, v: int = 1, rows: int = ROWS):
    model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_layers=4, num_heads=4,
                              num_kv_heads=2))
    params = model.init(jax.random.key(0), jnp.zeros((2, T), jnp.int32))["params"]
    mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = pipeline(model, mesh["pp"], units="layers_*", num_microbatches=m, schedule=schedule, stages_per_rank=v)
    tok = np.random.default_rng(0).integers(0, VOCAB, (rows * m, T + 1))
    batch = {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32)}

    def loss_fn(p, b):
        logits = pm.apply({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    return pm, loss_fn, init_train_state(pm, OPT, params=params), batch


@functools.lru_cache(maxsize=None)
def _measure(schedule: str, m: int, v: int, reference: tuple, microbatches: tuple) -> dict:
    pm, loss_fn, state, batch = _setup(schedule, m, v)
    return measure_activation_stash(pm, loss_fn, OPT, state, batch, reference=reference, microbatches=microbatches)


def _v1():  # gpipe's reference compiles at M = 2, 3, 4 and 1f1b's step at M = 2, 4: five compiles
    return _measure("1f1b", 2, 1, (2, 3, 4), (2, 4))


def _bound(name, m, v=1):
    s = build_schedule(name, 2, m, v)
    return (max(s.x_slots) + max(s.g_slots)) * ACT


def test_gpipe_stash_equals_bound_and_grows_with_m():
    got = _v1()
    assert got["compiles"] == 5 and got["activation_bytes"] == ACT
    assert got["bytes_per_slot"] == ACT  # one more live micro-batch costs exactly one activation
    ref = got["reference"]
    assert [p["residual_bytes"] for p in ref] == [0, 0, 0]  # three compiles on one line, to the byte
    assert [p["bound_bytes"] for p in ref] == [_bound("gpipe", m) for m in (2, 3, 4)] == [3 * ACT, 4 * ACT, 5 * ACT]
    assert [p["measured_bytes"] for p in ref] == [3 * ACT, 4 * ACT, 5 * ACT]  # M activations + 1 gradient slot
    # one chunk per rank: its units are sliced at a constant, so no tick-table column sits in temp
    assert [p["table_bytes"] for p in ref] == [0, 0, 0]
    assert [b["temp_bytes"] - a["temp_bytes"] for a, b in zip(ref, ref[1:])] == [ACT, ACT]


def test_1f1b_stash_equals_bound_and_stays_flat():
    got = _v1()
    two, four = got["measured"]
    assert (two["num_microbatches"], four["num_microbatches"]) == (2, 4)
    assert two["measured_bytes"] == four["measured_bytes"] == _bound("1f1b", 4) == 3 * ACT  # 2 (pp - 1) + 1
    assert (two["table_bytes"], four["table_bytes"]) == (0, 0)
    # at M = 4 1f1b's step holds what gpipe's holds at M = pp = 2 (gpipe's at M = 4: two activations more)
    g2, g4 = got["reference"][0], got["reference"][2]
    assert four["temp_bytes"] - four["table_bytes"] == g2["temp_bytes"] - g2["table_bytes"]
    assert (g4["temp_bytes"] - g4["table_bytes"]) - (four["temp_bytes"] - four["table_bytes"]) == 2 * ACT


def _unrolled_temp(m: int, rows: int) -> int:  # the default (unrolled) step's temp bytes, state donated
    pm, loss_fn, state, batch = _setup("1f1b", m, 1, rows)
    step = make_train_step(pm, loss_fn, OPT)
    return step.compiled(state, batch).memory_analysis().temp_size_in_bytes


def test_unrolled_1f1b_over_pp2_stays_flat():
    # over pp=2 no forward reads a stash slot (the first stage embeds, the last one's forward waits for its
    # backward), so only the schedule orders a tick's forward after the previous tick's backward: left free, XLA
    # ran every forward first and held each micro-batch's sent activation, as GPipe does (+6.5 activations from
    # M = 4 to 8 here). 16-row micro-batches (8 KiB activations): each unrolled tick adds a few hundred bytes
    # of the conditionals' operand tables, under one activation in all.
    rows = 16
    act = rows * T * D * 4
    four, eight = _unrolled_temp(4, rows), _unrolled_temp(8, rows)
    assert eight - four < act, (four, eight)


def test_interleaved_stash_equals_bound():
    got = _measure("interleaved", 4, 2, (2, 3), (2, 4))  # looped BFS's references at M = 2, 3: 4 compiles
    assert got["compiles"] == 4 and got["bytes_per_slot"] == ACT
    ref = got["reference"]  # GPipe over v = 2 chunks: 2 M activation slots, M - 1 gradient slots (M >= 2)
    assert [p["bound_bytes"] for p in ref] == [_bound("looped_bfs", m, 2) for m in (2, 3)] == [5 * ACT, 8 * ACT]
    assert [p["residual_bytes"] for p in ref] == [0, 0]
    bounds = [_bound("interleaved", m, 2) for m in (2, 4)]
    assert bounds == [5 * ACT, 5 * ACT]  # 4 activation slots and 1 gradient slot at every M
    assert [e["measured_bytes"] for e in got["measured"]] == bounds
    assert [e["table_bytes"] for e in got["measured"]] == [0, 0]  # two chunks per rank: no uniform column


def test_errors():
    pm, loss_fn, state, batch = _setup("gpipe", 2)
    with pytest.raises(ValueError, match=re.escape("reference=(1, 2) must be distinct gpipe micro-batch counts >= 2; "
                                                   "use e.g. reference=(2, 4).")):
        measure_activation_stash(pm, loss_fn, OPT, state, batch, reference=(1, 2))
    with pytest.raises(ValueError, match=re.escape("the fit needs two slot counts")):
        measure_activation_stash(pm, loss_fn, OPT, state, batch, reference=(2,))
    pi, loss_i, state_i, batch_i = _setup("interleaved", 4, 2)
    with pytest.raises(ValueError, match=re.escape("microbatches=(3,) must be distinct interleaved micro-batch counts "
                                                   ">= 2, multiples of pp=2")):
        measure_activation_stash(pi, loss_i, OPT, state_i, batch_i, microbatches=(3,))
    with pytest.raises(TypeError, match=re.escape("pm=Llama must be the PipelineModule pipeline() returns")):
        measure_activation_stash(pm.module, loss_fn, OPT, state, batch)
