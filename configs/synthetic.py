"""WMT-sized batches on a local synthetic corpus (benchmarks/synthetic_corpus.py): the input
path at scale without the internet. `arg` "cpu" shrinks the model (not the data or batch) to
what a CPU steps through in seconds.

  python benchmarks/synthetic_corpus.py --out data/synth5m --pairs 5000000
  python train.py --config configs/synthetic.py:cpu --workdir runs/synth5m \
      --config.data.data_dir data/synth5m --config.data.tfds_dir data/synth5m/tfds
Prepare each corpus into its own tfds_dir (the prepared dataset is named `parallel_tsv`).
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("cpu", "smoke"))
  c = base_config()
  c.data.update(dataset="parallel_tsv", vocab_size=32_000, max_len=256,
                batch_size=96)  # 96 packed rows x 256 = 24.6k tokens a side, as wmt14_base.
  c.eval.update(bleu_sentences=64, num_batches=4, every=2000)
  c.model.dtype = "bfloat16"
  c.run.checkpoint_every = 2000
  if "cpu" in arg:
    c.model.update(d_model=64, num_heads=4, ffn_dim=128, num_encoder_layers=1,
                   num_decoder_layers=1, dtype="float32")
  return smoke(c) if "smoke" in arg else c
