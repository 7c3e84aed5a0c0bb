"""The pre-trace bound on a tensor-parallel layout's activation collectives (``_priced.tp_traffic`` /
``tp_floor``): read off the one-device gradient's matmuls, it counts each dot that contracts a cut parameter's
cut dim as one reduction of its result and each distinct operand a cut parameter's dot needs whole as one
gather (by hand on a two-layer MLP); on models.Transformer and a GQA Llama it equals the step's own table where
every reduction is a matmul's, and it is below the table (and its price below the priced step's) everywhere."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import Llama, LlamaConfig
from models._plans import decoder_tp_plan, transformer_tp_plan
from placements import Shard
from spmd.parallel import ColwiseParallel, Hardware, Layout, Link, RowwiseParallel
from spmd.parallel.auto._auto import default_loss, evaluate_layout
from spmd.parallel.auto._priced import HardwareRates, comm_floor, tp_floor, tp_traffic
from spmd.parallel.styles import weight_stationary_plan
from tests.parallel.auto.test_auto_search import MODEL, OPT, U, VOCAB, _batch

B, D, F = 6, 4, 8


class _TwoIn(nn.Module):
    """``down(relu(a(h)) * b(h))``, ``h = x * scale``: two column-parallel layers reading one input (a
    parameter's function, so its gradient is taken), one row-parallel layer."""

    @nn.compact
    def __call__(self, x):
        h = x * self.param("scale", nn.initializers.ones, (D,))
        return nn.Dense(D, name="down")(nn.relu(nn.Dense(F, name="a")(h)) * nn.Dense(F, name="b")(h))


PLAN = (("a", ColwiseParallel()), ("b", ColwiseParallel()), ("down", RowwiseParallel()))
# the activations cut between modules on the batch (the weight-stationary form of sequence parallelism)
CUT = (("a", ColwiseParallel(input_layouts=Shard(0))), ("b", ColwiseParallel(input_layouts=Shard(0))),
       ("down", RowwiseParallel(output_layouts=Shard(0))))


def _kinds(ar=None, rs=None, ag=None, dtype="float32") -> dict:
    return {k: ({dtype: n} if n else {}) for k, n in (("all-reduce", ar), ("reduce-scatter", rs), ("all-gather", ag))}


def test_the_traffic_is_counted_by_hand():
    """Reductions: down's output forward, a's and b's input gradients backward (each dot its own, as each styled
    call redistributes its own): 3 of ``[B, D]``, all-reduced where the activations are whole between modules,
    reduce-scattered where the styles cut them. Whole operands, gathered only where cut: h (a and b share it:
    one) forward, down's output gradient backward (its input gradient's dot keeps the cut): 2 of ``[B, D]``.
    The kernels' gradients (``x^T dy``) read no parameter: nothing."""
    m = _TwoIn()
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    params = jax.eval_shape(lambda x: m.init(jax.random.key(0), x)["params"], x)

    def loss(p, x):
        return jnp.sum(m.apply({"params": p}, x) ** 2)

    assert tp_traffic(loss, params, x, PLAN) == _kinds(ar=3 * B * D)
    assert tp_traffic(loss, params, x, CUT) == _kinds(rs=3 * B * D, ag=2 * B * D)
    # a cast parameter (mixed precision's compute copy) is followed, the cut dim with it
    bf = lambda p, x: loss(jax.tree.map(lambda w: w.astype(jnp.bfloat16), p), x.astype(jnp.bfloat16))  # noqa: E731
    assert tp_traffic(bf, params, x, CUT) == _kinds(rs=3 * B * D, ag=2 * B * D, dtype="bfloat16")
    # a transposed one too: cut on dim 1, used transposed (cut on dim 0, contracted): its result reduced; x is
    # no parameter's function, so its gradient is not taken
    w = {"a": {"kernel": jax.ShapeDtypeStruct((F, D), jnp.float32)}}
    assert tp_traffic(lambda p, x: jnp.sum(x @ p["a"]["kernel"].T), w, x, (("a", ColwiseParallel()),)) == _kinds(
        ar=B * F)
    # a plan its styles cannot place (nothing to cut on a scalar) moves nothing here: the trace names the error
    assert tp_traffic(lambda p, x: jnp.sum(x) * p["s"], {"s": jax.ShapeDtypeStruct((), jnp.float32)}, x,
                      (("", ColwiseParallel()),)) == _kinds()


def _tp(plan: dict, **kw) -> Layout:
    return Layout(tp_plan=tuple(plan.items()), **kw)


LLAMA = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2))
FREE = Hardware("no latency", {"float32": 67e12, "bfloat16": 989e12}, 80e9, 3.35e12, 4, Link(450e9, 0.0),
                Link(50e9, 0.0))


@pytest.mark.parametrize("case", ["transformer dp2-tp4", "transformer fsdp2-tp4 sp", "transformer dp2-tp4 ws",
                                  "transformer fsdp2-tp4 bf16", "llama dp4-tp2", "llama fsdp2-tp2 bf16"])
def test_the_traffic_against_the_steps_own_table(case):
    """Per device (the batch split over dp x fsdp): the Transformer's 2 blocks reduce 4 matmul results each
    (attention and MLP out forward, their inputs' gradients backward) and the tied head's input gradient: 9 of
    ``[b, t, d]``, and need as many whole operands (each block's two inputs forward and two outputs' gradients
    backward, the head's input). Its table has one reduction more (the vocabulary-parallel embedding's lookup:
    a gather, not a matmul) and, under sequence parallelism, more gathers. A Llama with the blocks alone in the
    plan reduces 7 a block (q, k, v inputs' gradients apart) and needs 4 whole, its table exactly that. The
    bound's price is at most the step's, also with links of no latency (bytes alone)."""
    model_name, mesh, *rest = case.split()
    batch = _batch()
    model = MODEL if model_name == "transformer" else LLAMA
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch["inputs"])["params"])
    sp, ws, mp = "sp" in rest, "ws" in rest, "bfloat16" if "bf16" in rest else None
    dims = dict((k.rstrip("0123456789"), int(k[len(k.rstrip("0123456789")):])) for k in mesh.split("-"))
    if model is MODEL:
        plan = transformer_tp_plan(sp or ws, vocab_size=VOCAB, tp_size=dims["tp"])
        plan = weight_stationary_plan(plan) if ws else plan
        per_block, whole = 4, 9
    else:
        plan, per_block, whole = decoder_tp_plan(model), 7, 8
    lay = _tp(plan, **dims, units=U if "fsdp" in dims and model is MODEL else ("layers_*",) if "fsdp" in dims else (),
              sequence_parallel=sp, weight_stationary=ws, mixed_precision=mp)
    traffic = tp_traffic(default_loss(model), params, batch, lay.tp_plan)
    b, t = batch["inputs"].shape
    width = 32
    extra = 1 if model is MODEL else 0  # the tied head's input gradient
    n = (2 * per_block + extra) * b * t * width
    assert traffic == (_kinds(rs=n, ag=whole * b * t * width) if sp or ws else _kinds(ar=n)), traffic
    table = evaluate_layout(model, OPT, batch, jax.devices()[:lay.size], lay, params=params,
                            calibration=HardwareRates(Hardware.named("h100"), "float32", group_size=lay.size))
    acts = table.communication["activations"]
    # models.Transformer's layers take dtype=float32 (flax computes in it whatever the policy's parameters); the
    # Llama's compute in the parameters' dtype, the policy's bfloat16
    item = 2 if mp and model is LLAMA else 4
    per_device = (2 * per_block + extra) * b * t * width * item // lay.n_data
    if sp or ws:
        assert acts["reduce-scatter"]["bytes"] >= per_device and acts["all-gather"]["bytes"] >= per_device, acts
    elif model is MODEL:
        assert acts["all-reduce"]["bytes"] == per_device + b * t * width * 4 // lay.n_data, acts  # + the lookup
    else:
        assert acts["all-reduce"]["bytes"] == per_device, acts
    for hw in (Hardware.named("h100"), FREE):
        c = table if hw.name == "h100" else evaluate_layout(
            model, OPT, batch, jax.devices()[:lay.size], lay, params=params, calibration=HardwareRates(hw, "float32",
                                                                                                 group_size=lay.size))
        floor = tp_floor(lay, hw, traffic)
        assert 0 < floor and floor + comm_floor(lay, hw, params) <= sum(c.comm_s.values()) * (1 + 1e-9), (
            hw.name, floor, c.comm_s)


def test_the_floor_is_zero_off_tp_and_where_the_batch_splits_otherwise():
    traffic = _kinds(ar=1 << 20)
    hw = Hardware.named("h100")
    plan = decoder_tp_plan(LLAMA)
    assert tp_floor(Layout(dp=8), hw, traffic) == 0.0
    assert tp_floor(_tp(plan, dp=2, cp=2, tp=2), hw, traffic) == 0.0
    assert tp_floor(_tp(plan, pp=2, dp=2, tp=2, units=("layers_*",)), hw, traffic) == 0.0
    got = tp_floor(_tp(plan, dp=4, tp=2), hw, traffic)
    assert got == pytest.approx(hw.collective_s("all-reduce", 4 * (1 << 20) / 4, 2, 1))
    assert np.isfinite(got)
