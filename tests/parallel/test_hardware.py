"""``Hardware``: published figures as data, and the collective times that follow from them by the algorithm."""

import math
import re

import pytest

from spmd.parallel import HARDWARE, Hardware, Link


def _h(**kw):
    base = dict(name="toy", matmul_flops={"bfloat16": 1e15}, memory_bytes=8e10, memory_bandwidth=2e12,
                devices_per_node=8, intra=Link(100e9, 2e-6), inter=Link(10e9, 20e-6))
    return Hardware(**{**base, **kw})


@pytest.mark.parametrize("group,nbytes", [(2, 1 << 10), (4, 1 << 20), (8, 256 << 20)])
def test_ring_times_inside_a_node(group, nbytes):
    h, bw, lat = _h(), 100e9, 2e-6
    share = (group - 1) / group * nbytes / bw
    assert h.collective_s("all-gather", nbytes, group) == pytest.approx((group - 1) * lat + share)
    assert h.collective_s("reduce-scatter", nbytes, group) == pytest.approx((group - 1) * lat + share)
    assert h.collective_s("all-to-all", nbytes, group) == pytest.approx((group - 1) * lat + share)
    ring = 2 * ((group - 1) * lat + share)
    tree = 2 * math.ceil(math.log2(group)) * lat + 2 * nbytes / bw
    assert h.collective_s("all-reduce", nbytes, group) == pytest.approx(min(ring, tree))
    assert h.collective_s("collective-permute", nbytes, group) == pytest.approx(lat + nbytes / bw)


def test_all_reduce_takes_the_tree_when_latency_bound_and_the_ring_when_bandwidth_bound():
    h = _h(devices_per_node=64)
    small, large = 8, 1 << 30
    g = 64
    lat, bw = 2e-6, 100e9
    assert h.collective_s("all-reduce", small, g) == pytest.approx(2 * 6 * lat + 2 * small / bw)
    assert h.collective_s("all-reduce", large, g) == pytest.approx(2 * (63 * lat + 63 / 64 * large / bw))


@pytest.mark.parametrize("group,stride,spans", [(8, 1, False), (2, 4, False), (16, 1, True), (2, 8, True),
                                                (4, 2, False), (4, 4, True), (1, 64, False)])
def test_a_group_spans_nodes_by_its_extent_in_the_device_order(group, stride, spans):
    h = _h()
    assert h.spans_nodes(group, stride) is spans
    assert h.link(group, stride) == (h.inter if spans else h.intra)


def test_across_nodes_the_inter_node_link_prices_the_ring():
    h = _h()
    n = 64 << 20
    inside = h.collective_s("all-gather", n, 8, stride=1)
    across = h.collective_s("all-gather", n, 8, stride=8)       # 8 nodes, one device of each
    assert across == pytest.approx(7 * 20e-6 + 7 / 8 * n / 10e9)
    assert inside == pytest.approx(7 * 2e-6 + 7 / 8 * n / 100e9)
    assert h.collective_s("all-reduce", n, 1) == 0.0


def test_builtins_carry_the_datasheet_figures():
    h100, h200, a100, v5p = (Hardware.named(n) for n in ("h100", "H200", "a100-80g", "tpu-v5p"))
    assert h100.matmul_flops["bfloat16"] == 989.5e12 and h100.memory_bytes == 80e9
    assert h100.memory_bandwidth == 3.35e12 and h100.devices_per_node == 8
    assert h200.matmul_flops == h100.matmul_flops and h200.memory_bytes == 141e9 and h200.memory_bandwidth == 4.8e12
    assert a100.matmul_flops["bfloat16"] == 312e12 and a100.memory_bandwidth == 2.039e12
    assert v5p.matmul_flops["bfloat16"] == 459e12 and v5p.memory_bytes == 95e9
    assert h100.intra.bandwidth == 450e9 and h100.inter.bandwidth == 50e9  # NVLink 900 GB/s both ways; 400 Gb/s
    assert set(HARDWARE) == {"h100", "h200", "a100-80g", "tpu-v5p"}
    assert h100.matmul_s(989.5e12, "bfloat16") == pytest.approx(1.0)
    assert h100.memory_s(3.35e12) == pytest.approx(1.0)


def test_bad_figures_are_named():
    with pytest.raises(ValueError, match=re.escape("Hardware.named: name='v100' is not a built-in; use one of")):
        Hardware.named("v100")
    with pytest.raises(ValueError, match=re.escape("Hardware('toy'): devices_per_node=0 must be an int >= 1")):
        _h(devices_per_node=0)
    with pytest.raises(ValueError, match=re.escape("Hardware('toy'): matmul_flops={} must map each dtype name")):
        _h(matmul_flops={})
    with pytest.raises(ValueError, match=re.escape("Link: bandwidth=0 must be > 0")):
        Link(0, 1e-6)
    with pytest.raises(ValueError, match=re.escape("Hardware('toy').matmul_s: dtype='float8' has no rate")):
        _h().matmul_s(1.0, "float8")
    with pytest.raises(ValueError, match=re.escape("Hardware.collective_s: kind='broadcast' is not one of")):
        _h().collective_s("broadcast", 1, 2)


def test_calibration_cache_is_per_process_count_and_backend(monkeypatch, tmp_path):
    import jax

    from spmd.parallel import Calibration

    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    one = Calibration.cache_path(jax.devices())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    two = Calibration.cache_path(jax.devices())
    monkeypatch.setenv("SPMD_BACKEND", "mpi")
    two_mpi = Calibration.cache_path(jax.devices())
    assert len({one, two, two_mpi}) == 3, (one, two, two_mpi)
    assert all(p.startswith(str(tmp_path)) for p in (one, two, two_mpi))
