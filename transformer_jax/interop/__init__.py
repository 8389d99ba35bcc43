"""Other formats: Hugging Face `transformers` (GPT-2, BERT, Marian; export, and import of GPT-2
and BERT checkpoints), CTranslate2 and `jax.export`. Each architecture's parameter names are
one table (tables.py) that both directions read; nothing here imports at package import."""
