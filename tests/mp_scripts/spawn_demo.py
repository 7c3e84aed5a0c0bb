"""The seed's spawn + DDP example, ported: 4 processes train Linear(10, 5) with SGD, averaging
gradients with dist.all_reduce as DDP does; then a failing spawn raises in the parent."""

import sys

import jax
import numpy as np

import spmd
import spmd.distributed as dist


def batch(epoch, rank):
    return jax.random.normal(jax.random.PRNGKey(1000 * epoch + rank), (20, 10))


def loss_fn(params, inputs):
    outputs = inputs @ params["w"] + params["b"]  # nn.Linear(10, 5)
    return outputs.sum()


@jax.jit
def step(params, grads, lr=0.01):
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def train(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # setup()
    k1, k2 = jax.random.split(jax.random.PRNGKey(rank))  # different on purpose: DDP broadcasts rank 0's
    params = {"w": jax.random.normal(k1, (10, 5)) * 0.1, "b": jax.random.normal(k2, (5,)) * 0.1}
    params = jax.tree_util.tree_map(lambda p: dist.broadcast(p, src=0), params)
    ref = params
    for epoch in range(10):
        loss, grads = grad_fn(params, batch(epoch, rank))
        grads = jax.tree_util.tree_map(lambda g: dist.all_reduce(g, op=dist.ReduceOp.AVG), grads)
        params = step(params, grads)
        if rank == 0:
            sys.stdout.write(f"Epoch {epoch}, Loss: {float(loss)}\n")
            sys.stdout.flush()
        if rank == 0:  # the single-process reference: the mean of every rank's gradient
            ref_grads = [grad_fn(ref, batch(epoch, r))[1] for r in range(world_size)]
            ref = step(ref, jax.tree_util.tree_map(lambda *g: sum(g) / world_size, *ref_grads))
    ws = dist.all_gather_object(None, np.asarray(params["w"]))
    same = all(np.array_equal(w, ws[0]) for w in ws)
    line = f"spawned rank {dist.get_rank()}/{dist.get_world_size()} identical {same}"
    if rank == 0:
        close = np.allclose(params["w"], ref["w"], atol=1e-5) and np.allclose(params["b"], ref["b"], atol=1e-5)
        line += f" matches reference {bool(close)}"
    sys.stdout.write(line + "\n")  # one write: the ranks share this stdout, print() may split a line
    sys.stdout.flush()
    dist.destroy_process_group()  # cleanup()


def fails(rank):
    if rank == 1:
        raise ValueError(f"bad rank {rank}")


if __name__ == "__main__":
    world_size = 4
    spmd.spawn(train, args=(world_size,), nprocs=world_size, join=True)
    try:
        spmd.spawn(fails, nprocs=2)
    except dist.ProcessRaisedException as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        print(f"caught ProcessRaisedException from process {e.error_index}: {last}", flush=True)
