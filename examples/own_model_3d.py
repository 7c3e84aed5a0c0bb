"""Bring your own model: a Llama-style decoder written without any sharding, trained 3-D (dp x fsdp x tp).

Run: python examples/own_model_3d.py   (8 CPU fake devices are set below, before JAX starts)
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spmd  # noqa: E402
from spmd.parallel import (ColwiseParallel, RowwiseParallel, fully_shard, init_train_state,  # noqa: E402
                           make_train_step, parallelize_module, unshard_params)
from models import Llama, LlamaConfig  # noqa: E402  (any flax model of yours)


def main() -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    tokens = np.random.default_rng(0).integers(0, 64, (32, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = Llama(cfg).init(jax.random.key(0), batch["inputs"][:2])["params"]

    mesh = spmd.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "fsdp", "tp"))
    col, row = ColwiseParallel(), RowwiseParallel()
    model = parallelize_module(Llama(cfg), mesh["tp"], {
        "layers_*.self_attn.q_proj": col, "layers_*.self_attn.k_proj": col, "layers_*.self_attn.v_proj": col,
        "layers_*.self_attn.o_proj": row, "layers_*.mlp.gate_proj": col, "layers_*.mlp.up_proj": col,
        "layers_*.mlp.down_proj": row})
    model = fully_shard(model, mesh=mesh["dp", "fsdp"], units=["layers_*"])  # 2-D: HSDP
    optimizer = optax.adamw(1e-3)
    state = init_train_state(model, optimizer, params=params)

    def loss_fn(params, batch):  # exactly the 1-device loss
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    step = make_train_step(model, loss_fn, optimizer)
    print(step.table(state, batch))  # the plan and its communication, before anything runs
    for i in range(5):
        state, metrics = step(state, batch)
        print(f"step {i}: loss {float(metrics['loss']):.4f}")
    full = unshard_params(model, state)
    print("parameters:", sum(x.size for x in jax.tree.leaves(full)), jnp.asarray(full["lm_head"]["kernel"]).shape)


if __name__ == "__main__":
    main()
