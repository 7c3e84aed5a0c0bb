"""The activation-checkpointing policies beyond ``"full"`` / ``"dots"`` (``spmd.parallel.styles._remat.POLICIES``):
torchtitan's selective op AC, MaxText's ``minimal`` and named policies, offload (refused on CPU), under every FSDP
mode, and what ``auto_layout`` weighs of them.

- every policy on ``fully_shard`` re-gathering and keeping its gathers trains ``models.Llama`` (which names its
  projections as MaxText does) as 2 SGD steps of one device do, within 1e-5;
- the compiled step's peak (``memory_analysis()``: argument + output + temp - alias) falls as a policy keeps less:
  full <= save_qkv_proj <= selective <= none, full <= minimal <= dots, in a fresh process under XLA:CPU's
  memory-minimizing scheduler (the default one hoists the recomputation back beside the forward pass);
- ``"offload"`` is refused by name on CPU (host and device memory are one there), by ``activation_checkpointing``
  and by ``auto_layout``, which lists the reason among its rejected; a named policy is weighed only on a model
  naming those tensors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from models import Llama, LlamaConfig
from spmd.parallel import activation_checkpointing, fully_shard, init_train_state, make_train_step, unshard_params
from spmd.parallel.auto._budget import CHECKPOINTING, weighed_policies
from spmd.parallel.styles._remat import POLICIES, checkpoint_policy
from tests._one_device import assert_trees_close, train_one_device

CFG = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
RUNNABLE = [p for p in POLICIES if p != "offload"]


def _batches(n=2, b=8, t=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32),
             "labels": rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)} for _ in range(n)]


def _loss(model):
    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    return loss_fn


@pytest.mark.slow
@pytest.mark.parametrize("raf", [True, False], ids=["regather", "keep"])
@pytest.mark.parametrize("policy", RUNNABLE)
def test_every_policy_under_every_fsdp_mode_equals_one_device(policy, raf):
    model, batches, opt = Llama(CFG), _batches(), optax.sgd(0.1)
    params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
    ref_losses, ref = train_one_device(params, batches, _loss(model), opt)
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    laid = activation_checkpointing(fully_shard(model, mesh=mesh, units=["layers_*"], reshard_after_forward=raf),
                                    units=["layers_*"], policy=policy)
    state = init_train_state(laid, opt, params=params)
    step = make_train_step(laid, _loss(model), opt)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_trees_close(unshard_params(laid, state), ref.params)


def test_selective_keeps_what_torchtitan_keeps():
    """The residuals of one Llama block (7 projections: q, k, v, o, gate, up, down; the attention's two batched
    products) beside its input: "selective" keeps the 1st, 3rd, 5th and 7th projection (q, v, gate; down's
    output no backward pass reads) and the attention's second product (probs @ v, not the scores), as
    torchtitan's op SAC; "minimal" the projections; "save_qkv_proj" the named q, k, v; "dots" every matmul;
    "full" nothing but the input."""
    from models._llama import DecoderLayer

    layer, x = DecoderLayer(CFG), jnp.ones((2, 8, CFG.hidden_size))
    p = layer.init(jax.random.key(0), x)["params"]
    hd = CFG.hidden_size // CFG.num_heads
    shapes = [tuple(a.shape) for a in jax.tree.leaves(p)]

    def saved(policy):
        f = jax.checkpoint(lambda p, x: layer.apply({"params": p}, x).sum(), policy=checkpoint_policy(policy))
        res = [tuple(a.shape) for a in jax.tree.leaves(jax.eval_shape(lambda p, x: jax.vjp(f, p, x)[1], p, x))
               if tuple(a.shape) not in shapes]
        res.remove(x.shape)  # the block's input, kept by every policy
        return sorted(res)

    q, kv, f = (2, 8, CFG.hidden_size), (2, 8, CFG.num_kv_heads * hd), (2, 8, CFG.intermediate_size)
    scores, pv = (2, CFG.num_heads, 8, 8), (2, CFG.num_heads, hd, 8)  # dot_general's output layouts
    assert saved("full") == []
    assert saved("selective") == sorted([q, kv, f, pv])
    assert saved("minimal") == sorted([q, kv, kv, q, f, f])
    assert saved("save_qkv_proj") == sorted([q, kv, kv])
    assert saved("save_dot_except_mlp") == sorted([q, kv, kv, q])
    assert saved("dots") == sorted([q, kv, kv, q, f, f, scores, pv])


def test_offload_is_refused_on_cpu():
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    with pytest.raises(ValueError, match=re.escape("activation_checkpointing: policy='offload' cannot run here: policy "
                                                   "'offload' copies the saved matmul outputs from the device's memory "
                                                   "to the host's, but on 'cpu' devices they are one memory")):
        activation_checkpointing(fully_shard(Llama(CFG), mesh=mesh, units=["layers_*"]), units=["layers_*"],
                                 policy="offload")
    with pytest.raises(ValueError, match=re.escape("policy='offload' cannot run here")):
        activation_checkpointing(Llama(CFG), units=["layers_*"], policy="offload")


class _Unnamed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Embed(24, 16)(x)
        for i in range(2):
            x = x + nn.Dense(16, name=f"layers_{i}")(x)
        return nn.Dense(24)(x)


def test_auto_layout_weighs_offload_nowhere_on_cpu_and_named_policies_on_named_models():
    b = _batches(1)[0]
    devices = jax.devices()
    llama = Llama(CFG)
    p = jax.eval_shape(llama.init, jax.random.key(0), b["tokens"])["params"]
    rejected = []
    got = weighed_policies(_loss(llama), p, b, devices, rejected)
    assert got == tuple(c for c in CHECKPOINTING if c != "offload")
    assert [n for n, _ in rejected] == ["ac=offload"] and "on 'cpu' devices they are one memory" in rejected[0][1]
    plain = _Unnamed()
    q = jax.eval_shape(plain.init, jax.random.key(0), b["tokens"])["params"]
    rejected = []
    got = weighed_policies(_loss(plain), q, b, devices, rejected)
    assert got == ("dots", "minimal", "selective", "full")
    assert sorted(n for n, _ in rejected) == ["ac=offload", "ac=save_dot_except_mlp", "ac=save_dot_except_mlpwi",
                                              "ac=save_qkv_proj"]
    assert "the model names none of the tensors 'save_qkv_proj' keeps" in dict(rejected)["ac=save_qkv_proj"]


_PEAKS = r"""
import json
import jax, numpy as np, optax
import spmd
from models import Llama, LlamaConfig
from spmd.parallel import activation_checkpointing, fully_shard, init_train_state, make_train_step
from spmd.parallel.step._protocol import StepMemory

cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
net = Llama(cfg)
toks = np.random.default_rng(0).integers(0, 32, (16, 64)).astype(np.int32)
batch = {"tokens": toks, "labels": toks}
params = jax.eval_shape(net.init, jax.random.key(0), toks)["params"]

def loss_fn(p, b):
    logits = net.apply({"params": p}, b["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
out = {}
for raf in (True, False):
    for policy in (None, "dots", "minimal", "selective", "save_qkv_proj", "full"):
        m = fully_shard(net, mesh=mesh, units=["layers_*"], reshard_after_forward=raf)
        m = m if policy is None else activation_checkpointing(m, units=["layers_*"], policy=policy)
        opt = optax.sgd(0.1)
        state = jax.eval_shape(lambda: init_train_state(m, opt, params=params))
        exe = make_train_step(m, loss_fn, opt).lower(state, batch).compile()
        out[f"{'regather' if raf else 'keep'}/{policy}"] = StepMemory.from_compiled(exe).peak
print(json.dumps(out))
"""


@pytest.mark.slow
def test_compiled_peaks_fall_as_a_policy_keeps_less():
    """Llama d64 x 4 blocks, seq 64, 2 sequences per device, fsdp=8 re-gathering and keeping its gathers."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                      "--xla_cpu_enable_concurrency_optimized_scheduler=false", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _PEAKS], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    print(peak)
    for mode in ("regather", "keep"):
        g = {k.split("/")[1]: v for k, v in peak.items() if k.startswith(mode)}
        assert g["full"] <= g["save_qkv_proj"] <= g["selective"] <= g["None"], (mode, g)
        assert g["full"] <= g["minimal"] <= g["dots"], (mode, g)
        assert g["full"] < g["None"], (mode, g)
