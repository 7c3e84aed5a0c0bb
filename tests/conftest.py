"""8 CPU fake devices, set before JAX initialises."""

import os
from pathlib import Path

# LLVM's backend optimisation level 0: XLA's HLO passes (the partitioner, the collective combiners: what
# the tests count) run as always, and the numbers are the same (no fast-math either way); only the machine
# code is less optimised, which cuts the suite's compile time by about a third. Set the flag yourself to
# test the default level.
# XLA's CPU loop and reduction fusions emitted by its older emitters (no MLIR fusion-emitter pipeline):
# about 40% less compile time again. The fusions may group a few instructions differently (a compiled
# step's temporaries within ~0.1%), and the collectives, which the partitioner and the combiners place
# before either emitter runs, are the same. Set the flag yourself (=true) to test the default emitters.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import spmd  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
    return spmd.init_device_mesh("cpu", (8,), mesh_dim_names=("x",))


@pytest.fixture(scope="session")
def mesh2x4():
    return spmd.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))


# What a launcher sets (spmdrun / torchrun) and the debug settings: cleared for the one-process tests.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SPMD_TIMEOUT",
               "SPMD_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MPITRAMPOLINE_LIB", "TORCH_DISTRIBUTED_DEBUG",
               "SPMD_DISTRIBUTED_DEBUG", "SPMD_CHECK_COLLECTIVES")


@pytest.fixture
def clean(monkeypatch):
    """No launcher environment and no process group, before and after the test."""
    import spmd.distributed as dist

    for k in _LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def world1(clean):
    """A process group of this one process (world size 1)."""
    import spmd.distributed as dist

    dist.init_process_group()
    return clean


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {len(jax.devices())} x {jax.devices()[0].platform}"


# The slow tier: the compile-bound cases (`python -m pytest -n 2 -m slow`); the README's test command leaves them
# out (`-m "not slow"`). A test marks itself with @pytest.mark.slow; the units listed in tests/slow_tier.json
# (an xdist group, whose tests share cached compiled runs and so go together, or a test by file and name) were
# measured to take the most time on a 2-core machine and join the tier here.
_SLOW_TIER = "tests/slow_tier.json"
_SLOW = __import__("json").loads((Path(__file__).parent / "slow_tier.json").read_text())


def pytest_collection_modifyitems(config, items):
    groups, tests = set(_SLOW["groups"]), set(_SLOW["tests"])
    seen, files = set(), set()
    for item in items:
        group = next((m.args[0] for m in item.iter_markers("xdist_group")), None)
        path, _, test = item.nodeid.partition("::")
        files.add(path.split("/")[-1])
        name = f"{path.split('/')[-1]}::{test}"  # file::test[params], wherever the file sits under tests/
        for key in (group, name, name.split("[")[0]):
            if key in groups or key in tests:
                seen.add(key)
                item.add_marker(pytest.mark.slow)
    # where every test file was collected unfiltered, an entry matching nothing is stale (a test or a docs heading
    # renamed): its test would silently run in the README's tier
    every = {f.name for f in Path(__file__).parent.rglob("test_*.py")}
    if every <= files and not config.option.keyword:
        stale = sorted((groups | tests) - seen)
        if stale:
            message = (f"tests/slow_tier.json names {len(stale)} unit(s) no collected test matches: {stale}; update "
                       "them to the tests' current names (a docs block is named page::heading-N: its page, the anchor "
                       "of the heading above it and its ordinal among the python blocks under that heading)")
            if not os.environ.get("PYTEST_XDIST_WORKER"):
                raise pytest.UsageError(message)
            # an xdist worker: an exception here would end the worker, and the controller would report only a
            # crash ('no tests ran', INTERNALERROR); it goes to the controller as a failed collection report instead
            config.hook.pytest_collectreport(report=pytest.CollectReport(_SLOW_TIER, "failed", message, []))


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report):
    """In the main process (xdist's controller): a worker's stale tests/slow_tier.json report stops the session as
    the same usage error as without xdist, once."""
    if report.nodeid == _SLOW_TIER and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        raise pytest.UsageError(str(report.longrepr))
