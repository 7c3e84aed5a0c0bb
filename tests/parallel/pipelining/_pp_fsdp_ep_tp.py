"""pp=2 x fsdp=2 x ep=2 x tp=2 on 16 CPU devices, run in its own process (``XLA_FLAGS=
--xla_force_host_platform_device_count=16``) by ``test_pipeline_experts_16.py``: ``models.MoE`` (experts in every
block) in 2 pipeline stages (1F1B, M=2), the stages cut over fsdp, the experts over ep, the attention's projections
over tp; 3 SGD-with-momentum steps against one device's. Prints one JSON line: the losses of both, the largest
difference of the parameters and momenta, the placements of two stage parameters, and each collective kind's
counts and bytes in the table and in the compiled program."""

import json

import jax
import numpy as np
import optax

import spmd
from models import MoE
from spmd.parallel import (ExpertParallel, fully_shard, hlo_executed_collectives, init_train_state, make_train_step,
                           parallelize_module, pipeline)
from tests._one_device import train_one_device
from tests.parallel.pipelining.test_pipeline_experts import CFG, TP_PLAN, T, V, _loss

KINDS = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main():
    assert jax.device_count() == 16, jax.device_count()
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (8, T)).astype(np.int32),
                "labels": rng.integers(0, V, (8, T)).astype(np.int32)} for _ in range(3)]
    model = MoE(CFG)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1, momentum=0.9)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("pp", "fsdp", "ep", "tp"))
    laid = parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()})
    laid = fully_shard(parallelize_module(laid, mesh["tp"], TP_PLAN), mesh=mesh["fsdp"])
    pm = pipeline(laid, mesh["pp"], num_microbatches=2, schedule="1f1b")
    state = init_train_state(pm, opt, params=params)
    placed = {}
    for path in ("stages/mlp/experts/gate_proj", "stages/self_attn/q_proj/kernel"):
        e = state.plan.entry(path)
        placed[path] = [[str(p) for p in e.placements], list(e.local_shape)]
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    own = pm.unstack_state(state, opt)
    print(json.dumps({"losses": losses, "ref_losses": [float(x) for x in ref_losses],
                      "params": _max_diff(own.params, ref.params), "opt_state": _max_diff(own.opt_state, ref.opt_state),
                      "placements": placed,
                      "table": {k: dict(comm[k]) for k in KINDS}, "hlo": {k: dict(hlo[k]) for k in KINDS}}))


if __name__ == "__main__":
    main()
