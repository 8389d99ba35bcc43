"""Decoding: the model-agnostic search (greedy, sampling, beam), decoding slots, and one runner
per family on text (the translator and its file batching, the completer with prompts.py, the
filler, the classifier), each opening its run through runs/restore.py; options.py is what
every command imports."""
