"""The seed's DDP program (torch's DDP tutorial: a Linear(10, 5), SGD, 10 epochs, 4 ranks), ported to spmd.

    python examples/seed_ddp.py

What changed, line for line: ``torch.distributed`` -> ``spmd.distributed``; ``torch.multiprocessing.spawn``
-> ``spmd.spawn``; ``nn.Linear(10, 5)`` -> ``flax.linen.Dense(5)`` with its parameters as a pytree;
``DDP(model, device_ids=[rank])`` -> ``dist.DistributedDataParallel(model, params, optimizer=optax.sgd(0.01))``;
``zero_grad(); loss.backward(); optimizer.step()`` -> ``ddp.step(loss_fn, inputs)``; the backend is gloo
(CPU) where the seed asks for nccl. To make the printed losses checkable, each rank draws its inputs
from a generator seeded by its rank and the parameters start from a seeded uniform draw like torch's
``nn.Linear`` (``tests/test_examples.py`` recomputes every printed loss with NumPy).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spmd  # noqa: E402
import spmd.distributed as dist  # noqa: E402


def init_linear(rng: np.random.Generator, n_in: int, n_out: int) -> dict:
    """torch's ``nn.Linear`` initialisation, uniform in +-1/sqrt(n_in), as a flax ``Dense`` pytree."""
    bound = 1.0 / np.sqrt(n_in)
    return {"kernel": rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32),
            "bias": rng.uniform(-bound, bound, (n_out,)).astype(np.float32)}


def setup(rank, world_size):
    """Initialise the process group (spmd.spawn sets MASTER_ADDR / MASTER_PORT)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def train(rank, world_size):
    setup(rank, world_size)

    # 1. The model: rank 0's parameters reach every rank when DDP is built, as in torch.
    model = nn.Dense(5)
    params = {"params": init_linear(np.random.default_rng(rank), 10, 5)}
    ddp_model = dist.DistributedDataParallel(model, params, optimizer=optax.sgd(0.01))  # 2. the optimizer

    def loss_fn(params, inputs):
        outputs = model.apply(params, inputs)   # forward
        return outputs.sum()

    # 3. The training loop: forward, backward, gradient all-reduce (mean) and SGD step in one call.
    data = np.random.default_rng(1000 + rank)
    for epoch in range(10):
        inputs = data.standard_normal((20, 10)).astype(np.float32)
        loss = ddp_model.step(loss_fn, inputs)
        if rank == 0:
            print(f"Epoch {epoch}, Loss: {float(loss)}", flush=True)

    cleanup()


if __name__ == "__main__":
    world_size = 4
    spmd.spawn(train, args=(world_size,), nprocs=world_size, join=True)
