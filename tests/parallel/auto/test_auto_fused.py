"""A fused attention call (``jax.nn.dot_product_attention(implementation="cudnn")``) as ``auto_layout(hardware=)``
prices it for a GPU (``spmd.parallel.auto._fused``): the planning kernel computes XLA's attention (values and
gradients); its matmul flops are FlashAttention's, counted by hand (the tiles on or below the diagonal, 2
matmuls forward and 5 backward a tile) and equal to what the search's bound reads and what XLA's compiled
cost counts; its compiled peak holds no ``T x T`` scores where XLA's own lowering holds them, and its compiled bytes are what the
kernel moves to and from the device's memory (the tiles it reads, the accumulator tiles it updates), not every
intermediate of a tile (the scores, their softmax) as XLA:CPU's count of the loop's body has it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.parallel import Hardware
from spmd.parallel.auto._fused import flash_attention, fused_attention
from spmd.parallel.auto._priced import dot_flops
from spmd.parallel.cost._loops import ON_CHIP, _Cost, loop_extra
from spmd.parallel.cost._memory import _cost

B, T, N, K, D = 2, 64, 4, 2, 8


def _qkv(t=T, dtype=jnp.float32):
    r = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(r[0], (B, t, N, D), dtype), jax.random.normal(r[1], (B, t, K, D), dtype),
            jax.random.normal(r[2], (B, t, K, D), dtype), jax.random.normal(r[3], (B, t, N, D), dtype))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_the_planning_kernel_computes_xlas_attention_and_its_gradients(causal):
    q, k, v, do = _qkv()
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    got = lambda q, k, v: flash_attention(q, k, v, is_causal=causal, block=16)  # noqa: E731
    np.testing.assert_allclose(got(q, k, v), ref(q, k, v), atol=2e-6)
    for a, b in zip(jax.vjp(got, q, k, v)[1](do), jax.vjp(ref, q, k, v)[1](do)):
        np.testing.assert_allclose(a, b, atol=5e-6)


def _flash_matmul_flops(t, b, causal):
    """FlashAttention's matmuls, by hand: per computed (query tile, key tile) pair and query head, Q K^T and P V
    forward, Q K^T, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q backward: 7 products of 2 b b D; plus the
    backward's row sums delta = rowsum(dO * O) (2 T N D a sequence, a dot_general over D)."""
    n = t // b
    pairs = n * (n + 1) // 2 if causal else n * n
    return B * (pairs * 7 * 2 * b * b * D * N + 2 * t * N * D)


@pytest.mark.parametrize("causal", [True, False])
def test_the_bound_and_the_compiled_cost_count_flash_attentions_matmuls(causal):
    q, k, v, do = _qkv()

    def loss(w, x):  # the gradient of w's three operands: the forward and the whole backward
        return jnp.sum(flash_attention(x * w["q"], w["k"], w["v"], is_causal=causal, block=16) * do)

    w = {"q": q, "k": k, "v": v}
    want = _flash_matmul_flops(T, 16, causal)
    assert dot_flops(loss, w, jnp.ones_like(q)) == want  # the scan's 10 / 16 trips, each counted
    exe = jax.jit(jax.grad(loss)).lower(w, jnp.ones_like(q)).compile()
    flops, _ = _cost(exe)  # XLA's count with the loops' other trips added (cost._loops)
    assert want <= flops <= want * 1.3, (flops, want)  # the softmax's elementwise work on top, no more
    assert loop_extra(exe.as_text())[0] > 0  # the tiles run as a loop XLA counts once


@pytest.mark.slow
def test_the_fused_peak_holds_no_scores_where_xlas_lowering_holds_them():
    t = 4096  # shapes only: nothing allocated
    q, k, v, do = (jax.ShapeDtypeStruct((B, t, h, D), jnp.float32) for h in (N, K, K, N))
    scores = B * N * t * t * 4  # one float32 [B, heads, T, T]: 512 MiB

    def temp(impl):
        def loss(q, k, v, do):
            return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl) * do)

        with fused_attention(Hardware.named("h100")):
            exe = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, do).compile()
        return exe.memory_analysis().temp_size_in_bytes

    assert temp("xla") >= scores  # XLA's lowering: the scores (and their gradient) in memory
    assert temp("cudnn") < scores / 8  # the kernel: a few 512 x 512 tiles (8 MiB each), O(T D) accumulators


def test_a_masked_cudnn_call_is_refused_naming_the_argument():
    q, k, v, _ = _qkv()
    with fused_attention(Hardware.named("h100")), pytest.raises(ValueError, match=re.escape(
            "implementation='cudnn') traced for auto_layout(hardware=): mask='ArrayImpl' is not None")):
        jax.nn.dot_product_attention(q, k, v, mask=jnp.ones((B, N, T, T), bool), implementation="cudnn")


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def test_only_hardware_with_the_kernel_installs_it_and_only_while_open():
    """A cudnn call is traced as the planning kernel (XLA's values) inside ``fused_attention`` of hardware with the
    kernel; for other hardware and after the context it is jax's own (on CPU: refused, no cuDNN)."""
    q, k, v, _ = _qkv()
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    with fused_attention(Hardware.named("tpu-v5p")), pytest.raises(RuntimeError):
        _cudnn(q, k, v)
    with fused_attention(Hardware.named("h100")):
        np.testing.assert_allclose(_cudnn(q, k, v), ref, atol=2e-6)
    with pytest.raises(RuntimeError):
        _cudnn(q, k, v)


def test_the_kernel_runs_only_in_the_context_that_installed_it():
    """``fused_attention`` is per context (``spmd.parallel.context._dispatch.kernel_installed``: a
    ``contextvars.ContextVar``, as cp's attention), not a module attribute swapped while a plan traces: another
    thread's cudnn call meanwhile runs jax's own (on CPU: refused), not the planning kernel."""
    import threading

    q, k, v, _ = _qkv()
    ref = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    inside, release, got = threading.Event(), threading.Event(), {}

    def plan():
        try:
            with fused_attention(Hardware.named("h100")):
                got["kernel"] = np.asarray(_cudnn(q, k, v))
                inside.set()
                release.wait(60)
        finally:
            inside.set()

    t = threading.Thread(target=plan)
    t.start()
    try:
        assert inside.wait(60)
        with pytest.raises(RuntimeError):
            _cudnn(q, k, v)  # while the other thread's context is open
    finally:
        release.set()
        t.join(60)
    np.testing.assert_allclose(got["kernel"], ref, atol=2e-6)


def test_one_more_attention_layer_adds_its_saved_values_not_the_loops_accumulators():
    """The kernel's loop carries (the output / statistics accumulators forward, dQ / dK / dV backward, float32)
    are made from the loop's operands: built as broadcast constants, XLA:CPU gave each loop a copy scheduled at
    the step's start and held every layer's to its backward pass (Llama 3 70B fsdp=32,tp=8: 0.57 GiB a layer).
    One more layer of ``x + attention(x)`` adds what its backward keeps, counted from the shapes (q = the
    layer's input, the k and v slices, the float32 output, the log-sum-exp), plus at most one q-shaped float32
    buffer; with the copies held it added the backward's accumulators on top (10.5 MB here against 8.4)."""
    b, t, n, k, d = 2, 1024, 4, 2, 64

    def peak(layers):
        def loss(x):
            for _ in range(layers):
                x = x + flash_attention(x, x[:, :, :k], x[:, :, k:], is_causal=True, block=128)
            return jnp.sum(x * x)

        x = jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)
        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes

    f32 = 4
    saved = (b * t * n * d + 2 * b * t * k * d + b * t * n * d) * f32 + b * n * t * f32  # q, k, v, out, lse
    grew = [peak(3) - peak(2), peak(4) - peak(3)]
    assert max(grew) <= saved + b * t * n * d * f32 + 4096, (grew, saved)


def _kernel_loops(text):
    """``[(trips, (bytes a trip, bytes once), XLA:CPU's count of one trip)]`` of the ``ON_CHIP`` loops of an HLO
    module."""
    c = _Cost(text)
    got = []
    for ins in c.comps.values():
        for _, _, op, rest in ins:
            if op == "while" and ON_CHIP in rest:
                body = re.search(r"body=%?([\w.\-]+)", rest)[1]
                trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)[1])
                got.append((trips, c.kernel_bytes(body), c.cost(body, False)[1]))
    return got


@pytest.mark.parametrize("d", [32, 64])
def test_the_kernels_bytes_are_its_tiles_not_its_intermediates(d):
    """Float32 q = k = v [1, 2048, 4, d], 512-row tiles, causal: 10 (query tile, key tile) pairs. By hand, a
    forward trip reads a q, k and v tile and reads and writes the output tile and the running max and sum
    (``b x heads x (5 d + 4)`` floats); a backward trip reads q, k, v and dO tiles, the log-sum-exp and delta
    rows, and reads and writes the dQ, dK and dV tiles (``b x heads x (10 d + 4)``). The count is that, plus at
    most one more tile (a fusion reading a slice twice) and the loop counter, and nothing read whole once; XLA:CPU
    counts a trip's scores and softmax too (``b x b x heads`` floats, several times: over 20x this at d 32)."""
    b, t, h = 512, 2048, 4
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    f = jax.grad(lambda q, k, v: flash_attention(q, k, v, is_causal=True).sum(), argnums=(0, 1, 2))
    loops = _kernel_loops(jax.jit(f).lower(x, x, x).compile().as_text())
    tile = b * h * d * 4
    forward, backward = b * h * (5 * d + 4) * 4, b * h * (10 * d + 4) * 4
    assert [n for n, _, _ in loops] == [10, 10]
    got = sorted(loops, key=lambda x: x[1][0])
    for (_, (trip, once), xla), want in zip(got, (forward, backward)):
        assert want <= trip <= want + tile + 64 and once == 0, (trip, once, want)
        assert xla > 20 * trip * (32 / d), (xla, trip)
    exe = jax.jit(f).lower(x, x, x).compile()
    total = exe.cost_analysis()
    total = (total[0] if isinstance(total, (list, tuple)) else total)["bytes accessed"]
    # the step's bytes: XLA's count, each kernel loop's one trip as XLA counts it replaced by its trips' traffic
    assert _cost(exe)[1] == pytest.approx(total + sum(n * trip + once - xla for n, (trip, once), xla in loops),
                                          rel=1e-3)
