"""Benchmark: models the project did not write, ours (spmd.parallel's contract) against GSPMD on the same layout.

Three decoders as their users bring them, unchanged, each at d_model 256 x 4 layers (8 heads, vocabulary 256,
sequences of 32 tokens), AdamW + gradient clipping, a global batch of 128 sequences (16 per device):

- ``llama``: a user's Llama-style linen decoder (``models.Llama``: RMSNorm, rotary, SwiGLU, 4 KV heads);
- ``hf_mistral``: Hugging Face's ``FlaxMistralForCausalLM`` from a small config (no download);
- ``hf_gptneo``: Hugging Face's ``FlaxGPTNeoForCausalLM`` (LayerNorm, GELU MLP, global and local attention
  layers alternating) from a small config.

Layouts, on 8 CPU fake devices:

- ``fsdp=8``: ``fully_shard(model, mesh=mesh, units=[<the layers>])`` (one layer gathered at a time, gathered
  again for its backward pass: the default), and the same keeping the forward pass's gathers (``keep``);
- ``dp=2,tp=4``: ``parallelize_module`` with the Megatron plan a user writes (q/k/v and the MLP's input
  projections ``ColwiseParallel``, the output projections ``RowwiseParallel``), DDP over ``dp``; and the
  same with the step's gradient-layout rule switched off (``unflipped``: every gradient all-reduced as it
  comes, see ``spmd.parallel.step._grad_layout``), the ablation that shows what that rule is worth.

Ours is what a user writes: the layout, ``init_train_state`` (given the example inputs the model is called on,
``init_train_state(model, optimizer, x, params=params)``: it reads the model's backward pass, and fsdp cuts each
kernel whose gradient is its dot's output transposed on its output dim) and ``make_train_step`` with the
one-device loss. GSPMD is the same model as a JAX user writes it today: a global-view ``jax.jit`` step with every
parameter and its AdamW moments placed by ``NamedSharding`` exactly as our plan places them, the batch over
the data dims, XLA's partitioner choosing the communication. Every layout of a model is compiled first, then
all are timed in interleaved rounds (the layouts take turns, so load from other processes on the host falls on
all of them alike); ``vs_gspmd`` is the median and the range of the per-round ratios of samples/s (ours over
GSPMD's), which shows what of a difference is the host's noise; ``vs_gspmd_cpu`` the same of the process's CPU
time per step (GSPMD's over ours), which other processes' load on a shared host disturbs less than wall time.
``peak_bytes_per_device`` is each compiled step's peak (``argument + output + temp - alias`` of XLA's
``memory_analysis()``): what a layout's speed costs in memory, beside it (re-gathering the units for their
backward pass holds one unit's parameters, keeping them and GSPMD's CSE'd gathers hold every unit's).

On a CPU host the 8 devices share the cores: throughput measures the cost of a layout, not a speed-up.

    python benchmarks/zoo.py                 # about 10 minutes on 2 idle cores
    python benchmarks/zoo.py --quick         # smoke run: one model, 2 rounds
    python benchmarks/zoo.py --hlo DIR       # also write every compiled step's HLO text to DIR

Writes benchmarks/results/zoo.json and benchmarks/results/zoo.png (speed beside peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VOCAB, SEQ, D, LAYERS, HEADS, KV_HEADS, FFN, BATCH = 256, 32, 256, 4, 8, 4, 688, 128
MODELS = ("llama", "hf_mistral", "hf_gptneo")
# (label, mesh shape, dim names, reshard_after_forward)
LAYOUTS = [
    ("fsdp=8", (8,), ("fsdp",), True),
    ("fsdp=8 keep", (8,), ("fsdp",), False),
    ("dp=2,tp=4", (2, 4), ("dp", "tp"), True),
    ("dp=2,tp=4 unflipped", (2, 4), ("dp", "tp"), True),  # the ablation: every gradient reduced as it comes
]


# --- the models, as their users build them ---------------------------------------------------------
def build(name: str):
    """(model, params, loss_fn(model) -> loss(params, batch), units, Megatron tp plan) of zoo model ``name``."""
    import jax
    import jax.numpy as jnp
    import optax

    from spmd.parallel import ColwiseParallel, RowwiseParallel

    def ce(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    col, row = ColwiseParallel(), RowwiseParallel()
    if name == "llama":
        from models import Llama, LlamaConfig

        m = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_layers=LAYERS,
                              num_heads=HEADS, num_kv_heads=KV_HEADS))
        params = m.init(jax.random.key(0), jnp.zeros((2, SEQ), jnp.int32))["params"]
        prefix, units = "layers_*", ["layers_*"]
        loss = lambda mod: lambda p, b: ce(mod.apply({"params": p}, b["inputs"]), b)  # noqa: E731
    else:
        import transformers

        if name == "hf_mistral":
            cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                             num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
                                             sliding_window=None)
            m = transformers.FlaxMistralForCausalLM(cfg, seed=0)
            prefix, units = "model.layers.*", ["model.layers.*"]
        elif name == "hf_gptneo":
            cfg = transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=D, num_layers=LAYERS, num_heads=HEADS,
                                            attention_types=[[["global", "local"], LAYERS // 2]], window_size=SEQ // 2,
                                            max_position_embeddings=2 * SEQ, intermediate_size=4 * D,
                                            embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
            m = transformers.FlaxGPTNeoForCausalLM(cfg, seed=0)
            units = ["transformer.h.*"]
            a = "transformer.h.*.attn.attention"
            plan = {f"{a}.q_proj": col, f"{a}.k_proj": col, f"{a}.v_proj": col, f"{a}.out_proj": row,
                    "transformer.h.*.mlp.c_fc": col, "transformer.h.*.mlp.c_proj": row}
            return m, m.params, lambda mod: lambda p, b: ce(mod(b["inputs"], params=p).logits, b), units, plan
        else:
            raise ValueError(f"zoo: unknown model {name!r}; one of {MODELS}")
        params = m.params
        loss = lambda mod: lambda p, b: ce(mod(b["inputs"], params=p).logits, b)  # noqa: E731
    plan = {f"{prefix}.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{prefix}.self_attn.o_proj": row, f"{prefix}.mlp.gate_proj": col, f"{prefix}.mlp.up_proj": col,
             f"{prefix}.mlp.down_proj": row}
    return m, params, loss, units, plan


def _example():
    """Example inputs the model is called on (``init_train_state(model, optimizer, x, params=params)``)."""
    import jax.numpy as jnp

    return jnp.zeros((2, SEQ), jnp.int32)


def _batches(n: int = 4):
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        seq = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        out.append({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    return out


def layout(name: str, shape: tuple, names: tuple, regather: bool = True):
    """(model as laid out by the user, params, loss_fn, mesh, model as built)."""
    import spmd
    from spmd.parallel import fully_shard, parallelize_module

    m, params, loss, units, tp_plan = build(name)
    mesh = spmd.init_device_mesh("cpu", shape, mesh_dim_names=names)
    laid = m
    if "tp" in names:
        laid = parallelize_module(laid, mesh["tp"], tp_plan)
    if "fsdp" in names:
        laid = fully_shard(laid, mesh=mesh[tuple(n for n in names if n in ("dp", "fsdp"))], units=units,
                           reshard_after_forward=regather)
    return laid, params, loss, mesh, m


def _on_devices(batches, mesh, names):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data = NamedSharding(mesh.jax_mesh, P(tuple(n for n in names if n in ("dp", "fsdp")) or None))
    return [jax.device_put(b, data) for b in batches]


def _optimizer():
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.01))


def prepare_ours(name: str, shape: tuple, names: tuple, regather: bool = True, unflipped: bool = False):
    """Ours as a user writes it. ``unflipped``: the ablation of the step's gradient layout
    (``spmd.parallel.step._grad_layout``): every gradient reduced as it comes, as before that rule."""
    import fsdp as fb  # benchmarks/fsdp.py: the interleaved timing and the state bytes

    import spmd.parallel.step._build as step_module
    from spmd.parallel import init_train_state, make_train_step

    laid, params, loss, mesh, _ = layout(name, shape, names, regather)
    opt = _optimizer()
    step = make_train_step(laid, loss(laid), opt)
    state = init_train_state(laid, opt, _example(), params=params)  # the example inputs: see the module doc
    rule = step_module.transposed_dot_grads
    if unflipped:
        step_module.transposed_dot_grads = lambda closed: [False] * len(closed.jaxpr.outvars)
    try:  # traced and compiled here
        prep = fb._Prepared(step, state, _on_devices(_batches(), mesh, names), BATCH)
    finally:
        step_module.transposed_dot_grads = rule
    prep.extra = _extra(prep)
    return prep


def _extra(prep) -> dict:
    """What a layout holds and sends, per device: its stored state, its compiled peak (XLA's
    ``argument + output + temp - alias``, ``spmd.parallel.cost._memory``) and its collectives."""
    import fsdp as fb

    from spmd.parallel import hlo_executed_collectives

    mem = prep.compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    got = hlo_executed_collectives(prep.compiled.as_text())
    return dict(state_bytes_per_device=fb._state_bytes(prep.state), peak_bytes_per_device=peak,
                collectives={k: v for k, v in got.items() if v["count"]})


def _gspmd_step(loss_fn, opt):
    """The global-view train step a JAX user writes, returning the metrics ours returns."""
    import jax
    import optax

    from spmd.parallel import TrainState

    def step(state, batch):
        loss, g = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
        return new, {"loss": loss, "grad_norm": optax.tree.norm(g)}

    return step


def prepare_gspmd(name: str, shape: tuple, names: tuple):
    """The same model in global view, every parameter and moment placed as our plan places it."""
    import fsdp as fb
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.parallel import TrainState, entry_sharding, map_like_params

    laid, params, loss, mesh, model = layout(name, shape, names)
    plan = laid.plan(params, _example())
    opt = _optimizer()
    rep = NamedSharding(mesh.jax_mesh, P())
    sizes = dict(zip(names, shape))

    def sharding(x, e):  # the plan's spec, less the mesh axes a dim does not divide by (NamedSharding is even)
        spec = []
        for d, a in enumerate(tuple(entry_sharding(e, mesh).spec) + (None,) * x.ndim):
            axes = () if a is None else (a,) if isinstance(a, str) else a
            n = 1
            for ax in axes:
                n *= sizes[ax]
            spec.append(a if d < x.ndim and a is not None and x.shape[d] % n == 0 else None)
        return NamedSharding(mesh.jax_mesh, P(*spec[:x.ndim]))

    state = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))
    shardings = TrainState(step=rep, params=map_like_params(plan, state.params, sharding),
                           opt_state=map_like_params(plan, state.opt_state, sharding, optimizer=opt,
                                                     other=lambda x: rep))
    state = jax.device_put(state, shardings)
    batches = _on_devices(_batches(), mesh, names)
    jitted = jax.jit(_gspmd_step(loss(model), opt), in_shardings=(shardings, batches[0]["inputs"].sharding),
                     out_shardings=(shardings, rep))
    prep = fb._Prepared(jitted, state, batches, BATCH)
    prep.extra = _extra(prep)
    return prep


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _common import save_figure

    models = list(results["models"])
    labels = [label for label, *_ in LAYOUTS]
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        got = [results["models"][m].get(f"ours {label}", {}).get("vs_gspmd") or {} for m in models]
        med = [g.get("median", 0) for g in got]
        err = [[g.get("median", 0) - g.get("min", 0) for g in got], [g.get("max", 0) - g.get("median", 0) for g in got]]
        ax.bar([i + j * width for i in range(len(models))], med, width, yerr=err, capsize=3, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(models))])
    ax.set_xticklabels(models)
    ax.set_ylabel("ours / GSPMD samples/s (median, range of rounds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    ax.set_title(f"Speed: third-party decoders d{D}x{LAYERS}, {BATCH // 8} sequences/device, 8 CPU devices",
                 fontsize=10)
    systems = list(dict.fromkeys(k for m in models for k in results["models"][m]))  # ours and GSPMD, each layout
    width = 0.8 / max(len(systems), 1)
    for j, label in enumerate(systems):
        peak = [results["models"][m].get(label, {}).get("peak_bytes_per_device", 0) / 2**20 for m in models]
        mx.bar([i + j * width for i in range(len(models))], peak, width, label=label,
               hatch="//" if label.startswith("gspmd") else None)
    mx.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(models))])
    mx.set_xticklabels(models)
    mx.set_ylabel("compiled peak, MiB per device")
    mx.grid(axis="y", alpha=0.3)
    mx.legend(fontsize=7, ncol=2)
    mx.set_title("Memory: what each buys its speed with", fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: one model, 2 rounds")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ",".join(MODELS))
    p.add_argument("--layouts", default=";".join(label for label, *_ in LAYOUTS), help="semicolon-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--hlo", default=None, help="a folder to write each compiled step's HLO text to")
    p.add_argument("--out", default="zoo", help="results/<OUT>.json and .png")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, ROOT)
    import jax

    models = ["llama"] if a.quick else a.models.split(",")
    rounds = 2 if a.quick else a.rounds
    chosen = [lay for lay in LAYOUTS if lay[0] in a.layouts.split(";")]
    results = {"jax": jax.__version__, "d_model": D, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "batch": BATCH,
               "vocab": VOCAB, "rounds": rounds, "steps_per_round": a.steps, "models": {}}
    for name in models:
        entry = results["models"][name] = {}
        preps = {}
        for label, shape, names, regather in chosen:
            preps[f"ours {label}"] = prepare_ours(name, shape, names, regather, unflipped="unflipped" in label)
            twin = f"gspmd {label.split()[0]}"
            if twin not in preps:
                preps[twin] = prepare_gspmd(name, shape, names)
        if a.hlo:
            os.makedirs(a.hlo, exist_ok=True)
            for label, prep in preps.items():
                with open(os.path.join(a.hlo, f"{name}_{label.replace(' ', '_')}.hlo.txt"), "w") as f:
                    f.write(prep.compiled.as_text())
        for _ in range(rounds):  # interleaved: load from other processes hits every layout alike
            for prep in preps.values():
                prep.round(a.steps)
        for label, prep in preps.items():
            r = entry[label] = {**prep.report(), **prep.extra}
            comm = ", ".join(f"{k} x{v['count']} {v['bytes'] / 2**20:.2f} MiB" for k, v in r["collectives"].items())
            vs = ""
            if label.startswith("ours"):
                twin = preps[f"gspmd {label.split()[1]}"]
                ratios = [g / o for o, g in zip(prep.wall, twin.wall)]
                r["vs_gspmd"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
                cpu = [g / o for o, g in zip(prep.cpu, twin.cpu)]
                r["vs_gspmd_cpu"] = {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)}
                vs = "  vs GSPMD {median:.2f}x [{min:.2f}-{max:.2f}]".format(**r["vs_gspmd"])
                vs += " (CPU time {median:.2f}x [{min:.2f}-{max:.2f}])".format(**r["vs_gspmd_cpu"])
            print(f"{name:10s} {label:18s} {r['samples_per_s']:7.1f} samples/s (best {r['samples_per_s_best']:6.1f})"
                  f"{vs}  compile {r['compile_s']:4.0f} s  state {r['state_bytes_per_device'] / 2**20:5.2f} MiB/device"
                  f"  peak {r['peak_bytes_per_device'] / 2**20:6.2f} MiB/device"
                  f"  {comm}", flush=True)
        del preps
        os.makedirs(RESULTS, exist_ok=True)  # written after each model: a run cut short keeps what it measured
        name = "zoo_quick" if a.quick else a.out
        with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)
    _plot(results, os.path.join(RESULTS, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
