"""A re-gathering FSDP unit (``reshard_after_forward=True``) around a user's ``jax.custom_vjp`` / ``jax.custom_jvp``
functions, and gradient accumulation over a scanned stack under fsdp: what the compiled step recomputes and
copies, counted in its HLO against the keeping step's and the non-accumulated step's."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from _one_device import assert_trees_close, train_one_device
from spmd.parallel import fully_shard, init_train_state, make_train_step, unshard_tree


# --- a user's custom_vjp / custom_jvp functions, written the JAX docs' way: the forward rule calls the function --
@jax.custom_vjp
def _tanh_gate(x):  # a fused activation: x * tanh(x)
    return x * jnp.tanh(x)


def _tanh_gate_fwd(x):
    return _tanh_gate(x), (x, jnp.tanh(x))


def _tanh_gate_bwd(res, g):
    x, t = res
    return (g * (t + x * (1 - t * t)),)


_tanh_gate.defvjp(_tanh_gate_fwd, _tanh_gate_bwd)


def _inv_rms(x):
    return jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


@jax.custom_vjp
def _rms_norm(x, w):  # a custom norm with its scale parameter (gathered) as an input
    return x * _inv_rms(x) * w


def _rms_norm_fwd(x, w):
    return _rms_norm(x, w), (x, _inv_rms(x), w)


def _rms_norm_bwd(res, g):
    x, r, w = res
    y, gy = x * r, g * w
    return r * (gy - y * jnp.mean(y * gy, -1, keepdims=True)), jnp.sum(g * y, axis=tuple(range(g.ndim - 1)))


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_jvp
def _unit_norm(x):
    return x * _inv_rms(x)


@_unit_norm.defjvp
def _unit_norm_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _unit_norm(x)
    return y, _inv_rms(x) * (dx - y * jnp.mean(y * dx, -1, keepdims=True))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.ones, (32,))
        h = nn.Dense(48)(_rms_norm(_unit_norm(x), w))
        return x + nn.Dense(32)(_tanh_gate(h))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, t):
        x = nn.Embed(16, 32)(t)
        for i in range(2):
            x = _Block(name=f"layers_{i}")(x)
        return nn.Dense(16)(x)


def _ce(logits, batch):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


@pytest.mark.slow
def test_regathering_keeps_a_custom_vjp_functions_outputs():
    """A user's ``jax.custom_vjp`` inside a re-gathering unit runs its forward once, as in the keeping step: the
    ``tanh`` of the fused activation (the only ``tanh`` of the model) is as many in the lowered and in the
    compiled re-gathering step as in the keeping step's, and none in the backward pass's scope (``REGATHER``).
    The policy (every value kept but the gathered parameters) once dropped a ``custom_vjp_call``'s outputs
    (the mixed-precision gather is one): a forward rule calling the function itself ran it again in every
    block's backward pass (lowered 6 tanh vs 4, compiled 2 of 4 in ``REGATHER``). The step also trains equal to
    1-device training (SGD, 3 steps, 1e-5), with a ``custom_jvp`` norm and a ``custom_vjp`` norm over its
    gathered scale."""
    from spmd.parallel.styles._fully_shard import REGATHER

    model = _Net()
    rng = np.random.default_rng(0)
    batches = [{"inputs": (t := rng.integers(0, 16, (16, 8)).astype(np.int32)), "targets": np.roll(t, 1, axis=1)}
               for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    opt = optax.sgd(0.1)
    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    lowered, compiled = {}, {}
    for regather in (True, False):
        laid = fully_shard(model, mesh=mesh, units=["layers_*"], reshard_after_forward=regather)
        step = make_train_step(laid, lambda p, b, m=laid: _ce(m.apply({"params": p}, b["inputs"]), b), opt)
        state = init_train_state(laid, opt, batches[0]["inputs"], params=params)
        low = step.lower(state, batches[0])
        lowered[regather], compiled[regather] = low.as_text(), low.compile().as_text()
        if regather:
            losses = []
            for b in batches:
                state, metrics = step(state, b)
                losses.append(float(metrics["loss"]))
            ref_losses, ref = train_one_device(params, batches, lambda p, b: _ce(model.apply({"params": p},
                                                                                            b["inputs"]), b), opt)
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
            assert_trees_close(unshard_tree(state.params, state.plan, mesh), ref.params, atol=1e-5)
    tanh = [len(re.findall(r"stablehlo\.tanh ", lowered[r])) for r in (True, False)]
    assert tanh[0] == tanh[1] > 0, tanh
    tanh = [len(re.findall(r" tanh\(", compiled[r])) for r in (True, False)]
    assert tanh[0] == tanh[1] > 0, tanh
    backward = [line for line in compiled[True].splitlines() if re.search(r" (tanh|rsqrt)\(", line)
                and REGATHER in line]
    assert backward == [], backward[:3]


def _computations(text: str) -> dict[str, list[str]]:
    """The compiled HLO module's computations by name (``ENTRY`` for the entry), each its lines."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"(ENTRY|%[\w.\-]+) ", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if head.group(1) == "ENTRY" else head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


@pytest.mark.slow
def test_accumulating_a_scanned_stack_copies_no_kernel_per_micro_batch():
    """Gradient accumulation (``accum_steps=2``, torch's ``no_sync``: every unit gathered once, the full local
    gradients summed over the micro-batches, reduced once) over an ``nn.scan`` stack under fsdp=8: in the
    compiled step each full stacked kernel (``[L, in, out]``, read off the parameters) is all-gathered in the
    entry computation, once per step, never inside the accumulation loop; inside the loop, the only copies of a
    full stacked kernel's shape are of broadcasts (the backward scan's zero gradient stacks, the full-size
    kin of the non-accumulated step's shard-sized ones), no copy of a gathered kernel or of the running sum.
    Measured: 3 such zero copies per micro-batch ([3,64,32], [3,64,64], [3,64,96]) of 7 stacked kernels; the
    non-accumulated step gathers layer by layer inside the scan (no all-gather of a full stacked kernel)."""
    from tests.parallel.test_scan_blocks import EXAMPLE, LAYERS, MODEL, OPT, _batch, _loss

    mesh = spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    model = fully_shard(MODEL, mesh=mesh, units=["layers"])
    params = MODEL.init(jax.random.key(0), EXAMPLE)["params"]
    full = {f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(params["layers"]) if x.ndim == 3}
    assert all(s.startswith(f"f32[{LAYERS},") for s in full) and len(full) >= 3, full
    state = init_train_state(model, OPT, jax.random.key(0), EXAMPLE)
    texts = {k: make_train_step(model, _loss(model), OPT, accum_steps=k).lower(state, _batch()).compile().as_text()
             for k in (1, 2)}

    def ops(lines, op):
        return [(m.group(1), line) for line in lines if (m := re.search(rf"= (f32\[[\d,]+\])\S* {op}\(", line))]

    plain = _computations(texts[1])
    assert not [s for lines in plain.values() for s, _ in ops(lines, "all-gather") if s in full]
    comps = _computations(texts[2])
    gathered = {name: [s for s, _ in ops(lines, "all-gather") if s in full] for name, lines in comps.items()}
    assert set(gathered["ENTRY"]) == full, gathered["ENTRY"]
    assert not [n for n, g in gathered.items() if g and n != "ENTRY"], gathered
    loops = [re.search(r"body=(%[\w.\-]+)", line).group(1) for line in comps["ENTRY"] if " while(" in line]
    accum = [b for b in loops if any(" while(" in line for line in comps[b])]  # the loop around the scans
    assert len(accum) == 1, loops
    body = comps[accum[0]]
    defs = {m.group(1): line for line in body if (m := re.match(r"\s*(%[\w.\-]+) = ", line))}
    copies = [re.search(r" copy\((%[\w.\-]+)", line).group(1) for s, line in ops(body, "copy") if s in full]
    # a broadcast (XLA names it after the jaxpr's call) or a fusion wrapping one
    zeros = [c for c in copies if " broadcast(" in defs.get(c, "") or "broadcast" in c]
    assert zeros == copies, [defs.get(c, c) for c in copies]
    assert 0 < len(copies) <= len(full), copies
