"""Fine-tunes the masked language model of configs/mlm_shakespeare.py to tell which part of the
First Folio a passage of a play comes from: comedy, history or tragedy.

Command (the pretrained run first; the works read from a local copy, else downloaded):
  python train.py --config configs/mlm_shakespeare.py --workdir runs/mlm_shakespeare \
      --config.data.data_dir data/shakespeare
  python train.py --config configs/genre_shakespeare.py --workdir runs/genre_shakespeare \
      --config.data.data_dir data/shakespeare \
      --config.run.init_from runs/mlm_shakespeare
The `shakespeare_genre` dataset (data/builders.py): the 36 plays of the Folio cut into passages
of 10 non-blank lines, each labelled by its play's genre; one play of each genre is held out for
validation and one for test, so the classifier is scored on plays it never read a line of. The
model is the pretrained encoder with BERT's classification head on the first (<bos>) position.
Without run.init_from it starts from random parameters (the baseline the pretraining is
measured against); `--config.data.train_fraction=0.05` trains on a fixed random 5% of the
passages (benchmarks/label_efficiency.py makes the table of both starts on such shares).
`configs/genre_shakespeare.py:smoke` runs a few steps of a tiny model in seconds (from
configs/mlm_shakespeare.py:smoke's run, or from random parameters).
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  # The pretrained run's tokenizer and positions: vocab_size and max_len as its.
  c.data.update(dataset="shakespeare_genre", vocab_size=2048, max_len=128, batch_size=32,
                packing=False)
  c.model.update(family="encoder_only", positions="learned", activation="gelu",
                 num_encoder_layers=4, num_decoder_layers=0, d_model=256, num_heads=4,
                 ffn_dim=1024, dropout_rate=0.1, layer_norm_eps=1e-12)
  c.optimizer.update(schedule="cosine", learning_rate=1e-4, warmup_steps=60, weight_decay=0.01)
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=600, checkpoint_every=200, log_every=50)
  c.eval.update(every=100, bleu_sentences=0)
  return smoke(c) if "smoke" in arg else c
