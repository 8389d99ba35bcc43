"""Hugging Face `transformers` model directories, both ways: a trained workdir exported as
one, and a local GPT-2 or BERT checkpoint read as this project's model.

Export (`export --to huggingface`):

A trained workdir's model as a Hugging Face `transformers` model directory.

  python -m transformer_jax export --workdir runs/lm_shakespeare --to huggingface runs/lm_hf

What each family becomes, and how it computes the same function:
  decoder_only   GPT2LMHeadModel: pre-LN blocks with a final LayerNorm, a tied output. Our
                 embeddings are scaled by sqrt(D) before the positions are added; GPT-2's are
                 not, so the exported token table is ours times sqrt(D), and the final
                 LayerNorm's scale and bias are divided by sqrt(D) (the tied projection then
                 reads the table times sqrt(D): the logits are ours).
  encoder_decoder MarianMTModel: post-LN blocks, embeddings scaled by sqrt(D) as ours, one
                 shared, tied vocabulary table; its position tables are state, written as ours
                 (sin and cos interleaved, where Marian's own puts the sines first). Marian's
                 LayerNorms have epsilon 1e-5, fixed: a model trained with another (the recipes
                 use 1e-6) computes nearly the same function (logged).
  encoder_only   BertForMaskedLM (a masked language model) or BertForSequenceClassification (a
                 classifier, its labels as id2label): post-LN blocks with BERT's LayerNorm after
                 the embeddings (model.embed_norm=True). The token table is scaled as above, and
                 the masked-LM head's LayerNorm divided by sqrt(D); token types are one row of
                 zeros.
Sinusoidal positions are written out as a learned table of max_len rows holding their values.
The attention's separate query, key and value kernels are joined or transposed to the
layouts of torch's Linear ([out, in]) or GPT-2's Conv1D ([in, out]).

Settings with no counterpart are refused in one line before anything is written: a post-LN
language model (GPT-2 is pre-LN), a pre-LN encoder or one without model.embed_norm (BERT is
post-LN with an embedding LayerNorm), a pre-LN translation model or one without a single shared
vocabulary table (Marian), an untied output projection (GPT-2's and BERT's have no
bias of their own), word vocabularies. The tokenizer is this run's SentencePiece model as a
`tokenizers` Unigram model (tokenizer.json), giving the same ids; <bos> is put before a text
where this project's model reads one (language models, classifiers), <eos> after a translation
source. A generating model's generation_config.json keeps generate() from choosing what this
project's decoders never choose: the padded vocabulary's ids (and <pad>, <bos>, <unk> for a
language model), and sets its length limit to the model's max_len (generate()'s own is 20
tokens). A masked model's output bias at the ids that stand for no text (<pad>, <bos>, <eos>,
[MASK], the padded vocabulary's) is NO_TEXT_BIAS, so that a fill-mask pipeline offers pieces of
text only, as `fill` does; its logits at every other id are ours.
A run that started from a Hugging Face checkpoint (data.tokenizer='huggingface') goes back in
that checkpoint's ids with its own tokenizer.json (`_in_checkpoint_ids`).

Written with NumPy, safetensors and tokenizers only (pip install '.[huggingface]');
loading the result takes `transformers` (in that extra) and torch.

Import (`run.init_from` naming a checkpoint):

A local Hugging Face checkpoint of GPT-2 or BERT read as this project's model: what
`run.init_from` takes when it names one (training/finetune.py), with no network and no torch.

  GPT2LMHeadModel  -> decoder_only: pre-LN blocks, learned positions, a final LayerNorm and an
                      output tied to the token table.
  BertForMaskedLM  -> encoder_only: post-LN blocks, learned positions, BERT's LayerNorm after the
                      embeddings (model.embed_norm), the masked-LM head and its output bias.

The export's mapping read backwards. Our embeddings are scaled by
sqrt(D) and theirs are not: the token table is theirs divided by sqrt(D), and the LayerNorm
right before the tied projection (GPT-2's ln_f, BERT's head transform) is multiplied by sqrt(D),
so the logits are theirs. BERT's token-type row 0 (every token's type here) is added into the
position table. A position table longer than data.max_len is cut to its first rows. Ids are
renumbered (data/tokenizer.py's HuggingFaceTokenizer): the token table and BERT's output bias are permuted with
them; a new id (GPT-2's <pad>, <unk> and its <bos>, which starts from <|endoftext|>'s row) and
the rows that pad the vocabulary take the mean of the checkpoint's rows, so their logits are
ordinary ones. Weights are read from model.safetensors (or the shards its index names).
"""


from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from flax import traverse_util

from transformer_jax import errors, fs
from transformer_jax.data.tokenizer import (BOS, EOS, NEW, PAD, UNK, HuggingFaceTokenizer,
                                            SentencePiece, Tokenizers)
from transformer_jax.runs import restore
from transformer_jax.errors import UserError
from transformer_jax.interop import tables
from transformer_jax.models import build
from transformer_jax.runs.workdir import Workdir

ARCHITECTURES = {"GPT2LMHeadModel": "decoder_only", "BertForMaskedLM": "encoder_only"}
# Their activation names -> model.activation (gelu_new is GELU's tanh approximation).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# An exported masked model's output bias at the ids that stand for no text (<pad>, <bos>,
# <eos>, [MASK] and the padded vocabulary's), which `fill` never offers: no pipeline ranks them.
NO_TEXT_BIAS = -1e4
CONFIG = "config.json"  # The format's own, not a workdir's.
_TABLES = {"GPT2LMHeadModel": tables.GPT2, "BertForMaskedLM": tables.BERT_MASKED_LM}


class CheckpointError(UserError, ValueError):
  """A directory that is not a Hugging Face checkpoint this project can start from."""


def is_checkpoint(path: str | Path) -> bool:
  """Whether `path` looks like a Hugging Face model directory (a config.json naming its
  model_type) rather than a training workdir (whose config.json holds sections)."""
  file = Path(path) / CONFIG
  try:
    saved = json.loads(file.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(saved, dict) and "model_type" in saved and "model" not in saved


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A checked Hugging Face model directory: its config.json and its architecture's family."""
  path: Path
  config: dict
  architecture: str

  @classmethod
  def open(cls, path: str | Path) -> "Checkpoint":
    """Raises CheckpointError naming the problem: no config.json or weights, an architecture
    or a setting this project does not map."""
    path, where = Path(path), f"run.init_from={str(path)!r}"
    try:
      config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
      raise CheckpointError(f"{where} holds no readable config.json ({type(e).__name__}): not "
                            "a Hugging Face checkpoint") from None
    found = config.get("architectures") or [config.get("model_type", "?")]
    if found[0] not in ARCHITECTURES:
      raise CheckpointError(f"{where} is a {found[0]}; this project starts from "
                            f"{' or '.join(ARCHITECTURES)} checkpoints")
    if not ((path / WEIGHTS).is_file() or (path / INDEX).is_file()):
      raise CheckpointError(f"{where} holds no {WEIGHTS} (weights saved as safetensors; "
                            "save_pretrained writes them)")
    checkpoint = cls(path, config, found[0])
    refusal = checkpoint._refusal()
    if refusal:
      raise CheckpointError(f"{where}: {refusal}")
    return checkpoint

  @property
  def family(self) -> str:
    return ARCHITECTURES[self.architecture]

  def _refusal(self) -> str | None:
    c = self.config
    act = c.get("activation_function" if self.family == "decoder_only" else "hidden_act")
    if act not in ACTIVATIONS:
      return f"its activation {act!r} is none of {', '.join(ACTIVATIONS)}"
    if not c.get("tie_word_embeddings", True):
      return "its output projection is not tied to the token table (tie_word_embeddings)"
    if self.family == "decoder_only":
      if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx"):
        return "its attention is not scaled by 1/sqrt(head dim) alone, as ours is"
      if c.get("add_cross_attention"):
        return "its blocks hold cross-attention (add_cross_attention)"
    elif c.get("position_embedding_type", "absolute") != "absolute":
      return (f"its positions are {c['position_embedding_type']!r}; ours are a learned "
              "table of absolute positions")
    return None

  def model_fields(self) -> dict:
    """The model section's fields this checkpoint fixes (a run must set them so)."""
    c = self.config
    if self.family == "decoder_only":
      d = c["n_embd"]
      return dict(family="decoder_only", positions="learned", d_model=d, num_heads=c["n_head"],
                  ffn_dim=c.get("n_inner") or 4 * d, num_encoder_layers=0,
                  num_decoder_layers=c["n_layer"], pre_ln=True, embed_norm=False,
                  attention_bias=True, tie_output=True,
                  activation=ACTIVATIONS[c.get("activation_function", "gelu_new")],
                  layer_norm_eps=c.get("layer_norm_epsilon", 1e-5))
    return dict(family="encoder_only", positions="learned", d_model=c["hidden_size"],
                num_heads=c["num_attention_heads"], ffn_dim=c["intermediate_size"],
                num_encoder_layers=c["num_hidden_layers"], num_decoder_layers=0, pre_ln=False,
                embed_norm=True, attention_bias=True, tie_output=True,
                activation=ACTIVATIONS[c.get("hidden_act", "gelu")],
                layer_norm_eps=c.get("layer_norm_eps", 1e-12))

  @property
  def max_len(self) -> int:
    """The positions its table holds: the longest data.max_len it can read."""
    return self.config["n_positions" if self.family == "decoder_only"
                       else "max_position_embeddings"]

  def tokenizers(self) -> Tokenizers:
    tok = HuggingFaceTokenizer.from_checkpoint(self.path, self.config,
                                               masked=self.family == "encoder_only")
    return Tokenizers(tok, tok)

  def tensors(self) -> dict[str, np.ndarray]:
    """Every saved tensor as float32 NumPy, by the names the tables use: GPT-2's under
    "transformer." (a GPT2Model's have no prefix), BERT's old LayerNorm gamma/beta as
    weight/bias, its masked-LM bias by either of its names."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    if (self.path / WEIGHTS).is_file():
      files = [self.path / WEIGHTS]
    else:
      try:
        shards = json.loads((self.path / INDEX).read_text(encoding="utf-8"))["weight_map"]
        files = [self.path / f for f in sorted(set(shards.values()))]
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{self.path / INDEX} is damaged ({errors.first_line(e)}): "
                              "fetch the checkpoint again") from None
    out = {}
    for file in files:
      try:
        tensors = load_file(str(file))
      except SafetensorError as e:  # A download cut short: "incomplete metadata", ...
        raise CheckpointError(f"{file} cannot be read ({errors.first_line(e)}): a file cut "
                              "short or damaged; fetch the checkpoint again") from None
      for name, value in tensors.items():
        if self.family == "decoder_only" and not name.startswith(("transformer.", "lm_head.")):
          name = "transformer." + name
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias").replace("cls.predictions.decoder.bias",
                                                        "cls.predictions.bias")
        out[name] = value.astype(np.float32)
    return out

  def params(self, cfg, tokenizer: HuggingFaceTokenizer) -> dict[str, object]:
    """Our model's parameters (NumPy, unscanned names: decoder_0, ...) holding the checkpoint's
    weights, for the frozen model config `cfg` (padded vocabulary, max_len) and the tokenizer
    made from this checkpoint. Raises CheckpointError where a tensor is missing or does not
    give the shape the config needs."""
    tensors, table = self.tensors(), _TABLES[self.architecture]
    token_table = VOCABULARY_TABLES[self.family][0]
    if token_table not in tensors:
      raise CheckpointError(f"{self.path} has no tensor {token_table!r}")
    vocab = len(tensors[token_table])
    _check_vocabulary(vocab, tokenizer, self.path)

    def tensor(name: str) -> np.ndarray:
      if name not in tensors:
        raise CheckpointError(f"{self.path} has no tensor {name!r}")
      value = tensors[name]
      if name in VOCABULARY_TABLES[self.family]:  # In our ids, padded to our rows.
        if len(value) != vocab:
          raise CheckpointError(f"{self.path}: {name} has {len(value)} rows, and its token "
                                f"table {vocab}")
        value = _token_table(value, tokenizer, cfg.tgt_vocab_size)
      elif name.endswith("position_embeddings.weight") or name == "transformer.wpe.weight":
        value = value[:cfg.max_len]  # data.max_len rows of a longer table.
      return value

    model = build.build_model(dataclasses.replace(cfg, scan_layers=False))
    shapes = {name: tuple(x.shape) for name, x in traverse_util.flatten_dict(
        nn.unbox(build.abstract_params(model)), sep="/").items()}
    try:
      params = tables.to_ours(table, tensor, cfg, shapes)
    except ValueError as e:
      raise CheckpointError(f"{self.path}: {e}") from None
    if self.family == "encoder_only":  # Every token here is of type 0.
      params["position_embedding"] = params["position_embedding"] + tensor(
          "bert.embeddings.token_type_embeddings.weight")[0]
    return params


def _token_table(table: np.ndarray, tokenizer: HuggingFaceTokenizer, rows: int) -> np.ndarray:
  """[rows, ...]: the checkpoint's `table` (by its ids) in our ids; new ids and padding take
  the mean row, <bos> a copy where it shares the end token (HuggingFaceTokenizer.new_rows)."""
  ids = tokenizer.ids + ([tokenizer.mask] if tokenizer.mask is not None else [])
  out = np.repeat(table.mean(axis=0, keepdims=True), rows, axis=0)
  known = np.asarray(ids)
  out[np.flatnonzero(known >= 0)] = table[known[known >= 0]]
  for ours, theirs in tokenizer.new_rows.items():
    if theirs is not None:
      out[ours] = table[theirs]
  return out


def _check_vocabulary(vocab: int, tokenizer: HuggingFaceTokenizer, path: Path) -> None:
  largest = max(max(tokenizer.ids), tokenizer.mask or 0)
  if largest >= vocab:
    raise CheckpointError(f"{path}: its tokenizer has id {largest}, past the {vocab} rows of "
                          "its token table")


# --- export ---------------------------------------------------------------------------------

MASK_TOKEN = "[MASK]"
# model.activation -> their names (the inverse of ACTIVATIONS).
EXPORTED_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
MARIAN_LAYER_NORM_EPS = 1e-5  # transformers' Marian layers take torch's default.


def refusal(workdir: str | Path) -> str | None:
  """Why the workdir's model has no transformers counterpart, or None."""
  run = Workdir(workdir)
  kind, config = run.model_kind(), run.load_config()
  m = config.model
  if config.data.tokenizer == "word":
    return "it uses word vocabularies; the export builds its tokenizer from a SentencePiece model"
  if kind == "encoder_decoder":
    if m.pre_ln:
      return "it is pre-LN (model.pre_ln=True); Marian's blocks are post-LN"
    if not (m.share_embeddings and m.tie_output):
      return ("its vocabulary tables are not one shared, tied table (model.share_embeddings, "
              "model.tie_output); the export writes Marian's shared one")
    return None
  if not m.tie_output:
    return ("its output projection is not tied to the embeddings (model.tie_output=False); "
            "GPT-2's and BERT's are, with no bias of their own")
  if kind == "decoder_only" and not m.pre_ln:
    return "it is post-LN (model.pre_ln=False); GPT-2's blocks are pre-LN"
  if kind in ("encoder_only", "classifier"):
    if m.pre_ln:
      return "it is pre-LN (model.pre_ln=True); BERT's blocks are post-LN"
    if not m.embed_norm:
      return ("it has no LayerNorm after its embeddings (model.embed_norm=False); BERT has "
              "one: train with --config.model.embed_norm=True")
  return None


def _gpt2(cfg, params) -> tuple[dict, dict]:
  config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.tgt_vocab_size, "n_positions": cfg.max_len, "n_embd": cfg.d_model,
            "n_layer": cfg.num_decoder_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_dim,
            "activation_function": EXPORTED_ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate,
            "attn_pdrop": 0.0, "tie_word_embeddings": True}
  return tables.to_theirs(tables.GPT2, params, cfg), config


def _bert(cfg, params, labels: tuple[str, ...]) -> tuple[dict, dict]:
  w = tables.to_theirs(tables.BERT_CLASSIFIER if labels else tables.BERT_MASKED_LM, params, cfg)
  w["bert.embeddings.token_type_embeddings.weight"] = np.zeros((1, cfg.d_model), np.float32)
  config = {"model_type": "bert", "vocab_size": cfg.tgt_vocab_size, "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_encoder_layers, "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.ffn_dim,
            "hidden_act": EXPORTED_ACTIVATIONS[cfg.activation],
            "hidden_dropout_prob": cfg.dropout_rate, "attention_probs_dropout_prob": 0.0,
            "max_position_embeddings": cfg.max_len, "type_vocab_size": 1,
            "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": PAD,
            "tie_word_embeddings": True}
  if labels:
    config.update(architectures=["BertForSequenceClassification"],
                  id2label={str(i): name for i, name in enumerate(labels)},
                  label2id={name: i for i, name in enumerate(labels)},
                  classifier_dropout=cfg.dropout_rate)
  else:
    config.update(architectures=["BertForMaskedLM"])
  return w, config


def _marian(cfg, params) -> tuple[dict, dict]:
  """MarianMTModel: the paper's post-LN model with sqrt(D)-scaled embeddings, as ours. Its
  position tables are state, written as ours (sin and cos interleaved)."""
  w = tables.to_theirs(tables.MARIAN, params, cfg)
  w["final_logits_bias"] = np.zeros((1, cfg.tgt_vocab_size), np.float32)
  config = {"architectures": ["MarianMTModel"], "model_type": "marian",
            "vocab_size": cfg.tgt_vocab_size, "decoder_vocab_size": cfg.tgt_vocab_size,
            "max_position_embeddings": cfg.max_len, "d_model": cfg.d_model,
            "encoder_layers": cfg.num_encoder_layers, "decoder_layers": cfg.num_decoder_layers,
            "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
            "encoder_ffn_dim": cfg.ffn_dim, "decoder_ffn_dim": cfg.ffn_dim,
            "activation_function": EXPORTED_ACTIVATIONS[cfg.activation],
            "dropout": cfg.dropout_rate, "attention_dropout": 0.0, "activation_dropout": 0.0,
            "scale_embedding": True, "share_encoder_decoder_embeddings": True,
            "tie_word_embeddings": True, "is_encoder_decoder": True,
            "decoder_start_token_id": BOS, "forced_eos_token_id": None}
  return w, config


def tokenizer_json(sp: SentencePiece, mask: bool = False, prepend_bos: bool = False,
                   append_eos: bool = False) -> str:
  """The SentencePiece model as a `tokenizers` Unigram model with its pieces and scores, the
  same ids (byte fallback included); `mask`: [MASK] as the id after the pieces (a masked
  language model's mask id); `prepend_bos`: <bos> before each text, as a language model or a
  classifier reads it; `append_eos`: <eos> after it, as a translation model reads a source."""
  from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                          processors)
  pieces = sp.pieces()
  tok = Tokenizer(models.Unigram(list(zip(pieces, sp.scores())), unk_id=UNK,
                                 byte_fallback=True))
  spec = _normalizer_spec(sp)
  steps = []
  if spec["name"] != "identity":
    steps.append(normalizers.Precompiled(spec["precompiled_charsmap"]))
  if spec["remove_extra_whitespaces"]:
    steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
  if spec["add_dummy_prefix"]:
    steps.append(normalizers.Prepend(" "))
  steps.append(normalizers.Replace(" ", "\u2581"))
  tok.normalizer = normalizers.Sequence(steps)
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)]
                                                       if spec["add_dummy_prefix"] else []))
  specials = [AddedToken(pieces[i], special=True, normalized=False) for i in (PAD, BOS, EOS)]
  tok.add_special_tokens(specials)
  if mask:
    # lstrip: the spaces before [MASK] are the masked piece's, as `fill` reads them.
    tok.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False,
                                       lstrip=True)])
    assert tok.token_to_id(MASK_TOKEN) == build.mask_id(sp.vocab_size)
  bos, eos = pieces[BOS], pieces[EOS]
  if prepend_bos:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, BOS)])
  if append_eos:
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, EOS)])
  return tok.to_str()


# The weights indexed by token id, as each export names them.
VOCABULARY_TABLES = {"decoder_only": ("transformer.wte.weight",),
                     "encoder_only": ("bert.embeddings.word_embeddings.weight",
                                      "cls.predictions.bias")}
NEW_BOS = "<bos>"  # A run that renumbered a checkpoint with no start token of its own (GPT-2).


def _in_checkpoint_ids(weights: dict, hf_config: dict, tok: HuggingFaceTokenizer, kind: str):
  """A run that started from a Hugging Face checkpoint, exported in that checkpoint's ids and
  with its tokenizer.json (data/tokenizer.py renumbered both on import): the token tables' rows
  put back in its order, the ids this project added left out but a new <bos> (GPT-2's), which
  is read before every text and so is kept as one more special token, after the others, that
  the tokenizer puts first. Returns (weights, config, tokenizer.json, special tokens, ids)."""
  from tokenizers import AddedToken, Tokenizer, processors
  ours = np.asarray(tok.ids + ([tok.mask] if tok.mask is not None else []))
  kept = np.flatnonzero(ours >= 0)  # Our ids that are the checkpoint's.
  size = int(ours.max()) + 1
  added = tok.ids[BOS] == NEW
  for name in (n for names in VOCABULARY_TABLES.values() for n in names):
    if name in weights:
      table = weights[name]
      out = np.zeros((size + added,) + table.shape[1:], table.dtype)
      out[ours[kept]] = table[kept]
      if added:
        out[size] = table[BOS]
      weights[name] = out
  hf_config["vocab_size"] = size + added
  text = Tokenizer.from_str(tok.tokenizer_json)
  pieces = tok.pieces()
  bos = size if added else tok.ids[BOS]
  if added:
    text.add_special_tokens([AddedToken(NEW_BOS, special=True, normalized=False)])
    assert text.token_to_id(NEW_BOS) == size
    pieces[BOS] = NEW_BOS
  if kind in ("decoder_only", "classifier"):  # <bos> first, as this project reads a text.
    text.post_processor = processors.TemplateProcessing(
        single=f"{pieces[BOS]} $A", pair=f"{pieces[BOS]} $A $B",
        special_tokens=[(pieces[BOS], bos)])
  roles = {"bos": BOS, "eos": EOS, "unk": UNK, "pad": PAD}
  special = {f"{role}_token": pieces[i] for role, i in roles.items()
             if tok.ids[i] != NEW or (role == "bos" and added)}
  if kind in ("encoder_only", "classifier"):  # BERT's names for its start and end.
    special.update(cls_token=pieces[BOS], sep_token=pieces[EOS])
  if tok.mask is not None:
    special["mask_token"] = text.id_to_token(tok.mask)
  ids = {"bos_token_id": bos, "eos_token_id": tok.ids[EOS],
         "pad_token_id": tok.ids[PAD] if tok.ids[PAD] != NEW else tok.ids[EOS]}
  return weights, hf_config, text.to_str(), special, ids


def _normalizer_spec(sp: SentencePiece) -> dict:
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto.FromString(sp.model_proto).normalizer_spec
  return {"name": proto.name, "precompiled_charsmap": proto.precompiled_charsmap,
          "add_dummy_prefix": proto.add_dummy_prefix,
          "remove_extra_whitespaces": proto.remove_extra_whitespaces}


def export(workdir: str | Path, output: Path, step: int | None = None) -> None:
  """Writes the model of `workdir` (its newest checkpoint that verifies, or `step`) into the
  new directory `output` (export.py has checked both, and `refusal`)."""
  restored = restore.restore(workdir, step=step)
  kind, labels = restored.run.model_kind(), restored.run.labels()
  cfg, tokenizers, step = restored.model.cfg, restored.tokenizers, restored.step
  params = tables.complete(cfg, jax.device_get(restored.params))
  if kind == "decoder_only":
    weights, hf_config = _gpt2(cfg, params)
  elif kind == "encoder_decoder":
    weights, hf_config = _marian(cfg, params)
    if cfg.layer_norm_eps != MARIAN_LAYER_NORM_EPS:
      logging.warning("Marian's LayerNorms have epsilon %g; this model was trained with %g: "
                      "the exported logits differ slightly from ours", MARIAN_LAYER_NORM_EPS,
                      cfg.layer_norm_eps)
  else:
    weights, hf_config = _bert(cfg, params, labels)
  tok = tokenizers.tgt
  if isinstance(tok, HuggingFaceTokenizer):  # Back in the checkpoint's own ids.
    weights, hf_config, text, special, ids = _in_checkpoint_ids(weights, hf_config, tok, kind)
  else:
    pieces = tok.pieces()
    ids = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    special = {"bos_token": pieces[BOS], "eos_token": pieces[EOS], "unk_token": pieces[UNK],
               "pad_token": pieces[PAD]}
    if kind == "encoder_only":
      special["mask_token"] = MASK_TOKEN
    if kind == "encoder_only":  # A fill-mask pipeline ranks every id: only pieces of text.
      bias = weights["cls.predictions.bias"].copy()
      bias[:UNK] = bias[tok.vocab_size:] = NO_TEXT_BIAS
      weights["cls.predictions.bias"] = bias
    text = tokenizer_json(tok, mask=kind == "encoder_only",
                          prepend_bos=kind in ("decoder_only", "classifier"),
                          append_eos=kind == "encoder_decoder")
  hf_config.update(ids)
  from safetensors.numpy import save_file
  with fs.new_directory(output) as partial:
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / CONFIG).write_text(json.dumps(hf_config, indent=2))
    (partial / "tokenizer.json").write_text(text)
    (partial / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_len,
         **special}, indent=2))
    (partial / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    if kind in ("decoder_only", "encoder_decoder"):  # generate() chooses what ours may.
      if isinstance(tok, HuggingFaceTokenizer):
        never = [ids["bos_token_id"]] if tok.ids[BOS] == NEW else []
      else:
        never = ([PAD, BOS, UNK] if kind == "decoder_only" else []) + list(
            range(tok.vocab_size, cfg.tgt_vocab_size))
      start = {"decoder_start_token_id": BOS} if kind == "encoder_decoder" else {}
      # max_length: without it generate() stops at 20 tokens; the model holds max_len.
      (partial / "generation_config.json").write_text(json.dumps(
          {**ids, **start, "suppress_tokens": never, "do_sample": False,
           "max_length": cfg.max_len}, indent=2))
  logging.info("Exported step %d of %s to %s (%s)", step, workdir, output,
               hf_config["architectures"][0])
