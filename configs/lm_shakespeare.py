"""A small decoder-only language model on Shakespeare's 42 works, sized for a 2-core CPU.

Command (the works read from a local copy; without data_dir they are downloaded):
  python train.py --config configs/lm_shakespeare.py --workdir runs/lm_shakespeare \
      --config.data.data_dir data/shakespeare
34 works train, 4 are held out for validation and 4 for test (whole works, by name). A
lossless SentencePiece of 2,048 pieces (newlines and spaces kept), rows of 128 tokens cut from
the works at offsets that move every epoch, 4 pre-LN blocks of d_model 256 with learned
positions and a tied output. Evaluation reports bits per character of the held-out works, and
a unigram model's beside it. Measured figures: docs/language_models.md.
`configs/lm_shakespeare.py:smoke` runs a few steps of a tiny model in seconds.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="shakespeare", vocab_size=2048, max_len=128, batch_size=32)
  c.model.update(family="decoder_only", positions="learned", num_encoder_layers=0,
                 num_decoder_layers=4, d_model=256, num_heads=4, ffn_dim=1024,
                 dropout_rate=0.1, pre_ln=True)
  c.optimizer.update(schedule="cosine", learning_rate=1e-3, warmup_steps=200, weight_decay=0.1)
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=1500, checkpoint_every=250)
  c.eval.update(every=250, bleu_sentences=0)
  return smoke(c) if "smoke" in arg else c
