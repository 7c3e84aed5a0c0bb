"""A unit whose last tp call's output is read again in the backward pass: an nnx decoder block ``x + attn(norm(x))``
then ``x + gelu(mlp(x))``, its attention's q, k, v column-parallel and ``out`` row-parallel (the mlp left to GSPMD).
On a stage that is not the last, the backward's recompute of ``attn.out``'s reduction feeds the mlp's backward (its
input ``x``), so it is live: the table counts it (``_comm.tp_terms`` reads which recomputed reductions a unit's
backward drops from the unit's own vjp, ``_tp.dead_recompute``). Before, the table took every unit's last tp call as
dead there and counted 2 psums (4,096 B) fewer than the compiled step held, with cp or without: all-reduce 21 buffers
(40,032 B) against 19 (35,936 B) at pp=2, tp=2; 41 (48,160 B) against 39 (44,064 B) at pp=2, cp=2, tp=2. Now equal,
and 3 SGD steps equal one device's within 1e-5.

Also: a fused ``qkv`` sliced into q, k, v along its heads in tp stages (cp or not), refused before compiling."""

import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd.parallel import (ColwiseParallel, RowwiseParallel, executed_collectives, init_train_state, make_train_step,
                           parallelize_module, pipeline, unshard_params)
from tests._one_device import assert_trees_close, train_one_device
from tests.parallel.pipelining.test_pipeline_cp_nnx import _batches, _ce, _Decoder, _SplitAttention


class _MlpAfterBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attn = _SplitAttention(16, 2, rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + nnx.gelu(self.mlp(x))


def _decoder():
    m = _Decoder(nnx.Rngs(0))
    m.blocks = nnx.List([_MlpAfterBlock(nnx.Rngs(i + 1)) for i in range(2)])
    return m


@pytest.mark.slow
@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "tp")), ((2, 2, 2), ("pp", "cp", "tp"))],
                         ids=["pp2-tp2", "pp2-cp2-tp2"])
def test_live_recompute_of_a_units_last_tp_call_is_counted(shape, names):
    batches = [_batches()] + [{k: np.roll(v, i, axis=1) for k, v in _batches().items()} for i in (1, 2)]
    graphdef, params = nnx.split(_decoder(), nnx.Param)
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, lambda p, b: _ce(nnx.merge(graphdef, p), b), opt)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = {f"blocks.*.attn.{n}": ColwiseParallel() for n in "qkv"} | {"blocks.*.attn.out": RowwiseParallel()}
    pm = pipeline(parallelize_module(_decoder(), mesh["tp"], plan), mesh["pp"], units="blocks.*", num_microbatches=2)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, _ce, opt)
    hlo = executed_collectives(step._build(state, batches[0]).jitted, state, batches[0], scalars=False)
    table = step.communication(state, batches[0])
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    want = table["collective-permute"]
    assert (hlo["collective-permute"]["buffers"], hlo["collective-permute"]["bytes"]) == (want["count"], want["bytes"])
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(pm, state), ref.params)


@pytest.mark.parametrize("shape,names", [((2, 2), ("pp", "tp")), ((2, 2, 2), ("pp", "cp", "tp"))],
                         ids=["pp2-tp2", "pp2-cp2-tp2"])
def test_a_fused_qkv_sliced_into_heads_with_tp_in_the_stages_is_refused_before_compiling(shape, names):
    """The decoder's own attention with a fused ``qkv`` (cut over tp, then split into q, k, v along the heads) in tp
    stages: GSPMD lays out each piece with collective-permutes across the heads, and the step hung at run time on
    XLA:CPU (pp=2, tp=2: 16 permutes against the pipeline's 4, 2 of 4 devices at the rendezvous; pp=2, cp=2, tp=2:
    4 of 8). Refused when the step is built, naming the unit, the projection, the mesh dims and the fix."""
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.out": RowwiseParallel()}
    pm = pipeline(parallelize_module(_Decoder(nnx.Rngs(0)), mesh["tp"], plan), mesh["pp"], units="blocks.*",
                  num_microbatches=2)
    opt = optax.sgd(0.1)
    state = init_train_state(pm, opt)
    step = make_train_step(pm, _ce, opt)
    with pytest.raises(ValueError, match=r"unit 'blocks/0' cuts 'blocks\.0\.attn\.qkv' \(ColwiseParallel\) over tp=2 "
                                         r"and then slices its 6 heads .*'tp' in the stages \(mesh dims \(.*'tp'\)\).*"
                                         r"separate q, k and v projections.*leave 'tp' out of the stages"):
        step(state, _batches())
