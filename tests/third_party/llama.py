"""The Llama-style decoder the tests train: ``models._llama`` (``from models import Llama, LlamaConfig``)."""

from models._llama import (MLP, Attention, DecoderLayer, Llama, LlamaConfig, RMSNorm, ScannedLayer,  # noqa: F401
                           rotary)
