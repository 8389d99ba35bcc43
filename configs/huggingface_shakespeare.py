"""Fine-tunes a local Hugging Face GPT-2 or BERT checkpoint on Shakespeare's 42 works: the model
section is read from the checkpoint's config.json, and the run takes its weights and tokenizer.

Command (CHECKPOINT: a directory that save_pretrained wrote, with model.safetensors and the
tokenizer's tokenizer.json):
  python train.py --config configs/huggingface_shakespeare.py:CHECKPOINT \
      --workdir runs/gpt2_shakespeare --config.data.data_dir data/shakespeare
A GPT2LMHeadModel continues as a language model (the works' documents, bits per character), a
BertForMaskedLM as a masked language model (masked-token accuracy), both on the splits of
configs/lm_shakespeare.py, rows of up to 128 tokens, a learning rate of 1e-4 after 100 warm-up
steps. A model field set on the command line that disagrees with the checkpoint is refused,
naming the field. `configs/huggingface_shakespeare.py:CHECKPOINT,smoke` runs a few steps.
This file reads CHECKPOINT whenever it is loaded; `train.py --workdir runs/gpt2_shakespeare`
alone resumes the run from its own config.json without it (CHECKPOINT moved or deleted).
"""

from transformer_jax.config import ConfigError, base_config, check, smoke
from transformer_jax.interop.huggingface import Checkpoint, CheckpointError


def get_config(arg=None):
  path = (arg or "").removesuffix(",smoke")
  check(bool(path), "configs/huggingface_shakespeare.py needs the checkpoint's directory: "
        "configs/huggingface_shakespeare.py:CHECKPOINT")
  check(path != "smoke", "configs/huggingface_shakespeare.py:smoke names no checkpoint: its "
        "smoke run is configs/huggingface_shakespeare.py:CHECKPOINT,smoke")
  try:
    checkpoint = Checkpoint.open(path)
  except CheckpointError as e:  # Moved or deleted since a run started from it, maybe.
    raise ConfigError(f"{e}; a run that started from it resumes without it: train.py "
                      "--workdir WORKDIR alone (the run's own config.json)") from None
  c = base_config()
  c.data.update(dataset="shakespeare", tokenizer="huggingface",
                max_len=min(128, checkpoint.max_len), batch_size=32)
  c.model.update(dropout_rate=0.1, **checkpoint.model_fields())
  c.optimizer.update(schedule="cosine", learning_rate=1e-4, warmup_steps=100, weight_decay=0.01)
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=1000, checkpoint_every=250, init_from=path)
  c.eval.update(every=250, bleu_sentences=0)
  if path != arg:  # The shrunk run, with the checkpoint's model as it is.
    c = smoke(c)
    c.model.update(**checkpoint.model_fields())
  return c
