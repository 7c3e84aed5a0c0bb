"""A small ResNet as flax's ImageNet example writes it (linen): convolutions, ``nn.BatchNorm`` with running
statistics in the mutable ``batch_stats`` collection, a ``train`` flag, a dense classifier."""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, name="conv_proj")(residual)
            residual = norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """images (b, h, w, c) -> logits (b, num_classes)."""
    stage_sizes: Sequence[int] = (1, 1)
    num_filters: int = 8
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name="bn_init")(x))
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                x = ResNetBlock(self.num_filters * 2 ** i, (2, 2) if i > 0 and j == 0 else (1, 1))(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="head")(x)
