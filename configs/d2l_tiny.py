"""The d2l.ai chapter's exact settings: word-level vocab, the first 512 training pairs, 9 tokens.

  python train.py --config configs/d2l_tiny.py --workdir runs/d2l_tiny \
      --config.data_dir ../shared/data/fra-eng

2 layers, 256 hidden, FFN 64, 4 heads, dropout 0.2, Adam lr 0.001 (constant), clip 1,
batch 128, 30 epochs of 512 pairs (120 steps). Sentences are truncated to 9 tokens, as d2l's
truncate_pad does, and padded (no packing).
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.dataset = "fra_eng"
  c.train_split = "train[:512]"
  c.eval_split = "validation[:128]"
  c.tokenizer = "word"
  c.max_len = 9
  c.overlong = "truncate"
  c.packing = False
  c.batch_size = 128
  c.model.update(d_model=256, num_heads=4, ffn_dim=64, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.2, share_embeddings=False,
                 tie_output=False)
  c.num_steps = 30 * 512 // 128
  c.schedule = "constant"
  c.learning_rate = 1e-3
  c.adam_b1, c.adam_b2, c.adam_eps = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults.
  c.label_smoothing = 0.0
  c.log_every, c.eval_every, c.checkpoint_every = 10, 40, 40
  return smoke(c) if "smoke" in arg else c
