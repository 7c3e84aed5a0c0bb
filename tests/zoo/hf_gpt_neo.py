"""Blocks that differ: Hugging Face's ``FlaxGPTNeoForCausalLM`` (global and local attention alternate by
``layer_id``), from a tiny config with random weights (no download), ``transformers`` 4.57 unchanged."""

from __future__ import annotations


def build(vocab: int = 64):
    import transformers

    cfg = transformers.GPTNeoConfig(vocab_size=vocab, max_position_embeddings=16, hidden_size=16, num_layers=2,
                                    num_heads=2, attention_types=[[["global", "local"], 1]], window_size=2,
                                    intermediate_size=32, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
    return transformers.FlaxGPTNeoForCausalLM(cfg, seed=0)
