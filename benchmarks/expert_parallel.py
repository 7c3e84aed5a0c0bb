"""Benchmark: expert parallelism in the train step (``ExpertParallel`` on an ``ep`` mesh dim) against the experts
replicated and against GSPMD.

``models.MoE`` (2 blocks, d_model 64, top-2 of 8 SwiGLU experts of width 256 in the second block, capacity
factor 1), SGD, a global batch of 16 sequences of 128 tokens on 8 CPU fake devices, three ways in one run:

- ``ep=4``: ``parallelize_module(model, mesh['ep'], {'layers_*.mlp.experts': ExpertParallel()})`` on
  ``dp=2, ep=4``: each rank holds 2 experts, the capacity buffers exchanged with one all-to-all each way;
- ``replicated``: the same model data-parallel on ``dp=8`` (every rank holds all 8 experts);
- ``GSPMD``: a global-view ``jax.jit`` step on ``dp=2, ep=4`` with the experts' parameters placed
  ``Shard(0)`` over ep by ``NamedSharding`` and the batch over both dims, XLA's partitioner choosing the
  communication.

Reported per method: tokens/s (median of interleaved rounds), the collectives the compiled step executes,
the parameter bytes per device and, for ``ep=4``, the all-to-all bytes against the bound: per all-to-all the
rank's routed assignments, ``tokens x top_k x d x 4`` bytes (the capacity-padded buffer at capacity factor 1
is exactly that; ``(ep - 1) / ep`` of it leaves the rank).

    python benchmarks/expert_parallel.py           # about a minute on 2 idle cores
    python benchmarks/expert_parallel.py --quick

Writes benchmarks/results/expert_parallel.json and .png.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from models import MoE, MoEConfig  # noqa: E402
from spmd.parallel import (ExpertParallel, executed_collectives, hlo_executed_collectives, init_train_state,  # noqa: E402
                           make_train_step, parallelize_module)

ROOT = os.path.dirname(os.path.abspath(__file__))
D, VOCAB, BATCH, SEQ, EP = 64, 64, 16, 128, 4
CFG = MoEConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=4 * D, num_layers=2, num_heads=4, num_kv_heads=4,
                num_experts=8, top_k=2, capacity_factor=1.0)


def _batch():
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
            "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)}


def _loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


def _bytes_per_device(tree):
    return int(sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards[:1]))


def _ours(mesh, ep):
    model = MoE(CFG)
    batch = _batch()
    params = model.init(jax.random.key(0), batch["tokens"][:, :16])["params"]
    opt = optax.sgd(0.01)
    laid = parallelize_module(model, mesh["ep"], {"layers_*.mlp.experts": ExpertParallel()}) if ep else model
    state = init_train_state(laid, opt, params=params, mesh=None if ep else mesh)
    step = make_train_step(laid, _loss(model), opt, mesh=None if ep else mesh)
    comm = step.communication(state, batch)
    hlo = executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)

    def run(state):
        state, m = step(state, batch)
        m["loss"].block_until_ready()
        return state

    return run, state, hlo, _bytes_per_device(state.params), comm


def _gspmd(mesh):
    model = MoE(CFG)
    batch = _batch()
    params = model.init(jax.random.key(0), batch["tokens"][:, :16])["params"]
    opt = optax.sgd(0.01)
    jm = mesh.jax_mesh

    def place(path, x):
        return NamedSharding(jm, P("ep") if "experts" in jax.tree_util.keystr(path) else P())

    shardings = jax.tree_util.tree_map_with_path(place, params)
    params = jax.device_put(params, shardings)
    opt_state = opt.init(params)
    batch = jax.device_put(batch, NamedSharding(jm, P(("dp", "ep"))))
    loss_fn = _loss(model)

    @jax.jit
    def step(params, opt_state, b):
        loss, g = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = opt.update(g, opt_state, params)
        return jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), shardings), opt_state, loss

    compiled = step.lower(params, opt_state, batch).compile()
    hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)

    def run(state):
        p, o = state
        p, o, loss = step(p, o, batch)
        loss.block_until_ready()
        return p, o

    return run, (params, opt_state), hlo, _bytes_per_device(params), None


def main(argv=None):
    quick = "--quick" in (argv or sys.argv[1:])
    rounds = 2 if quick else 5
    ep_mesh = spmd.init_device_mesh("cpu", (2, EP), mesh_dim_names=("dp", "ep"))
    dp_mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    preps = {"ep=4": _ours(ep_mesh, True), "replicated (dp=8)": _ours(dp_mesh, False), "GSPMD (dp=2, ep=4)": _gspmd(ep_mesh)}
    states = {k: p[1] for k, p in preps.items()}
    times = {k: [] for k in preps}
    for k, p in preps.items():
        states[k] = p[0](states[k])
    for _ in range(rounds):
        for k, p in preps.items():
            t0 = time.perf_counter()
            states[k] = p[0](states[k])
            times[k].append(time.perf_counter() - t0)
    tokens_local = BATCH * SEQ // 8
    bound = 4 * tokens_local * CFG.top_k * D * 4  # per device: dispatch and combine, forward and backward
    results = {"model": f"MoE d{D}, top-{CFG.top_k} of {CFG.num_experts} experts, capacity factor 1",
               "batch": f"{BATCH} x {SEQ} tokens", "runs": []}
    for k, (_, _, hlo, pbytes, comm) in preps.items():
        short = {kind: {"count": v["count"], "bytes": v["bytes"]} for kind, v in hlo.items() if v["count"]}
        row = {"method": k, "tokens_per_s": round(BATCH * SEQ / float(np.median(times[k])), 1),
               "collectives": short, "param_bytes_per_device": pbytes,
               "all_to_all_bytes": hlo["all-to-all"]["bytes"],
               "all_to_all_bound": bound if k == "ep=4" else None}
        if comm is not None and k == "ep=4":
            row["table_all_to_all_bytes"] = comm["total"]["all-to-all"]["bytes"]
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    out = os.path.join(ROOT, "results", "expert_parallel.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, out[:-5] + ".png")


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _common import save_figure

    runs = results["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [r["method"] for r in runs]
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s (higher is better)"),
                           (axes[1], "param_bytes_per_device", "parameter bytes per device"),
                           (axes[2], None, "MiB communicated per device per step (HLO)")):
        vals = [r[key] if key else sum(c["bytes"] for c in r["collectives"].values()) / 2**20 for r in runs]
        ax.bar(range(len(runs)), vals, color=["C0", "C1", "C2"][:len(runs)])
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
