"""Benchmark: context parallelism in the train step (a ``cp`` mesh dim) against GSPMD and against the all-gather of K/V.

A one-block ``models.Llama`` (d_model 64, 4 heads, causal attention through ``jax.nn.dot_product_attention``),
SGD, on ``dp=2, cp=4`` (8 CPU fake devices; 2 sequences per step, one per dp rank), at sequences of 1K, 2K,
4K and 8K tokens, three ways in one run per sequence:

- ``ring``: ``make_train_step`` on the mesh: the sequence cut over cp, attention as ring attention
  (zigzag-balanced), the step's table (and the compiled HLO) holding the ring's permutes;
- ``all-gather K/V``: the same step, the model passing the causal mask as an array (the step's other
  method: K and V all-gathered over cp, the queries' mask rows local);
- ``GSPMD``: a global-view ``jax.jit`` step with the batch placed ``P('dp', 'cp')`` (sequence sharded), the
  parameters replicated, XLA's partitioner choosing the communication of the same attention.

Reported per (sequence, method): tokens/s (median of interleaved rounds), the collectives the compiled
step executes, and its temporaries (XLA's ``memory_analysis().temp``, the activations) per device against
``1 / cp`` of the same step uncut (``dp=2`` alone). On a CPU host the devices share the cores: throughput
compares the methods' costs, not a speed-up.

    python benchmarks/context_parallel.py           # 1K-8K: tens of minutes on 2 idle cores (8K dominates)
    python benchmarks/context_parallel.py --quick   # 1K only
    python benchmarks/context_parallel.py --seqs 8192 --rounds 1 --add   # those sequences, the others' rows kept

Writes benchmarks/results/context_parallel.json and .png.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from models import Llama, LlamaConfig  # noqa: E402
from spmd.parallel import executed_collectives, init_train_state, make_train_step  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
D, HEADS, VOCAB, BATCH, CP = 64, 4, 64, 2, 4
CFG = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=4 * D, num_layers=1, num_heads=HEADS,
                  num_kv_heads=HEADS, attn_implementation="sdpa")


def _masked_dpa(orig):
    def dpa(q, k, v, bias=None, mask=None, *, is_causal=False, **kw):
        if is_causal:
            t = q.shape[1]
            mask, is_causal = jnp.tril(jnp.ones((t, t), bool))[None, None], False
        return orig(q, k, v, bias, mask, is_causal=is_causal, **kw)

    return dpa


def _batch(seq):
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, VOCAB, (BATCH, seq)).astype(np.int32),
            "labels": rng.integers(0, VOCAB, (BATCH, seq)).astype(np.int32)}


def _loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


def _ours(seq, mesh, masked=False):
    model = Llama(CFG)
    batch = _batch(seq)
    params = model.init(jax.random.key(0), batch["tokens"][:, :16])["params"]
    opt = optax.sgd(0.01)
    loss_fn = _loss(model)
    if masked:  # the model's attention with the causal mask as an array
        inner = loss_fn

        def loss_fn(p, b):
            orig = jax.nn.dot_product_attention
            jax.nn.dot_product_attention = _masked_dpa(orig)
            try:
                return inner(p, b)
            finally:
                jax.nn.dot_product_attention = orig
    state = init_train_state(model, opt, params=params, mesh=mesh)
    step = make_train_step(model, loss_fn, opt, mesh=mesh)
    comm = step.communication(state, batch) if "cp" in mesh.mesh_dim_names else None
    compiled = step.compiled(state, batch)
    hlo = executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)
    temp = compiled.memory_analysis().temp_size_in_bytes

    def run(state):
        state, m = step(state, batch)
        m["loss"].block_until_ready()
        return state

    return run, state, hlo, temp, comm


def _gspmd(seq, mesh):
    model = Llama(CFG)
    batch = _batch(seq)
    params = model.init(jax.random.key(0), batch["tokens"][:, :16])["params"]
    opt = optax.sgd(0.01)
    loss_fn = _loss(model)
    jm = mesh.jax_mesh
    rep = NamedSharding(jm, P())
    params = jax.device_put(params, rep)
    opt_state = jax.device_put(opt.init(params), rep)
    batch = jax.device_put(batch, NamedSharding(jm, P("dp", "cp")))

    @jax.jit
    def step(params, opt_state, b):
        loss, g = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    compiled = step.lower(params, opt_state, batch).compile()
    from spmd.parallel import hlo_executed_collectives

    hlo = hlo_executed_collectives(compiled.as_text(), scalars=False)
    temp = compiled.memory_analysis().temp_size_in_bytes

    def run(state):
        p, o = state
        p, o, loss = step(p, o, batch)
        loss.block_until_ready()
        return p, o

    return run, (params, opt_state), hlo, temp, None


def _short(hlo):
    return {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in hlo.items() if v["count"]}


def _flag(args, name, default):
    """``--name V`` of ``args`` (a comma-separated int list for ``--seqs``), else ``default``."""
    if name not in args:
        return default
    v = args[args.index(name) + 1]
    return [int(x) for x in v.split(",")] if name == "--seqs" else int(v)


def main(argv=None):
    args = list(argv or sys.argv[1:])
    quick = "--quick" in args
    seqs = _flag(args, "--seqs", [1024] if quick else [1024, 2048, 4096, 8192])
    rounds = _flag(args, "--rounds", 2 if quick else 3)
    keep = "--add" in args  # the other sequences' rows of the results file kept (each sequence's ratios one run)
    mesh = spmd.init_device_mesh("cpu", (2, CP), mesh_dim_names=("dp", "cp"))
    uncut_mesh = spmd.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    results = {"model": f"Llama d{D} x1 block, {HEADS} heads, causal", "mesh": "dp=2,cp=4", "batch": BATCH,
               "runs": []}
    for seq in seqs:
        preps = {"ring": _ours(seq, mesh), "all-gather K/V": _ours(seq, mesh, masked=True), "GSPMD": _gspmd(seq, mesh)}
        _, _, _, uncut_temp, _ = _ours(seq, uncut_mesh)
        times = {k: [] for k in preps}
        states = {k: p[1] for k, p in preps.items()}
        for k, p in preps.items():  # warm up
            states[k] = p[0](states[k])
        for _ in range(rounds):
            for k, p in preps.items():
                t0 = time.perf_counter()
                states[k] = p[0](states[k])
                times[k].append(time.perf_counter() - t0)
        for k, (_, _, hlo, temp, comm) in preps.items():
            t = float(np.median(times[k]))
            row = {"seq": seq, "method": k, "tokens_per_s": round(BATCH * seq / t, 1),
                   "collectives": _short(hlo), "temp_bytes": int(temp),
                   "temp_vs_uncut_over_cp": round(temp / (uncut_temp / CP), 3)}
            if comm is not None:
                row["table_matches_hlo"] = all(
                    (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (comm["total"].get(kind, {"count": 0})["count"],
                                                                   comm["total"].get(kind, {"bytes": 0})["bytes"])
                    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"))
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    out = os.path.join(ROOT, "results", "context_parallel.json")
    if keep and os.path.exists(out):
        with open(out) as f:
            old = [r for r in json.load(f)["runs"] if r["seq"] not in seqs]
        results["runs"] = sorted(old + results["runs"], key=lambda r: r["seq"])  # stable: methods in run order
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, out[:-5] + ".png")


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _common import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    methods = list(dict.fromkeys(r["method"] for r in results["runs"]))
    for m in methods:
        rows = [r for r in results["runs"] if r["method"] == m]
        axes[0].plot([r["seq"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=m)
        axes[1].plot([r["seq"] for r in rows], [r["temp_vs_uncut_over_cp"] for r in rows], "o-", label=m)
    axes[0].set(xlabel="sequence", ylabel="tokens/s", title="train step throughput, dp=2 x cp=4 (higher is better)")
    axes[1].set(xlabel="sequence", ylabel="temp bytes / (uncut / cp)", title="activations per device vs 1/cp of uncut")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
