"""A BERT-base-sized encoder-only masked language model (12 layers, d_model 768), for
accelerators.

12 post-LN blocks of bidirectional self-attention and a GELU FFN of 3,072, 12 heads, learned
positions over 512 tokens, a 30,522-piece vocabulary (BERT's size; padded to 30,592 with the
mask id) tied to the masked-LM head's output, LayerNorm epsilon 1e-12, dropout 0.1, bfloat16,
AdamW (0.9, 0.999, weight decay 0.01), 256 rows x 512 tokens a step (BERT's second phase).
Compiled for TPU/GPU topologies without them:
  python -m transformer_jax aot --config configs/bert_base.py --topology v5e:2x4
`data.dataset` is `text_documents`: set `data.data_dir` to a directory of *.txt files.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="text_documents", vocab_size=30_522, max_len=512, batch_size=256)
  c.model.update(family="encoder_only", positions="learned", activation="gelu",
                 num_encoder_layers=12, num_decoder_layers=0, d_model=768, num_heads=12,
                 ffn_dim=3072, dropout_rate=0.1, layer_norm_eps=1e-12, dtype="bfloat16",
                 scan_layers=True, remat="dots")
  c.optimizer.update(schedule="cosine", learning_rate=1e-4, warmup_steps=10_000, adam_b2=0.999,
                     adam_eps=1e-6, weight_decay=0.01)
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=1_000_000, checkpoint_every=10_000)
  c.eval.update(every=10_000, bleu_sentences=0)
  return smoke(c) if "smoke" in arg else c
