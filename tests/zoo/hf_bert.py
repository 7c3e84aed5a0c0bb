"""An encoder: Hugging Face's ``FlaxBertForMaskedLM`` (bidirectional attention, token-type embeddings, a tied
MLM head), from a tiny config with random weights (no download), ``transformers`` 4.57 unchanged."""

from __future__ import annotations


def build(vocab: int = 64):
    import transformers

    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.FlaxBertForMaskedLM(cfg, seed=0)
