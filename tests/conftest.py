"""8 CPU fake devices, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
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


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {len(jax.devices())} x {jax.devices()[0].platform}"
