"""Serving a trained model: the HTTP server and its scheduler of decoding slots."""
