"""Serving a trained model: the HTTP server and its batcher, and export to other runtimes."""
