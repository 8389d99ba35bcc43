"""A trained model restored from a workdir (config, tokenizer, the newest checkpoint that
verifies), or an ensemble of several, with jitted decoders: best translations and n-best
lists.

Only the parameters are read from the checkpoint (not the optimizer state), onto whatever
devices this machine has.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from transformer_jax.data.tokenizer import EOS
from transformer_jax.decoding import platforms, slots, streams
from transformer_jax.decoding import shortlist as vocab_map
from transformer_jax.data.catalog import DATASETS
from transformer_jax.decoding.generation import SPECIALS, encode_sources, scored, slot_model, strip
from transformer_jax.decoding.options import DecodeOptions, InferenceError
from transformer_jax.models import int8
from transformer_jax.programs import ProgramStore
from transformer_jax.runs import restore
from transformer_jax.runs.workdir import Workdir


# The columns a slot decoder's steps project onto with a shortlist, by the searches it runs at
# once (its slots): the union of that many sources' candidates fits. On the main job's model and
# map (shortlist.py's defaults), 30 groups of random validation sources: 32 sources brought
# 2,713 pieces (median; at most 2,980), 128 sources 3,982 (at most 4,097).
SHORTLIST_WIDTH = ((8, 2048), (32, 3072), (64, 4096), (1 << 30, 5120))


def shortlist_width(num_slots: int, beam_size: int) -> int:
  """The columns a slot decoder's steps project onto with a shortlist, where none is named:
  SHORTLIST_WIDTH's for the nearest number of searches (slots) at or above `num_slots`."""
  return next((w for n, w in SHORTLIST_WIDTH if num_slots <= n), SHORTLIST_WIDTH[-1][1])


def quantized(config, params):
  """The parameters with int8 kernels (models/int8.py), the tied token table among them."""
  model = config.model
  table = None
  if model.tie_output:
    table = "src_embed" if model.share_embeddings else "tgt_embed"
  return jax.jit(functools.partial(int8.quantize, table=table))(params)


class Translator:
  """Restores a workdir's model and tokenizer (or several workdirs' models sharing a
  vocabulary: an ensemble) and translates batches of sentences."""

  def __init__(self, workdir: str | Path | Sequence[str | Path], step: int | None = None,
               ema: bool = True, programs: ProgramStore | None = None,
               platform: str | None = None, int8_weights: bool = False,
               shortlist: str | Path | None = None, shortlist_width: int = 0):
    """`workdir`: one, or several decoded as an ensemble (their log-probabilities averaged at
    every step); the first gives the config (max_len, decoding defaults). `step`: the
    checkpoint to read (every workdir's), default the newest that verifies. `ema`: decode with
    the evaluation parameters where a run kept them (a moving average, ema_decay > 0, or
    schedule-free's). `programs`: where the
    decoding slots' compiled programs are kept for later commands. `platform`: whose slot
    settings (lanes, width classes, run sizes) decode_slots uses, default the device's ("cpu",
    "gpu" or "tpu"; a CPU can run an accelerator's). `int8_weights`: every member's products
    in int8 (models/int8.py). `shortlist`: a vocabulary shortlist file (shortlist.py) the slot
    decoders project onto, `shortlist_width` columns a step (0: SHORTLIST_WIDTH's)."""
    self.programs = ProgramStore(None) if programs is None else programs  # None: nothing kept.
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
      params.append(quantized(config, member_params) if int8_weights else member_params)
      steps.append(member_step)
      tokenizers.append(tok)
      max_lens.append(config.data.max_len)
    self.models, self.all_params = tuple(models), tuple(params)
    self.step = steps[0] if len(steps) == 1 else tuple(steps)
    self.max_src_len = min(max_lens)  # Sources longer than a member's max_len are truncated.
    self.max_output_len = 4 * self.max_src_len  # Longer outputs than this are refused.
    self._slot_decoders: dict[tuple, slots.SlotDecoder] = {}
    self.shortlist, self.shortlist_width = None, shortlist_width
    if shortlist is not None:
      try:
        self.shortlist = vocab_map.read(shortlist, self.tokenizers.tgt.pieces())
      except OSError as e:
        raise InferenceError(f"cannot read the shortlist {shortlist}: {e.strerror or e}"
                             ) from None
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
      vocab, candidates = self.tokenizers.tgt.vocab_size, None
      if self.shortlist is not None:
        columns = self.shortlist_width or shortlist_width(num_slots, options.beam_size)
        candidates = vocab_map.Candidates(self.shortlist, vocab, (EOS,), columns)
      self._slot_decoders[key] = slots.SlotDecoder(
          slot_model(models, vocab, candidates), params, num_slots, width,
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
