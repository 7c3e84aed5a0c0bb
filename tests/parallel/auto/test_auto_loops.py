"""A loop's trips in a compiled program's cost: XLA's ``cost_analysis()`` counts a ``while`` body once; the
other trips are added from the HLO (``spmd.parallel.cost._loops``), so a scanned stack of blocks costs what
the same blocks unrolled do, under ``auto_layout(hardware=)`` too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import Llama, LlamaConfig
from spmd.parallel import Layout, auto_layout
from spmd.parallel.cost._loops import loop_extra
from spmd.parallel.cost._memory import _cost


def test_a_scan_of_matmuls_costs_every_trip():
    """5 trips of an [8, 16] x [16, 16] matmul: 5 x 2 x 8 x 16 x 16 flops (NumPy's count), where XLA's own
    analysis counts one trip; the loop's counter adds a few flops more."""
    x, ws = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
    exe = jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (c @ w, None), x, ws)[0]).lower(x, ws).compile()
    raw = exe.cost_analysis()
    raw = raw[0] if isinstance(raw, (list, tuple)) else raw
    want = 5 * 2 * 8 * 16 * 16
    assert raw["flops"] < 0.3 * want  # XLA: the body once
    flops, _ = _cost(exe)
    assert want <= flops <= want * 1.005, (flops, want)
    assert loop_extra(jax.jit(lambda x, w: x @ w).lower(x, ws[0]).compile().as_text()) == (0.0, 0.0)


def _flops(scan: bool) -> float:
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      scan_layers=scan)
    model = Llama(cfg)
    toks = np.random.default_rng(0).integers(0, 32, (8, 16)).astype(np.int32)
    batch = {"inputs": toks, "targets": toks}
    params = jax.eval_shape(model.init, jax.random.key(0), toks)["params"]
    got = auto_layout(model, optax.sgd(0.1), batch, 8, layouts=[Layout(dp=8)], hardware="h100", params=params)
    return got.best.flops


@pytest.mark.slow  # four compiles: each model's one-device step and its dp=8 step
def test_a_scanned_stack_costs_what_the_unrolled_one_does_under_hardware():
    """models.Llama, 4 blocks as a Python list and as one nn.scan: the compiled dp=8 step's flops agree within
    2% (XLA's own count of the scanned one is about a quarter)."""
    unrolled, scanned = _flops(False), _flops(True)
    assert scanned == pytest.approx(unrolled, rel=0.02), (scanned, unrolled)
