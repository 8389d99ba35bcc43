"""Default main job: English -> French on the d2l fra-eng corpus, sized for a 2-core CPU.

Command (data read from a local copy of fra-eng.zip):
  python train.py --config configs/fra_eng.py --workdir runs/fra_eng \
      --config.data_dir ../shared/data/fra-eng
Measured on a 2-core x86-64 CPU (2026-11-22): 45 min 17 s wall clock for the whole command,
final validation loss 1.340 (cross-entropy per target token; accuracy 0.724); on the held-out
Tatoeba test set 21.7 sacreBLEU greedy, 22.7 with beam 4. See the README's results.
`configs/fra_eng.py:smoke` runs a few steps of a tiny model in seconds.
"""

from transformer_jax.config import base_config, smoke


def get_config(arg=None):
  c = base_config()
  c.dataset = "fra_eng"
  c.vocab_size = 8000
  c.max_len = 48
  c.batch_size = 48
  c.model.update(d_model=256, num_heads=4, ffn_dim=1024, num_encoder_layers=3,
                 num_decoder_layers=3, dropout_rate=0.1)
  c.num_steps = 2000  # ~1.2 s a step on 2 otherwise idle cores: about 45 minutes.
  c.learning_rate = 1e-3
  c.warmup_steps = 300
  c.eval_every = c.checkpoint_every = 250
  return smoke(c) if arg == "smoke" else c
