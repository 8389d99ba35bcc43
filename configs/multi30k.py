"""Multi30k (task 1 captions), English -> French; `:de` for English -> German.

  python train.py --config configs/multi30k.py --workdir runs/multi30k \
      --config.data.data_dir data/multi30k
Not yet measured on this CPU: no expected figure is claimed.

`:finetune` fine-tunes the fra-eng model (configs/fra_eng.py, trained in runs/fra_eng) on
Multi30k en-fr for 300 steps, from its parameters and with its tokenizer (docs/training.md,
"Fine-tuning"):
  python train.py --config configs/multi30k.py:finetune --workdir runs/multi30k_ft \
      --config.data.data_dir data/multi30k --config.run.init_from runs/fra_eng
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("de", "smoke", "finetune"))
  c = base_config()
  c.data.update(dataset="multi30k_en_de" if "de" in arg else "multi30k_en_fr",
                vocab_size=8000, max_len=64, batch_size=32)
  c.model.update(d_model=256, num_heads=4, ffn_dim=1024, num_encoder_layers=3,
                 num_decoder_layers=3)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=400)
  c.run.num_steps = 4000
  if "finetune" in arg:  # The fra-eng model's shape and data settings; a short, gentle run.
    c.data.update(batch_size=36, concat_prob=0.0)
    c.model.dropout_rate = 0.1
    c.optimizer.update(schedule="cosine", learning_rate=2e-4, warmup_steps=30)
    c.run.update(num_steps=300, checkpoint_every=100, init_from="runs/fra_eng")
    c.eval.every = 100
    c.decode.alpha = 1.0
  return smoke(c) if "smoke" in arg else c
