"""``DistributedDataParallel`` for a flax / optax model on the multi-process path.

What torch's DDP does, for parameters held as a pytree: at construction every
rank takes rank ``src``'s parameters (one broadcast, after checking that every
rank holds the same structure, shapes and dtypes); each step every rank takes
the gradient of its local loss and the gradients are **averaged** over the
group with one all-reduce of the flattened gradient vector (torch's buckets,
as one bucket); every rank then applies the same optax update.

```python
ddp = dist.DistributedDataParallel(model, params, optimizer=optax.sgd(1e-2))
loss = ddp.step(loss_fn, x, y)   # loss_fn(params, x, y) -> scalar; returns this rank's loss
logits = ddp(x)                  # model.apply(ddp.params, x)
```

The one-process, many-device form of the same step is ``models.make_train_step``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from placements import ReduceOp
from spmd.distributed._c10d import all_reduce, broadcast
from spmd.distributed._groups import get_process_group_ranks, get_rank
from spmd.distributed._objects import all_gather_object

__all__ = ["DistributedDataParallel"]

_KEEP_COMPILED = 8  # loss functions whose jitted gradient a DDP keeps (define loss_fn once, outside the loop)


class DistributedDataParallel:
    """``DistributedDataParallel(module, params, *, optimizer=None, process_group=None, src=0)``.

    ``module``: a flax module (its ``apply`` is used) or a function ``apply(params, *args)``;
    ``params``: this rank's parameter pytree (replaced by rank ``src``'s); ``optimizer``: an
    optax ``GradientTransformation`` for :meth:`step`. ``ddp.params`` / ``ddp.opt_state`` are
    the current state (``ddp.module`` the model, as torch).
    """

    def __init__(self, module: Any, params: Any, *, optimizer: Any = None, process_group: Any = None,
                 src: int | None = None, device_ids: Any = None, broadcast_buffers: bool = True):
        where = "DistributedDataParallel"
        apply = getattr(module, "apply", module)
        if not callable(apply):
            raise TypeError(f"{where}: module={module!r} must be a flax module or a function apply(params, *args).")
        if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(f"{where}: optimizer={optimizer!r} must be an optax GradientTransformation (or None).")
        leaves = jax.tree.leaves(params)
        if not leaves:
            raise ValueError(f"{where}: params has no arrays; pass the model's parameter pytree.")
        self.module = module
        self._apply = apply
        self._group = process_group
        self._optimizer = optimizer
        self._check_same_everywhere(params, where)
        flat, self._unravel = ravel_pytree(params)
        src_rank = get_process_group_ranks(process_group)[0] if src is None else src
        self.params = self._unravel(_as_jax(broadcast(flat, src_rank, group=process_group)))
        self.opt_state = optimizer.init(self.params) if optimizer is not None else None
        self._grad_fns: dict = {}
        self._update = jax.jit(self._apply_update) if optimizer is not None else None

    def _check_same_everywhere(self, params: Any, where: str) -> None:
        mine = (str(jax.tree.structure(params)),
                [(tuple(np.shape(x)), str(np.asarray(x).dtype)) for x in jax.tree.leaves(params)])
        everyone = all_gather_object(None, mine, group=self._group)
        ranks = get_process_group_ranks(self._group)
        for r, theirs in zip(ranks, everyone):
            if [theirs[0], [tuple(s) for s in theirs[1]]] != [mine[0], mine[1]]:
                raise ValueError(
                    f"{where}: rank {r}'s params differ in structure, shapes or dtypes from rank "
                    f"{get_rank()}'s; every rank must build the same model."
                )

    # --- what torch's DDP module does -----------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward pass with the current params: ``module.apply(params, *args)``."""
        return self._apply(self.params, *args, **kwargs)

    def state_dict(self) -> Any:
        return self.params

    def average_gradients(self, grads: Any) -> Any:
        """The mean of ``grads`` over the group: one all-reduce of the flattened gradients."""
        flat, unravel = ravel_pytree(grads)
        return unravel(_as_jax(all_reduce(flat, op=ReduceOp.AVG, group=self._group)))

    def value_and_grad(self, loss_fn: Callable, *, has_aux: bool = False) -> Callable:
        """``f(params, *args) -> (loss, grads)`` where ``grads`` is averaged over the group and
        ``loss`` (with its aux if ``has_aux``) is this rank's, as ``loss.backward()`` leaves them."""
        key = (loss_fn, has_aux)
        local = self._grad_fns.pop(key, None) or jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))
        self._grad_fns[key] = local  # most recent last; a few loss functions are kept compiled
        while len(self._grad_fns) > _KEEP_COMPILED:
            self._grad_fns.pop(next(iter(self._grad_fns)))

        def fn(params: Any, *args: Any) -> tuple[Any, Any]:
            value, grads = local(params, *args)
            return value, self.average_gradients(grads)

        return fn

    def step(self, loss_fn: Callable, *args: Any, has_aux: bool = False) -> Any:
        """One training step: forward, backward, average the gradients, optimizer update.
        Returns this rank's loss (and aux); ``ddp.params`` / ``ddp.opt_state`` are updated."""
        if self._optimizer is None:
            raise ValueError(
                "DistributedDataParallel.step: no optimizer was given; pass optimizer=optax.sgd(...) when "
                "constructing it, or use value_and_grad and apply the update yourself."
            )
        value, grads = self.value_and_grad(loss_fn, has_aux=has_aux)(self.params, *args)
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads)
        return value

    def _apply_update(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        import optax

        updates, opt_state = self._optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


def _as_jax(x: Any) -> Any:
    return x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
