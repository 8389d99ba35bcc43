"""The paper's base model on WMT14 English -> German (tfds's wmt14_translate; needs internet).

  python train.py --config configs/wmt14_base.py --workdir runs/wmt14_base
Paper: d_model 512, 6+6 layers, FFN 2048, 8 heads, dropout 0.1, label smoothing 0.1,
~25k source + 25k target tokens a batch, 100k steps, warmup 4000 (27.3 BLEU on newstest2014).
Not run here (no accelerator, no internet): no figure is claimed.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="wmt14_en_de", eval_split="validation", vocab_size=32_000, max_len=256,
                batch_size=96)  # 96 packed rows x 256 = 24.6k tokens a side.
  c.optimizer.update(warmup_steps=4000, learning_rate=512 ** -0.5 * 4000 ** -0.5)
  c.model.dtype = "bfloat16"
  c.run.update(num_steps=100_000, checkpoint_every=2000)
  c.eval.every = 2000
  return smoke(c) if "smoke" in arg else c
