"""The d2l.ai chapter's exact settings: word-level vocab, the first 512 training pairs, 9 tokens.

  python train.py --config configs/d2l_tiny.py --workdir runs/d2l_tiny \
      --config.data.data_dir data/fra-eng

2 layers, 256 hidden, FFN 64, 4 heads, dropout 0.2, Adam lr 0.001 (constant), clip 1,
batch 128, 30 epochs of 512 pairs (120 steps). Sentences are truncated to 9 tokens, as d2l's
truncate_pad does, and padded (no packing). As in the chapter's PyTorch code, the attention
projections have no biases and every LayerNorm's epsilon is 1e-5 (PyTorch's). What still differs
from the chapter (initialisation, padded vocabularies, the mask value, decoding positions) is in
docs/training.md, "Differences from the d2l chapter".
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="fra_eng", train_split="train[:512]", eval_split="validation[:128]",
                tokenizer="word", max_len=9, overlong="truncate", packing=False, batch_size=128)
  c.model.update(d_model=256, num_heads=4, ffn_dim=64, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.2, share_embeddings=False,
                 tie_output=False, attention_bias=False, layer_norm_eps=1e-5)
  c.optimizer.update(schedule="constant", learning_rate=1e-3,
                     adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8)  # torch.optim.Adam's defaults.
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=30 * 512 // 128, log_every=10, checkpoint_every=40)
  c.eval.every = 40
  return smoke(c) if "smoke" in arg else c
