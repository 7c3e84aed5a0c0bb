"""A newcomer's first minutes (issue 21.6): ``import spmd`` exposes its subpackages on first use."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_spmd_exposes_ops_lazily():
    # A fresh interpreter: the test process imported spmd.ops long ago.
    code = (
        "import sys, spmd\n"
        "assert 'spmd.ops' not in sys.modules, 'import spmd loaded spmd.ops'\n"
        "assert 'spmd.parallel' not in sys.modules, 'import spmd loaded spmd.parallel'\n"
        "assert 'ops' in dir(spmd)\n"
        "import numpy as np\n"
        "mesh = spmd.init_device_mesh('cpu', (2,))\n"
        "x = spmd.distribute_tensor(np.zeros((4,), np.float32), mesh, [spmd.Shard(0)])\n"
        "print(np.asarray(spmd.ops.exp(x).full_tensor()).tolist())\n"
        "import spmd.ops\n"
        "assert spmd.ops is sys.modules['spmd.ops']\n"
        "print(spmd.distributed.get_world_size.__name__)\n"
        "try:\n"
        "    spmd.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["[1.0, 1.0, 1.0, 1.0]", "get_world_size",
                                     "module 'spmd' has no attribute 'no_such_name'"]
