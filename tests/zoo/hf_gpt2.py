"""A decoder: Hugging Face's ``FlaxGPT2LMHeadModel`` (fused q/k/v in one ``Conv1D``, learned positions, a tied
head), from a tiny config with random weights (no download), ``transformers`` 4.57 unchanged."""

from __future__ import annotations


def build(vocab: int = 64):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
