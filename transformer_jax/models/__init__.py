"""The Transformer's three families (encoder-decoder, decoder-only, encoder-only with its
masked-LM and classifier heads), their attention and embedding kernels, FLOP counts, and
building a model from a config or a trained run."""
