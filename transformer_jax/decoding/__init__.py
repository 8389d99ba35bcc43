"""Decoding: the model-agnostic search (greedy, sampling, beam), decoding slots, opening a
trained run (restore), and one runner per family on text: the translator, the completer
(prompts.py), the filler and the classifier; options.py is what every command imports."""
