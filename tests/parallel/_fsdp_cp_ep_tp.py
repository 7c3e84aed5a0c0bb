"""fsdp=2 x cp=2 x ep=2 x tp=2 on 16 CPU devices, run in its own process (``XLA_FLAGS=
--xla_force_host_platform_device_count=16``) by ``test_expert_tp.py``: ``models.MoE`` (sdpa attention, the experts of
layers_1) laid out by ``models.layout_model``: the blocks cut over fsdp, the sequence over cp, the experts over ep and
their hidden f over tp (``ExpertTensorParallel``), the attention's and the dense MLP's projections over tp; 3 SGD
steps against one device's. Prints one JSON line: the losses of both, the largest difference of the parameters, the
experts' placements, and each collective kind's counts and bytes in the table and in the compiled program."""

import dataclasses
import json

import jax
import numpy as np
import optax

import spmd
from models import MoE
from models._plans import layout_model
from spmd.parallel import hlo_executed_collectives, init_train_state, make_train_step, unshard_params
from tests._one_device import train_one_device
from tests.parallel.test_expert_compose import _cp_batches
from tests.parallel.test_expert_step import CFG, _loss

KINDS = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def main():
    assert jax.device_count() == 16, jax.device_count()
    model = MoE(dataclasses.replace(CFG, attn_implementation="sdpa"))
    batches = _cp_batches()
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    opt = optax.sgd(0.1)
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt, has_aux=True)
    mesh = spmd.init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("fsdp", "cp", "ep", "tp"))
    pm = layout_model(model, mesh)
    state = init_train_state(pm, opt, batches[0]["tokens"], params=params)
    e = state.plan.entry("layers_1/mlp/experts/gate_proj")
    step = make_train_step(pm, _loss(model), opt)
    comm = step.communication(state, batches[0])
    hlo = hlo_executed_collectives(step.compiled(state, batches[0]).as_text(), scalars=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    got = unshard_params(pm, state)
    diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref.params), strict=True))
    print(json.dumps({"losses": losses, "ref_losses": [float(x) for x in ref_losses], "params": diff,
                      "placements": [[str(p) for p in e.placements], list(e.local_shape)],
                      "experts": comm["experts"]["all-to-all"],
                      "table": {k: dict(comm["total"][k]) for k in KINDS}, "hlo": {k: dict(hlo[k]) for k in KINDS}}))


if __name__ == "__main__":
    main()
