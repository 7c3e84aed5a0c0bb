"""pp x fsdp x ep x tp together: ``models.MoE`` (experts in every block) on pp=2 x fsdp=2 x ep=2 x tp=2, 16 CPU
devices, in its own process (``_pp_fsdp_ep_tp.py``; the tests' processes have 8): 3 steps of SGD with momentum equal
one device's (losses, parameters and momenta) within 1e-5, and every collective of the compiled program equal to
the pipeline's table."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow  # a 16-device program compiled in a subprocess (~1.5 min on 2 cores)
def test_moe_pipeline_on_pp2_fsdp2_ep2_tp2_equals_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16")
    out = subprocess.run([sys.executable, "-m", "tests.parallel.pipelining._pp_fsdp_ep_tp"], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got["losses"], got["ref_losses"], rtol=1e-5, atol=1e-5)
    assert got["params"] < 1e-5 and got["opt_state"] < 1e-5
    # the stacked experts [stages, E, d, f]: stages over pp, f over fsdp, experts over ep, whole over tp; q_proj
    # [stages, d, heads x hd]: d over fsdp, the heads' columns over tp
    assert got["placements"] == {"stages/mlp/experts/gate_proj": [["S(0)", "S(3)", "S(1)", "R"], [1, 4, 16, 16]],
                                 "stages/self_attn/q_proj/kernel": [["S(0)", "S(1)", "R", "S(2)"], [1, 8, 8]]}
    table, hlo = got["table"], got["hlo"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):  # buffers and bytes
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (table[kind]["buffers"], table[kind]["bytes"]), kind
    for kind in ("all-to-all", "collective-permute"):
        assert (hlo[kind]["count"], hlo[kind]["bytes"]) == (table[kind]["count"], table[kind]["bytes"]), kind
    # per device and micro-batch: 8 rows / (fsdp=2 x ep=2 x M=2) = 1 row -> buffers [1, 8 experts, capacity 4, 16]
    # float32 = 2,048 B; 20 in the program (test_pipeline_experts.py: F-first x2, B-first x2, B-last x2 branches)
    assert table["all-to-all"] == {"count": 20, "bytes": 20 * 2048}
    # each stage parameter gathered once over fsdp, its gradient reduce-scattered once
    assert table["all-gather"]["buffers"] == table["reduce-scatter"]["buffers"] == 10
