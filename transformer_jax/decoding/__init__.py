"""Decoding: the model-agnostic search (greedy, sampling, beam), slot batching, and the
translator and completer that run a trained model on text."""
