"""A small encoder-only (BERT-style) masked language model on Shakespeare's 42 works, sized for
a 2-core CPU.

Command (the works read from a local copy; without data_dir they are downloaded):
  python train.py --config configs/mlm_shakespeare.py --workdir runs/mlm_shakespeare \
      --config.data.data_dir data/shakespeare
The documents path of configs/lm_shakespeare.py (34 works train, 4 validate, 4 test; a lossless
SentencePiece of 2,048 pieces; rows of 128 tokens), read by 4 bidirectional post-LN blocks of
d_model 256 with learned positions and GELU, as BERT's. Each step masks whole words, each
word with a letter or digit with probability 0.2 (about 15% of the pieces; newlines, spaces and
punctuation are never predicted), every piece of a chosen word read as the mask id (80%), a
random piece (10%) or itself (10%), and predicts them; no dropout (an underfitted model at this
budget: a step 20% faster). Evaluation reports masked-token accuracy and perplexity on a
masking of the held-out works drawn once by the same rule.
`configs/mlm_shakespeare.py:smoke` runs a few steps of a tiny model in seconds.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="shakespeare", vocab_size=2048, max_len=128, batch_size=32)
  c.model.update(family="encoder_only", positions="learned", activation="gelu",
                 num_encoder_layers=4, num_decoder_layers=0, d_model=256, num_heads=4,
                 ffn_dim=1024, dropout_rate=0.0, layer_norm_eps=1e-12)
  c.optimizer.update(schedule="cosine", learning_rate=1e-3, warmup_steps=200, weight_decay=0.01)
  c.step.update(label_smoothing=0.0, masking="words", mask_rate=0.2)
  c.run.update(num_steps=1500, checkpoint_every=250)
  c.eval.update(every=250, bleu_sentences=0)
  return smoke(c) if "smoke" in arg else c
