"""What differs between the families' training runs, in one table.

A run's task follows from its model family and the kind of corpus its dataset holds:

  family           corpus     task                   evaluation beyond loss and accuracy
  encoder_decoder  pairs      translation            perplexity; BLEU of a sample (bleu_eval)
  decoder_only     documents  language model         perplexity; bits a character
  encoder_only     documents  masked language model  perplexity, on the same masks each time
  encoder_only     labelled   classifier             accuracy of always guessing the majority

The trainer, `aot` and the config checks look a run's task up here (`of`): how its corpus is
prepared, streamed and held out, whether its step draws masks. Nothing else branches on the
family to do so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from absl import logging

from transformer_jax import config as config_lib
from transformer_jax.data import documents, labelled, pipeline
from transformer_jax.data.catalog import DATASETS, DatasetSpec
from transformer_jax.training import steps as step_lib

# The kinds of corpus. Each has `name` (as messages say it), `documents` (its rows hold one
# text's tokens, not pairs: the batch's features), `perplexity` (its evaluation has a token's),
# and how it is prepared, streamed (what it trains on logged) and held out for evaluation.


class Pairs:
  """Sentence pairs (a translation model's corpus): packed pairs, a sample kept for BLEU."""
  name, documents, perplexity = "sentence pairs", False, True

  def prepare(self, cfg: config_lib.Config, workdir: Path, trained_labels: tuple[str, ...],
              first_host: dict) -> pipeline.Prepared:
    return pipeline.prepare(cfg.data, workdir, num_bleu_sentences=cfg.eval.bleu_sentences,
                            **first_host)

  def stream(self, cfg: config_lib.Config, data: pipeline.Prepared, num_workers: int,
             row_args: dict) -> pipeline.TrainStream:
    d = cfg.data
    stream = pipeline.pair_stream(data.train, overlong=d.overlong, concat_prob=d.concat_prob,
                                  concat_max=d.concat_max, num_workers=num_workers, **row_args)
    pipeline.log_selection(d.train_split, stream.selection, d.max_len)
    return stream

  def held_out(self, cfg: config_lib.Config, data: pipeline.Prepared, stream,
               rows: dict) -> tuple[list, dict[str, float]]:
    return pipeline.eval_batches(data.eval, overlong=cfg.data.overlong, **rows), {}


class Documents:
  """Documents (a language model's corpus), cut into chunks of max_len tokens."""
  name, documents, perplexity = "documents", True, True

  def prepare(self, cfg, workdir, trained_labels, first_host):
    return pipeline.prepare_documents(cfg.data, workdir, **first_host)

  def stream(self, cfg, data, num_workers, row_args):
    stream = pipeline.document_stream(data.train, num_workers=num_workers, **row_args)
    documents.log_documents(cfg.data.train_split, stream.blocks.documents, cfg.data.max_len)
    return stream

  def held_out(self, cfg, data, stream, rows):
    return documents.eval_batches(data.eval, **rows), {}


class Labelled:
  """Labelled texts (a classifier's corpus), one a row; `trained_labels`: those a resumed run
  was trained on. Held out, beside the classifier's accuracy: that of always guessing the most
  frequent label of the texts it trains on."""
  name, documents, perplexity = "labelled texts", True, False  # A label's, not a token's.

  def prepare(self, cfg, workdir, trained_labels, first_host):
    return pipeline.prepare_labelled(cfg.data, workdir, trained_labels=trained_labels,
                                     **first_host)

  def stream(self, cfg, data, num_workers, row_args):
    stream = pipeline.labelled_stream(data.train, data.train_labels, num_workers=num_workers,
                                      fraction=cfg.data.train_fraction, **row_args)
    labelled.log_texts(cfg.data.train_split, stream.blocks.documents, cfg.data.max_len,
                       data.train_labels, data.label_names)
    if cfg.data.train_fraction < 1:
      logging.info("data.train_fraction=%g: training on those %d texts only (labelled.subset)",
                   cfg.data.train_fraction, len(stream.blocks.documents.ids))
    return stream

  def held_out(self, cfg, data, stream, rows):
    trained = data.train_labels[stream.blocks.documents.ids]
    majority = float(np.mean(data.eval_labels == np.argmax(np.bincount(trained))))
    return (labelled.eval_batches(data.eval, data.eval_labels, **rows),
            {"majority_accuracy": majority})


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  corpus: Pairs | Documents | Labelled
  masked: bool = False  # Its step draws a masked language model's masks.
  per_character: bool = False  # Its evaluation counts bits a character of the held-out text.

  def prepare(self, cfg: config_lib.Config, workdir: Path, *,
              trained_labels: tuple[str, ...] = (), **first_host) -> pipeline.Prepared:
    """The run's tokenizers and token caches, built on the first host and read on the
    others."""
    return self.corpus.prepare(cfg, Path(workdir), trained_labels, first_host)

  def stream(self, cfg: config_lib.Config, data: pipeline.Prepared, num_workers: int,
             process_index: int, process_count: int) -> pipeline.TrainStream:
    """This host's training batches; what it trains on, logged."""
    d = cfg.data
    row_args = dict(batch_size=d.batch_size, max_len=d.max_len, seed=cfg.run.seed,
                    pack=d.packing, process_index=process_index, process_count=process_count)
    return self.corpus.stream(cfg, data, num_workers, row_args)

  def held_out(self, cfg: config_lib.Config, data: pipeline.Prepared,
               stream: pipeline.TrainStream, process_index: int,
               process_count: int) -> tuple[list, dict[str, float]]:
    """(this host's evaluation batches, the evaluation's fixed figures)."""
    rows = dict(batch_size=cfg.eval.batch_size, max_len=cfg.data.max_len,
                pack=cfg.data.packing, process_index=process_index, process_count=process_count)
    return self.corpus.held_out(cfg, data, stream, rows)

  def masking(self, vocab_size: int, step: step_lib.StepConfig = step_lib.StepConfig(),
              tokenizer=None) -> step_lib.Masking | None:
    """The masking rule its step draws from (None: it draws none)."""
    return step_lib.masking_rule(vocab_size, step, tokenizer) if self.masked else None


PAIRS, DOCUMENTS, LABELLED = Pairs(), Documents(), Labelled()
TASKS = {
    ("encoder_decoder", PAIRS): Task("translation", PAIRS),
    ("decoder_only", DOCUMENTS): Task("language model", DOCUMENTS, per_character=True),
    ("encoder_only", DOCUMENTS): Task("masked language model", DOCUMENTS, masked=True),
    ("encoder_only", LABELLED): Task("classifier", LABELLED),
}


def corpus_of(spec: DatasetSpec) -> Pairs | Documents | Labelled:
  return DOCUMENTS if spec.documents else LABELLED if spec.labelled else PAIRS


def of(family: str, dataset: str) -> Task:
  """The task of a model family trained on a registered dataset.

  Raises:
    ConfigError: the family cannot train on that dataset's kind of corpus.
  """
  corpus = corpus_of(DATASETS[dataset])
  if (family, corpus) not in TASKS:
    families = [f for f, c in TASKS if c == corpus]
    raise config_lib.ConfigError(
        f"data.dataset={dataset!r} holds {corpus.name}, for {' or '.join(families)} "
        f"models; model.family={family!r}")
  return TASKS[family, corpus]
