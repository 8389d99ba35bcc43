"""The paper's big model on WMT14 English -> German (tfds's wmt14_translate; needs internet).

  python train.py --config configs/wmt14_big.py --workdir runs/wmt14_big
Paper: d_model 1024, 6+6 layers, FFN 4096, 16 heads, dropout 0.3, 300k steps (28.4 BLEU).
Not run here (no accelerator, no internet): no figure is claimed.
"""

from configs import wmt14_base
from transformer_jax.config import smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = wmt14_base.get_config()
  c.model.update(d_model=1024, num_heads=16, ffn_dim=4096, dropout_rate=0.3)
  c.run.num_steps = 300_000
  c.optimizer.learning_rate = 1024 ** -0.5 * 4000 ** -0.5
  return smoke(c) if "smoke" in arg else c
