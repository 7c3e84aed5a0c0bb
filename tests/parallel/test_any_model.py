"""Sharded training of models the project did not write, unchanged: torch's transforms on any flax model.

Each model (a Llama-style linen decoder, a flax.nnx model, Hugging Face's FlaxGPT2LMHeadModel and
FlaxLlamaForCausalLM built from small configs) trains 10 AdamW steps on every layout that applies, and
must equal 1-device training within 1e-5 (f32); the compiled step's collectives (buffers and bytes per
kind, scalars aside) must equal what the plan prints (``step.communication``).
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
from spmd import Replicate, Shard
from spmd.parallel import (ColwiseParallel, MixedPrecisionPolicy, ParallelModule, RowwiseParallel, SequenceParallel,
                           executed_collectives, fully_shard, init_train_state, make_train_step,
                           parallelize_module, unshard_params)
from tests.third_party.llama import Llama, LlamaConfig

OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1, eps=1e-6))
STEPS = 10
VOCAB = 64


def _batches(seed=0, n=16, t=8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, t + 1))
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def _ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


# --- the models, as their users build them -------------------------------------------------------------
def _megatron(prefix: str, sp: bool = False, embed: str | None = None, head: str | None = None) -> dict:
    col = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    row = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan = {f"{prefix}.self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{prefix}.self_attn.o_proj": row, f"{prefix}.mlp.gate_proj": col, f"{prefix}.mlp.up_proj": col,
             f"{prefix}.mlp.down_proj": row}
    if sp:
        plan |= {f"{prefix}.input_layernorm": SequenceParallel(), f"{prefix}.post_attention_layernorm": SequenceParallel(),
                 embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                 head: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return plan


@functools.lru_cache(maxsize=None)
def _model(name: str):
    """(model, params or None, loss_fn of a model, tp plan, sp plan or None, units)."""
    if name == "llama":
        m = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                              num_kv_heads=4))
        params = m.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
        sp = _megatron("layers_*", True, "embed_tokens", "lm_head") | {"norm": SequenceParallel()}
        return m, params, lambda mod: lambda p, b: _ce(mod.apply({"params": p}, b["inputs"]), b), \
            _megatron("layers_*"), sp, ["layers_*"]
    if name == "nnx":
        from flax import nnx

        from tests.third_party.nnx_mlp import TokenMLP

        plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
        return (lambda: TokenMLP(vocab=VOCAB, rngs=nnx.Rngs(0))), None, lambda mod: lambda m, b: _ce(m(b["inputs"]), b), \
            plan, None, ["blocks.*"]
    transformers = pytest.importorskip("transformers")
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        hf = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
        # GPT-2's Conv1D kernels are (out, in): the cut dims are said explicitly
        plan = {"transformer.h.*.mlp.c_fc": ColwiseParallel(dim=0), "transformer.h.*.mlp.c_proj": RowwiseParallel(dim=1)}
        units = ["transformer.h.*"]
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
        hf = transformers.FlaxLlamaForCausalLM(cfg, seed=0)
        plan = _megatron("model.layers.*")
        units = ["model.layers.*"]
    return hf, hf.params, lambda mod: lambda p, b: _ce(mod(b["inputs"], params=p).logits, b), plan, None, units


def _fresh(name):
    m, params, loss, plan, sp, units = _model(name)
    return (m() if callable(m) and not hasattr(m, "apply") and name == "nnx" else m), params, loss, plan, sp, units


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    """(losses, final params) of 1-device training."""
    m, params, loss, *_ = _fresh(name)
    batch = _batches()
    if name == "nnx":
        from flax import nnx

        graphdef, params = nnx.split(m, nnx.Param)
        lf = lambda p, b: loss(None)(nnx.merge(graphdef, p), b)  # noqa: E731
    else:
        lf = loss(m)

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(lf)(p, batch)
        u, s = OPT.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    s, losses = OPT.init(params), []
    for _ in range(STEPS):
        params, s, value = step(params, s)
        losses.append(float(value))
    return losses, params


def _layout(name: str, spec: str):
    m, params, loss, plan, sp_plan, units = _fresh(name)
    sp = spec.endswith("+sp")
    dims = [kv.split("=") for kv in spec.replace("+sp", "").split(",")]
    mesh = spmd.init_device_mesh("cpu", tuple(int(n) for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
    names = mesh.mesh_dim_names
    if "tp" in names:
        m = parallelize_module(m, mesh["tp"], sp_plan if sp else plan)
    data = tuple(n for n in names if n in ("dp", "fsdp"))
    if "fsdp" in names:
        m = fully_shard(m, mesh=mesh[data], units=units)
    return m, params, loss, mesh


def _train(m, params, loss, mesh=None):
    """(state, step, losses) of STEPS steps of ``m`` (a plain model trains DDP over ``mesh``)."""
    kw = {} if isinstance(m, ParallelModule) else {"mesh": mesh}
    state = init_train_state(m, OPT, params=params, **kw) if params is not None else init_train_state(m, OPT, **kw)
    step = make_train_step(m, loss(m), OPT, **kw)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, _batches())
        losses.append(float(metrics["loss"]))
    return state, step, losses


# Per model: (parameter leaves, a layer's fsdp gather buffers, the root unit's, a layer's Megatron all-reduces);
# a unit's gather buffers: each matrix its own, its vectors one flat buffer.
PLAN_COUNTS = {
    # 2 layers of 7 matrices and 2 RMSNorm weights, + embedding, final norm, head; 7 + 1; embedding, head + 1;
    # the input gradients of q, k, v, gate, up (column-parallel), the outputs of o, down (row-parallel)
    "llama": (2 * 9 + 3, 7 + 1, 2 + 1, 5 + 2),
    "hf_llama": (2 * 9 + 3, 7 + 1, 2 + 1, 5 + 2),
    # 2 blocks of a LayerNorm, up and down (2 leaves each), + embedding, head kernel and bias; 2 + 1; 2 + 1;
    # up's input gradient, down's output
    "nnx": (2 * 6 + 3, 2 + 1, 2 + 1, 2),
    # 2 layers of ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (2 leaves each), + wte, wpe, ln_f's
    # 2; 4 + 1; wte, wpe + 1; mlp.c_fc's input gradient, mlp.c_proj's output
    "hf_gpt2": (2 * 12 + 4, 4 + 1, 2 + 1, 2),
}
LAYOUTS = ["dp=8", "fsdp=8", "dp=2,fsdp=4", "dp=2,tp=4", "dp=2,fsdp=2,tp=2", "fsdp=2,tp=4+sp"]
# The README's tier: every model on the 3-D layout (dp, fsdp and tp at once: each model's units and plan), llama
# also alone on dp and with sequence parallelism; the other layouts are compile-bound repeats of those (fsdp and
# tp alone: test_fsdp, test_tp), in the slow tier.
FAST = {"dp=2,fsdp=2,tp=2", "llama dp=8", "llama fsdp=2,tp=4+sp"}
CASES = [pytest.param(m, lay, marks=() if lay in FAST or f"{m} {lay}" in FAST else pytest.mark.slow)
         for m in ("llama", "nnx", "hf_gpt2", "hf_llama") for lay in LAYOUTS if not (lay.endswith("+sp") and m != "llama")]


@pytest.mark.parametrize("name,spec", CASES)
def test_layout_equals_one_device_and_its_plan(name, spec):
    ref_losses, ref_params = _reference(name)
    m, params, loss, mesh = _layout(name, spec)
    state, step, losses = _train(m, params, loss, mesh)
    batch = _batches()
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    got = unshard_params(m, state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    hlo = executed_collectives(step, state, batch, scalars=False)
    plan = step.communication(state, batch)["total"]
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (plan[kind]["count"], plan[kind]["bytes"]), (kind, hlo, plan)
    if "fsdp" in spec:  # a re-gathering unit keeps every activation and rounds none (float32: the identity),
        # where jax.checkpoint's vjp rounds each (llama 126 reduce-precision ops, hf_gpt2 102, nnx 52)
        assert step.lower(state, batch).compile().as_text().count(" reduce-precision(") == 0
    # the table from the model (2 layers; PLAN_COUNTS): fsdp gathers each buffer of a layer twice (again for
    # its backward pass), the root's once, and reduce-scatters each once; dp all-reduces every leaf's gradient
    # (DDP; HSDP: the fsdp-cut shards and the whole ones); Megatron tp its layers' all-reduces. Sequence parallel (llama): a layer
    # all-gathers q/k/v's and gate/up's shared inputs forward and o's and down's outputs backward (4),
    # reduce-scatters the 5 column-parallel inputs backward and 2 row-parallel outputs forward (7), all-reduces
    # its 2 norm weights' gradients; the embedding's output 1 of each, the head's input and logits 2 of each,
    # the final norm's weight 1 all-reduce
    leaves, layer_bufs, root_bufs, megatron = PLAN_COUNTS[name]
    names = mesh.mesh_dim_names
    fsdp, sp = "fsdp" in names, spec.endswith("+sp")
    assert {k: v["count"] for k, v in plan.items()} == {
        "all-gather": fsdp * (2 * 2 * layer_bufs + root_bufs) + sp * (4 * 2 + 1 + 2),
        "reduce-scatter": fsdp * (2 * layer_bufs + root_bufs) + sp * (7 * 2 + 1 + 2),
        "all-reduce": ("dp" in names) * leaves + ("tp" in names and not sp) * 2 * megatron + sp * (2 * 2 + 1)}


def test_init_from_an_rng_gives_the_unwrapped_models_values_in_shards():
    m, params, loss, mesh = _layout("llama", "dp=2,fsdp=2,tp=2")
    state = init_train_state(m, OPT, jax.random.key(0), jnp.zeros((2, 8), jnp.int32))
    for a, b in zip(jax.tree.leaves(unshard_params(m, state)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kernel = state.params["layers_0"]["mlp"]["up_proj"]["kernel"]  # (64, 96): fsdp cuts dim 0, tp dim 1
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 48)}


def test_reshard_after_forward_gathers_each_unit_again_and_keep_does_not():
    m0, params, loss, _ = _layout("llama", "dp=8")
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    got = {}
    for keep in (True, False):
        m = fully_shard(m0.module if isinstance(m0, ParallelModule) else m0, mesh=mesh, units=["layers_*"],
                        reshard_after_forward=not keep)
        state = init_train_state(m, OPT, params=params)
        step = make_train_step(m, loss(m), OPT)
        got[keep] = executed_collectives(step, state, _batches(), scalars=False)["all-gather"]["buffers"]
    per_layer = 7  # the layer's 7 matrices; its 2 norm weights travel as one flat buffer: 8 buffers
    assert got[True] + 2 * (per_layer + 1) == got[False]


def test_vocabulary_parallel_head_with_plain_optax_cross_entropy():
    """lm_head cut on the vocabulary, output Shard(-1): the user's optax loss on the cut logits (no all-gather
    of the logits), the same losses as one device."""
    ref_losses, _ = _reference("llama")
    m0, params, loss, _ = _layout("llama", "dp=8")
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(m0, mesh["tp"], {**_megatron("layers_*"), "lm_head": ColwiseParallel(output_layouts=Shard(-1))})
    state, step, losses = _train(m, params, loss)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    text = step.lower(state, _batches()).compile().as_text()
    logits_bytes = 8 * 8 * VOCAB * 4  # a data rank's full logits
    gathered = [int(np.prod([int(d) for d in dims.split(",")])) * 4
                for dims in re.findall(r"f32\[([0-9,]+)\][^=]*? all-gather", text)]
    assert all(b < logits_bytes for b in gathered), gathered


def test_mixed_precision_halves_the_gathered_bytes_and_stays_near_float32():
    ref_losses, _ = _reference("llama")
    m0, params, loss, _ = _layout("llama", "dp=8")
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    full = fully_shard(m0, mesh=mesh, units=["layers_*"])
    half = fully_shard(m0, mesh=mesh, units=["layers_*"],
                       mp_policy=MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32))
    got = {}
    for key, m in (("f32", full), ("bf16", half)):
        state, step, losses = _train(m, params, loss)
        got[key] = (losses, _stablehlo_bytes(step.lower(state, _batches()).as_text()),
                    step.communication(state, _batches())["total"], state)
    # The program handed to XLA gathers bf16 and reduce-scatters f32 (XLA:CPU then widens bf16 collectives
    # to f32 in its compiled HLO; GPUs run them in bf16): read the lowered module.
    assert got["bf16"][1]["all_gather"] * 2 == got["f32"][1]["all_gather"] == got["f32"][2]["all-gather"]["bytes"]
    assert got["bf16"][1]["all_gather"] == got["bf16"][2]["all-gather"]["bytes"]
    assert got["bf16"][1]["reduce_scatter"] == got["f32"][1]["reduce_scatter"]  # reduced in f32
    leaf = jax.tree.leaves(got["bf16"][3].params)[0]
    assert leaf.dtype == jnp.float32  # master weights stay float32 on the shards
    # bf16 keeps 8 bits of mantissa: a relative error of 2^-8 per rounding; the loss of this 10-step run
    # moves by less than 1e-2 (4.2 -> 4.1), so the curves agree to a few 1e-3.
    np.testing.assert_allclose(got["bf16"][0], ref_losses, rtol=0, atol=2e-2)
    assert max(abs(a - b) for a, b in zip(got["bf16"][0], ref_losses)) > 0  # really computed in bf16


def _stablehlo_bytes(text: str) -> dict:
    """Result bytes of the all_gather / reduce_scatter ops in a lowered module (each written once: no loops here)."""
    size = {"f32": 4, "bf16": 2}
    out = {"all_gather": 0, "reduce_scatter": 0}
    for kind in out:
        for dims, dt in re.findall(rf'"stablehlo\.{kind}".*-> tensor<([0-9x]+)x(f32|bf16)>', text):
            n = int(np.prod([int(d) for d in dims.split("x")]))
            out[kind] += n * size[dt] * (8 if kind == "reduce_scatter" else 1)  # its input: the result x 8 ranks
    return out


# --- bad input: each a clear error naming the argument, the value and the fix ---------------------------
def _llama(heads=8, kv=4, hidden=64):
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_layers=2,
                             num_heads=heads, num_kv_heads=kv))


def _params(model):
    return model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]


def test_a_unit_that_matches_no_module_names_it_and_the_modules():
    m = _llama()
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    with pytest.raises(ValueError, match=r"fully_shard: unit 'block_\*' matches no module .*layers_0\.self_attn"):
        init_train_state(fully_shard(m, mesh=mesh, units=["block_*"]), OPT, params=_params(m))


def test_a_plan_key_that_matches_no_module_names_it():
    m = _llama()
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"parallelize_module: plan key 'layers_\*\.attn\.q' matches no module"):
        init_train_state(parallelize_module(m, mesh["tp"], {"layers_*.attn.q": ColwiseParallel()}), OPT,
                         params=_params(m))


def test_a_module_type_the_style_does_not_know_needs_dim():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    hf = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    pm = parallelize_module(hf, mesh["tp"], {"transformer.h.*.mlp.c_fc": ColwiseParallel()})
    state = init_train_state(pm, OPT, params=hf.params)
    step = make_train_step(pm, lambda p, b: _ce(pm(b["inputs"], params=p).logits, b), OPT)
    with pytest.raises(ValueError, match=r"module 'transformer\.h\.0\.mlp\.c_fc' is a FlaxConv1D, a module type the "
                                         r"style does not know .* ColwiseParallel\(dim=d\)"):
        step(state, _batches())


def test_a_tp_cut_that_does_not_divide_is_refused():
    m = _llama(heads=6, kv=6, hidden=48)  # q_proj's 48 features over tp=4 divide; the MLP's 96 too; use tp=5 below
    mesh = spmd.init_device_mesh("cpu", (5,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match=r"on .layers_0\.mlp\.down_proj. cuts dim 0 .* over tp=5, which does not divide it"):
        init_train_state(parallelize_module(m, mesh["tp"], _megatron("layers_*")), OPT, params=_params(m))


def test_sub_meshes_of_two_meshes_are_refused():
    a = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    b = spmd.init_device_mesh("cpu", (4, 2), mesh_dim_names=("fsdp", "tp"))
    pm = parallelize_module(_llama(), a["tp"], _megatron("layers_*"))
    with pytest.raises(ValueError, match=r"fully_shard: mesh=.* is cut from the mesh .* cut every sub-mesh from one mesh"):
        fully_shard(pm, mesh=b["fsdp"], units=["layers_*"])


def test_a_state_of_another_plan_is_refused():
    m = _llama()
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    a = fully_shard(m, mesh=mesh, units=["layers_*"])
    b = fully_shard(m, mesh=mesh, units=[])
    state = init_train_state(a, OPT, params=_params(m))
    step = make_train_step(b, lambda p, x: _ce(b.apply({"params": p}, x["inputs"]), x), OPT)
    with pytest.raises(ValueError, match=r"train_step: the state was laid out for another model or plan"):
        step(state, _batches())


def test_mp_policy_with_a_non_float_dtype_is_refused():
    with pytest.raises(ValueError, match=r"MixedPrecisionPolicy: param_dtype=.*int32.* is not a floating dtype"):
        MixedPrecisionPolicy(param_dtype=jnp.int32)


def test_a_batch_the_data_dims_do_not_divide_is_refused():
    m = _llama()
    mesh = spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "fsdp"))
    pm = fully_shard(m, mesh=mesh, units=["layers_*"])
    state = init_train_state(pm, OPT, params=_params(m))
    step = make_train_step(pm, lambda p, b: _ce(pm.apply({"params": p}, b["inputs"]), b), OPT)
    with pytest.raises(ValueError, match=r"the batch has 12 examples, not divisible by the data-parallel size "
                                         r"dp=2 x fsdp=4 = 8"):
        step(state, _batches(n=12))
