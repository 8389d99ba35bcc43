"""A trained run's files, between the model and what uses it: the workdir's layout and its
files (workdir.py: config, tokenizer, labels, checkpoints, the writer's lock) and the one way a
command opens a run for use (restore.py: its config, tokenizers, model and parameters)."""
