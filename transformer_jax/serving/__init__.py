"""Serving a trained model over HTTP: the translation server and its batcher of decoding slots,
OpenAI's completions API for a language model, request bodies, the guard (API key, allowed
hosts) before either app, and GET /metrics in Prometheus' format."""
