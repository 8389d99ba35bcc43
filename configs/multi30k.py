"""Multi30k (task 1 captions), English -> French; `:de` for English -> German.

  python train.py --config configs/multi30k.py --workdir runs/multi30k \
      --config.data.data_dir ../shared/data/multi30k
Not yet measured on this CPU: no expected figure is claimed.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("de", "smoke"))
  c = base_config()
  c.data.update(dataset="multi30k_en_de" if "de" in arg else "multi30k_en_fr",
                vocab_size=8000, max_len=64, batch_size=32)
  c.model.update(d_model=256, num_heads=4, ffn_dim=1024, num_encoder_layers=3,
                 num_decoder_layers=3)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=400)
  c.run.num_steps = 4000
  return smoke(c) if "smoke" in arg else c
