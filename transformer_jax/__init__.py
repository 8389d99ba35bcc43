"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX and Flax, trained,
decoded and served (README.md). Nothing is imported here: `python -m transformer_jax` and each
module load only what they use. A regular package, not a namespace one: tfds finds its
builders' directory through importlib.resources, which an editable install's namespace path
breaks."""
