"""An encoder-decoder: Hugging Face's ``FlaxBartForConditionalGeneration`` (the decoder's blocks attend to the
encoder's output), from a tiny config with random weights (no download), ``transformers`` 4.57 unchanged.
(Flax T5 does not run on jax 0.10: its relative-position bucket calls ``jnp.clip(..., a_max=)``, an argument
JAX removed.)"""

from __future__ import annotations


def build(vocab: int = 64):
    import transformers

    cfg = transformers.BartConfig(vocab_size=vocab, d_model=16, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    return transformers.FlaxBartForConditionalGeneration(cfg, seed=0)
