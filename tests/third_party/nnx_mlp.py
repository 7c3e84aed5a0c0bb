"""The flax.nnx model the tests train: ``tests.zoo.nnx_mlp`` (the zoo's nnx family, blocks in an ``nnx.List``)."""

from tests.zoo.nnx_mlp import Block, TokenMLP  # noqa: F401
