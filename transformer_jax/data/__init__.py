"""Data: the datasets a config can name (`catalog`), tfds builders (`builders`, `sources`),
tokenizers (`tokenizer`) and the grain pipeline (`pipeline`). Nothing is imported here, so that
importing one module (the tokenizer, say) does not load tfds or grain."""
