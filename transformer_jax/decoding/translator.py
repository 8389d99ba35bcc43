"""A trained model restored from a workdir (config, tokenizer, the newest checkpoint that
verifies), or an ensemble of several, with jitted decoders: best translations and n-best
lists.

Only the parameters are read from the checkpoint (not the optimizer state), onto whatever
devices this machine has.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import tqdm
from absl import logging

from transformer_jax import errors
from transformer_jax.decoding import platforms, restore, sentences, slots, streams
from transformer_jax.data.catalog import DATASETS
from transformer_jax.decoding.generation import SPECIALS, encode_sources, scored, slot_model, strip
from transformer_jax.decoding.options import DecodeOptions, InferenceError
from transformer_jax.programs import ProgramStore
from transformer_jax.workdir import Workdir


class Translator:
  """Restores a workdir's model and tokenizer (or several workdirs' models sharing a
  vocabulary: an ensemble) and translates batches of sentences."""

  def __init__(self, workdir: str | Path | Sequence[str | Path], step: int | None = None,
               ema: bool = True, programs: ProgramStore = ProgramStore(None),
               platform: str | None = None):
    """`workdir`: one, or several decoded as an ensemble (their log-probabilities averaged at
    every step); the first gives the config (max_len, decoding defaults). `step`: the
    checkpoint to read (every workdir's), default the newest that verifies. `ema`: decode with
    the parameters' moving average where a run kept one (ema_decay > 0). `programs`: where the
    decoding slots' compiled programs are kept for later commands. `platform`: whose slot
    settings (lanes, width classes, run sizes) decode_slots uses, default the device's ("cpu",
    "gpu" or "tpu"; a CPU can run an accelerator's)."""
    self.programs = programs
    workdirs = [workdir] if isinstance(workdir, (str, Path)) else list(workdir)
    if not workdirs:
      raise InferenceError("no workdir given")
    models, params, steps, tokenizers, max_lens = [], [], [], [], []
    for path in workdirs:
      if tokenizers and not Workdir(path).tokenizers().same_as(tokenizers[0]):
        raise InferenceError(f"{path} has another vocabulary than {workdirs[0]}: an ensemble "
                             "needs the same tokenizer in every workdir")
      member = restore.restore(path, "encoder_decoder", "translate", step, ema, programs)
      config, tok, model = member.config, member.tokenizers, member.model
      member_step, member_params, uses_ema = member.step, member.params, member.uses_ema
      if not models:
        self.config, self.tokenizers, self.uses_ema = config, tok, uses_ema
      models.append(model)
      params.append(member_params)
      steps.append(member_step)
      tokenizers.append(tok)
      max_lens.append(config.data.max_len)
    self.models, self.all_params = tuple(models), tuple(params)
    self.step = steps[0] if len(steps) == 1 else tuple(steps)
    self.max_src_len = min(max_lens)  # Sources longer than a member's max_len are truncated.
    self.max_output_len = 4 * self.max_src_len  # Longer outputs than this are refused.
    self._slot_decoders: dict[tuple, slots.SlotDecoder] = {}
    # The slot settings of decode_slots: streams of slots that decode a file at once, the
    # decoders' width classes below the model's max_len, their smallest run size (the sizes
    # above it quarter for a file: slots.RUN_RATIO), the source tokens their encoder computes
    # at once.
    platform = platform or jax.default_backend()
    settings = platforms.settings(platform)
    self.lanes = settings.lanes
    self.width_classes = settings.width_classes
    self.min_rows_fraction = settings.min_rows_fraction
    self.row_copy = settings.row_copy
    self.encode_tokens = settings.encode_tokens

  @property
  def model(self):
    """The (first member's) model."""
    return self.models[0]

  @property
  def params(self):
    """The (first member's) parameters."""
    return self.all_params[0]

  @property
  def src_lang(self) -> str:
    """The source language's code (e.g. "en"), from the dataset the model was trained on."""
    return DATASETS[self.config.data.dataset].src_lang

  @functools.partial(jax.jit, static_argnums=(0, 3, 4, 7))
  def decode_ids(self, params, src, max_len, beam_size, alpha, limits=None, beam_stop="exact"):
    """params: `all_params`; src [B, S] -> (tokens [B, K, max_len], scores [B, K]): every beam
    best first (K = beam_size; greedy: K = 1), scores as generation.scored. Compiled once per
    shape and beam size; `alpha` is traced (pass it as an array), so any alpha reuses it.
    `limits` [B]: each row's own output length limit (generation.scored). `beam_stop`: when a
    beam search ends (search.BEAM_STOPS). Only the tokenizer's ids are emitted, never the
    padding of the model's vocabulary."""
    return scored(self.models, params, src, max_len, beam_size, alpha, limits, beam_stop,
                  self.tokenizers.tgt.vocab_size)

  def decode(self, src: np.ndarray, options: DecodeOptions,
             widths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """src [B, S] -> (tokens [B, K, L], scores [B, K]) as numpy (decode_ids with `options`).
    `widths` [B] (at most S): each row decodes as it would in a batch of that width (its
    output limit, width + options.max_len_margin; with options.max_len, every row's is that),
    so rows of different widths can share a batch."""
    max_len = options.max_len or src.shape[1] + options.max_len_margin
    limits = None
    if widths is not None and not options.max_len:
      limits = np.asarray(widths, np.int32) + options.max_len_margin
    out = self.decode_ids(self.all_params, src, max_len, options.beam_size,
                          np.float32(options.alpha), limits, options.beam_stop)
    return tuple(map(np.asarray, out))

  @property
  def slot_widths(self) -> list[int]:
    """The source widths of the slot decoders' classes, ascending: `width_classes` below the
    model's max_len (rounded up to 8), then that."""
    full = -(-self.max_src_len // 8) * 8
    return [w for w in self.width_classes if w < full] + [full]

  def compile_slot_programs(self) -> None:
    """Compiles (or loads) every run size and the other programs of each slot decoder made so
    far (SlotDecoder.compile), not only those its traffic met."""
    for decoder in self._slot_decoders.values():
      decoder.compile()

  def slot_decoder(self, options: DecodeOptions, num_slots: int, width: int | None = None,
                   use: str = "server") -> slots.SlotDecoder:
    """The slot decoder of `num_slots` searches with `options`, for sources of up to `width`
    tokens (default: the model's max_len, rounded up to 8), whose run sizes suit `use` ("file"
    or "server": slots.RUN_RATIO): one per setting, so its programs compile once (the same for
    any input and any length penalty)."""
    width = width or self.slot_widths[-1]
    max_len = options.max_len or width + options.max_len_margin
    scores = slots.computes_scores(options.beam_size, options.scores)
    key = (num_slots, width, max_len, options.beam_size, options.beam_stop, scores,
           self.min_rows_fraction, slots.RUN_RATIO[use], self.row_copy, self.encode_tokens)
    if key not in self._slot_decoders:
      models = self.model if len(self.models) == 1 else self.models
      params = self.params if len(self.models) == 1 else self.all_params
      self._slot_decoders[key] = slots.SlotDecoder(
          slot_model(models, self.tokenizers.tgt.vocab_size), params, num_slots, width,
          max_len, SPECIALS, options.beam_size, beam_stop=options.beam_stop,
          programs=self.programs, min_rows_fraction=self.min_rows_fraction,
          row_copy=self.row_copy, encode_tokens=self.encode_tokens, scores=scores,
          run_ratio=slots.RUN_RATIO[use])
    return self._slot_decoders[key]

  def decode_slots(self, sources: list[np.ndarray], options: DecodeOptions, num_slots: int,
                   progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids with <eos> (unpadded, at most max_len) -> [(tokens [K, L], scores [K])], as
    `decode` gives each in a batch of its own width (output limit: its width rounded up to 8 +
    options.max_len_margin, or options.max_len), through `self.lanes` streams of `num_slots`
    decoding slots each.

    Sources go to the slots of the narrowest of `slot_widths` that holds them, the widest
    class first (platforms.py says why)."""
    widths = self.slot_widths
    width_of = [next(w for w in widths if len(ids) <= w) for ids in sources]
    jobs, members = [], []
    for width in sorted(set(width_of), reverse=True):
      members.append([i for i, w in enumerate(width_of) if w == width])
      limits = [options.max_len or -(-len(sources[i]) // 8) * 8 + options.max_len_margin
                for i in members[-1]]
      jobs.append(streams.Job(self.slot_decoder(options, num_slots, width, use="file"),
                            [sources[i] for i in members[-1]], limits, options.alpha))
    results: list = [None] * len(sources)
    for indices, out in zip(members, streams.decode_jobs(jobs, progress=progress,
                                                       lanes=self.lanes)):
      for i, result in zip(indices, out):
        results[i] = result
    return results

  def translate(self, sentences: list[str], options: DecodeOptions = DecodeOptions(),
                numbers: list[int] | None = None) -> list[str]:
    """`numbers`: the sentences' line numbers, for warnings (default: 1, 2, ...)."""
    src = encode_sources(self.tokenizers.src, sentences, self.max_src_len, numbers=numbers)
    tokens = self.decode(src, options)[0][:, 0]
    return [self.tokenizers.tgt.decode(strip(row)) for row in tokens]

  def n_best(self, sentences: list[str], n: int, options: DecodeOptions,
             numbers: list[int] | None = None) -> list[list[tuple[float, str]]]:
    """The `n` best beams of each sentence, best first: (score, translation), the score being
    the beam's log-probability / GNMT length penalty (options.beam_size >= n)."""
    if not 1 <= n <= options.beam_size:
      raise InferenceError(f"--n_best {n} must be between 1 and the beam size "
                           f"({options.beam_size})")
    src = encode_sources(self.tokenizers.src, sentences, self.max_src_len, numbers=numbers)
    tokens, scores = self.decode(src, options)
    return [[(float(scores[i, j]), self.tokenizers.tgt.decode(strip(tokens[i, j])))
             for j in range(n)] for i in range(len(sentences))]


def translate_lines(translator: Translator, lines: list[str], options: DecodeOptions,
                    batch_size: int, progress: bool = True, segment_over: int | None = None,
                    long_beam: tuple[int, int] | None = None, batch_tokens: int = 0,
                    num_slots: int = 0) -> list[str]:
  """Translates many sentences, batched by similar length (or, with `num_slots`, streamed
  through that many decoding slots, longest first), in the input order; an empty (or
  blank) line translates to an empty line. A line of more than `segment_over` tokens (with
  <eos>) is translated sentence by sentence (sentences.py; None: no line is split), and a
  piece over the model's max_len in pieces that fit (split_to_fit): nothing is truncated.
  `long_beam` = (over, beam size): a line (or sentence of a split line) of more than `over`
  tokens is decoded with that beam size instead of `options.beam_size`."""
  pieces, owners = split_to_fit(translator, lines, segment_over)
  numbers = [i + 1 for i in owners]
  groups = [(range(len(pieces)), options)]
  if long_beam is not None:
    over, beam_size = long_beam
    is_long = [n > over for n in _token_lengths(translator, pieces)]
    groups = [([i for i, x in enumerate(is_long) if not x], options),
              ([i for i, x in enumerate(is_long) if x],
               dataclasses.replace(options, beam_size=beam_size))]
  translations = _translate_each(translator, pieces, groups, batch_size, progress, numbers,
                                 batch_tokens=batch_tokens, num_slots=num_slots)
  return sentences.join(translations, owners, len(lines))


def split_to_fit(translator: Translator, lines: list[str], segment_over: int | None
                 ) -> tuple[list[str], list[int]]:
  """The pieces `translate` and `serve` decode for `lines`, and the line each came from: a line
  of more than `segment_over` tokens cut into sentences (None: none), and any piece over the
  model's max_len cut to fit (sentences.split_long), with a warning counting such lines."""
  lengths, limit = _token_lengths(translator, lines), translator.max_src_len
  over = sum(n > limit for n in lengths)
  if over:
    logging.warning("%d of %d sources have more tokens than the model's %d (data.max_len): "
                    "each is translated in pieces cut at clauses, else between words", over,
                    len(lines), limit)
  return sentences.split_long(lines, lengths, segment_over, translator.src_lang, limit,
                              lambda texts: _token_lengths(translator, texts))


def _token_lengths(translator: Translator, lines: list[str]) -> list[int]:
  """Source tokens of each line, with <eos>."""
  return [len(ids) + 1 for ids in translator.tokenizers.src.encode(lines)]


def n_best_lines(translator: Translator, lines: list[str], n: int, options: DecodeOptions,
                 batch_size: int, progress: bool = True, batch_tokens: int = 0,
                 num_slots: int = 0) -> list[list[tuple[float, str]]]:
  """The `n` best beams (score, translation) of every line, best first, in the input order;
  each line is translated whole (no sentence splitting); a blank line gets an empty list."""
  translate = lambda texts, options, numbers: translator.n_best(texts, n, options, numbers)
  return _translate_each(translator, lines, [(range(len(lines)), options)], batch_size, progress,
                         translate=translate, empty=[], batch_tokens=batch_tokens,
                         num_slots=num_slots, n_best=n)


# Beam search's batches hold this many times greedy's decoder rows: a search runs most of its
# steps for every sentence, so larger batches waste less there than greedy's, whose rows end
# at different steps (on the Tatoeba sources, 2 was the fastest of 1, 2, 3 and 4 with beam 4:
# docs/translating.md).
BEAM_BUDGET = 2


def batch_rows(width: int, beam_size: int, batch_size: int, batch_tokens: int) -> int:
  """The sentences of a batch of sources of this width (tokens, a multiple of 8): `batch_size`,
  or with `batch_tokens` as many as fit that many decoder rows x source tokens, at most
  `batch_size`; beams count as rows, and beam search gets BEAM_BUDGET times the budget."""
  if not batch_tokens:
    return batch_size
  budget = batch_tokens * (BEAM_BUDGET if beam_size > 1 else 1)
  return max(1, min(batch_size, budget // (width * beam_size)))


def _translate_each(translator: Translator, lines: list[str],
                    groups: list[tuple[Sequence[int], DecodeOptions]], batch_size: int,
                    progress: bool, numbers: list[int] | None = None, translate=None,
                    empty="", batch_tokens: int = 0, num_slots: int = 0, n_best: int = 0) -> list:
  """Translates the lines of each group (their indices) with the group's options, in batches
  of lines of similar token length: one batch shape per source width (a multiple of 8), so
  one compilation each, of `batch_rows` lines.
  `numbers`: each line's number in warnings (default: its index + 1). `translate(texts,
  options, numbers)`: what a batch gives (default: Translator.translate); `empty`: the result
  of a blank line."""
  numbers = numbers or list(range(1, len(lines) + 1))
  if num_slots:
    return _translate_in_slots(translator, lines, groups, num_slots, progress, numbers, empty,
                               n_best)
  translate = translate or translator.translate
  lengths = [min(n, translator.max_src_len) for n in _token_lengths(translator, lines)]
  batches = []
  for indices, options in groups:
    order = sorted((i for i in indices if lines[i].strip()), key=lambda i: lengths[i])
    width_of = lambda i: -(-lengths[i] // 8) * 8
    for width, members in itertools.groupby(order, key=width_of):
      members = list(members)
      rows = batch_rows(width, options.beam_size, batch_size, batch_tokens)
      batches += [(members[i:i + rows], options, rows) for i in range(0, len(members), rows)]
  out = [empty] * len(lines)
  for batch, options, rows in tqdm.tqdm(batches, desc="translating", unit="batch",
                                        disable=not progress):
    # Pad the batch to a full one so that every batch of a width shares the compiled shape.
    texts = [lines[i] for i in batch]
    pad = rows - len(batch)
    results = translate(texts + texts[:1] * pad, options,
                        [numbers[i] for i in batch] + [numbers[batch[0]]] * pad)
    for i, result in zip(batch, results):
      out[i] = result
  return out


def _translate_in_slots(translator: Translator, lines: list[str],
                        groups: list[tuple[Sequence[int], DecodeOptions]], num_slots: int,
                        progress: bool, numbers: list[int], empty, n_best: int) -> list:
  """_translate_each through `num_slots` decoding slots: each group's lines streamed through
  them longest first. With `n_best`, each line's n best (score, translation), else its best
  translation."""
  out = [empty] * len(lines)
  tgt = translator.tokenizers.tgt
  if not n_best:  # Only the best output's text is given: greedy searches skip their scores.
    groups = [(indices, dataclasses.replace(options, scores=False))
              for indices, options in groups]
  with tqdm.tqdm(total=sum(1 for i, _ in enumerate(lines) if lines[i].strip()),
                 desc="translating", unit="sentence", disable=not progress) as bar:
    for indices, options in groups:
      indices = [i for i in indices if lines[i].strip()]
      if not indices:
        continue
      src = encode_sources(translator.tokenizers.src, [lines[i] for i in indices],
                           translator.max_src_len, numbers=[numbers[i] for i in indices])
      rows = [row[row != 0] for row in src]
      results = translator.decode_slots(rows, options, num_slots, progress=bar.update)
      for i, (tokens, scores) in zip(indices, results):
        if n_best:
          out[i] = [(float(scores[j]), tgt.decode(strip(tokens[j]))) for j in range(n_best)]
        else:
          out[i] = tgt.decode(strip(tokens[0]))
  return out


def split_pairs(workdir: str, split: str) -> tuple[list[str], list[str]]:
  """(sources, references) of a split of the dataset a workdir was trained on."""
  from transformer_jax.data import sources
  from transformer_jax.data.builders import DatasetError
  config = Workdir(workdir).load_config().data
  if config.data_dir and not Path(config.data_dir).is_dir():  # Moved, or another directory.
    raise InferenceError(
        f"--split {split} reads the run's corpus, data.data_dir={config.data_dir!r} in its "
        f"config.json, which is not a directory from {Path.cwd()}: run from where that path "
        "names the corpus, or translate the split's sources with --input FILE")
  try:
    builder = sources.prepare_config(config)
    pairs = sources.pairs(builder, config.dataset, split)
  except (DatasetError, FileNotFoundError, ValueError, KeyError) as e:
    raise InferenceError(f"--split {split} of {config.dataset} (data_dir="
                         f"{config.data_dir!r}) cannot be read: {errors.first_line(e)}"
                         ) from None
  if not pairs:
    raise InferenceError(f"--split {split} of {config.dataset} is empty")
  return [s for s, _ in pairs], [t for _, t in pairs]
