"""The Transformer families (encoder-decoder, decoder-only), their embedding and attention
kernels, FLOP counts, and building a model from a config or a trained run."""
