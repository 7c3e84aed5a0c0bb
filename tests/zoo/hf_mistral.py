"""A decoder: Hugging Face's ``FlaxMistralForCausalLM`` (rotary positions, grouped-query attention: 4 query and
2 KV heads), from a tiny config with random weights (no download), ``transformers`` 4.57 unchanged."""

from __future__ import annotations


def build(vocab: int = 64):
    import transformers

    cfg = transformers.MistralConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     sliding_window=None)
    return transformers.FlaxMistralForCausalLM(cfg, seed=0)
