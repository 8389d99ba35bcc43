"""A trained workdir's model as a Hugging Face `transformers` model directory.

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
language model).
A run that started from a Hugging Face checkpoint (data.tokenizer='huggingface') goes back in
that checkpoint's ids with its own tokenizer.json (`_in_checkpoint_ids`).

Written with NumPy, safetensors and tokenizers only (pip install 'transformer_jax[huggingface]');
loading the result takes `transformers` (in that extra) and torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from absl import logging

from transformer_jax import fs
from transformer_jax.data.tokenizer import (BOS, EOS, NEW, PAD, UNK, HuggingFaceTokenizer,
                                            SentencePiece)
from transformer_jax.decoding import restore
from transformer_jax.models import build, huggingface
from transformer_jax.models.common import sinusoidal_positions
from transformer_jax.workdir import Workdir

MASK_TOKEN = "[MASK]"
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}  # model.activation's.
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


def _np(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32))


def _norm(p, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
  return _np(p["scale"]) * scale, _np(p["bias"]) * scale


def _position_table(cfg, params) -> np.ndarray:
  """[max_len, D]: the learned table, or the sinusoid's values at positions 0 .. max_len - 1."""
  if cfg.positions == "learned":
    return _np(params["position_embedding"])
  return _np(sinusoidal_positions(np.arange(cfg.max_len)[None], cfg.d_model)[0])


def _attention(p, d: int) -> dict[str, np.ndarray]:
  """Our attention's kernels ([D, N, H] in, [N, H, D] out) and biases as [D, D] matrices
  (in x out) and [D] vectors; zeros where the model has no biases."""
  out = {}
  for name in ("query", "key", "value"):
    out[f"{name}_kernel"] = _np(p[f"{name}_kernel"]).reshape(d, d)
    out[f"{name}_bias"] = (_np(p[f"{name}_bias"]).reshape(d) if f"{name}_bias" in p
                           else np.zeros(d, np.float32))
  out["out_kernel"] = _np(p["out_kernel"]).reshape(d, d)
  out["out_bias"] = _np(p["out_bias"]) if "out_bias" in p else np.zeros(d, np.float32)
  return out


def _gpt2(cfg, params) -> tuple[dict, dict]:
  d, root = cfg.d_model, float(np.sqrt(cfg.d_model))
  w = {"transformer.wte.weight": _np(params["embed"]["embedding"]) * root,
       "transformer.wpe.weight": _position_table(cfg, params)}
  for i, layer in enumerate(build.layer_params(params, "decoder", cfg.num_decoder_layers)):
    a, h = _attention(layer["self_attention"], d), f"transformer.h.{i}"
    w[f"{h}.ln_1.weight"], w[f"{h}.ln_1.bias"] = _norm(layer["self_attention_sublayer"]["norm"])
    w[f"{h}.attn.c_attn.weight"] = np.concatenate(  # Conv1D: [in, out], q | k | v.
        [a["query_kernel"], a["key_kernel"], a["value_kernel"]], axis=1)
    w[f"{h}.attn.c_attn.bias"] = np.concatenate([a["query_bias"], a["key_bias"], a["value_bias"]])
    w[f"{h}.attn.c_proj.weight"], w[f"{h}.attn.c_proj.bias"] = a["out_kernel"], a["out_bias"]
    w[f"{h}.ln_2.weight"], w[f"{h}.ln_2.bias"] = _norm(layer["ffn_sublayer"]["norm"])
    w[f"{h}.mlp.c_fc.weight"] = _np(layer["ffn"]["wi"]["kernel"])
    w[f"{h}.mlp.c_fc.bias"] = _np(layer["ffn"]["wi"]["bias"])
    w[f"{h}.mlp.c_proj.weight"] = _np(layer["ffn"]["wo"]["kernel"])
    w[f"{h}.mlp.c_proj.bias"] = _np(layer["ffn"]["wo"]["bias"])
  w["transformer.ln_f.weight"], w["transformer.ln_f.bias"] = _norm(params["decoder_norm"],
                                                                   1.0 / root)
  config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.tgt_vocab_size, "n_positions": cfg.max_len, "n_embd": d,
            "n_layer": cfg.num_decoder_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_dim,
            "activation_function": ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.layer_norm_eps,
            "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate,
            "attn_pdrop": 0.0, "tie_word_embeddings": True}
  return w, config


def _bert(cfg, params, labels: tuple[str, ...]) -> tuple[dict, dict]:
  d, root = cfg.d_model, float(np.sqrt(cfg.d_model))
  e = "bert.embeddings"
  w = {f"{e}.word_embeddings.weight": _np(params["embed"]["embedding"]) * root,
       f"{e}.position_embeddings.weight": _position_table(cfg, params),
       f"{e}.token_type_embeddings.weight": np.zeros((1, d), np.float32)}
  w[f"{e}.LayerNorm.weight"], w[f"{e}.LayerNorm.bias"] = _norm(params["embed_norm"])
  for i, layer in enumerate(build.layer_params(params, "encoder", cfg.num_encoder_layers)):
    a, h = _attention(layer["self_attention"], d), f"bert.encoder.layer.{i}"
    for name in ("query", "key", "value"):  # torch Linear: [out, in].
      w[f"{h}.attention.self.{name}.weight"] = a[f"{name}_kernel"].T.copy()
      w[f"{h}.attention.self.{name}.bias"] = a[f"{name}_bias"]
    w[f"{h}.attention.output.dense.weight"] = a["out_kernel"].T.copy()
    w[f"{h}.attention.output.dense.bias"] = a["out_bias"]
    (w[f"{h}.attention.output.LayerNorm.weight"],
     w[f"{h}.attention.output.LayerNorm.bias"]) = _norm(layer["attention_sublayer"]["norm"])
    w[f"{h}.intermediate.dense.weight"] = _np(layer["ffn"]["wi"]["kernel"]).T.copy()
    w[f"{h}.intermediate.dense.bias"] = _np(layer["ffn"]["wi"]["bias"])
    w[f"{h}.output.dense.weight"] = _np(layer["ffn"]["wo"]["kernel"]).T.copy()
    w[f"{h}.output.dense.bias"] = _np(layer["ffn"]["wo"]["bias"])
    w[f"{h}.output.LayerNorm.weight"], w[f"{h}.output.LayerNorm.bias"] = _norm(
        layer["ffn_sublayer"]["norm"])
  config = {"model_type": "bert", "vocab_size": cfg.tgt_vocab_size, "hidden_size": d,
            "num_hidden_layers": cfg.num_encoder_layers, "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.ffn_dim, "hidden_act": ACTIVATIONS[cfg.activation],
            "hidden_dropout_prob": cfg.dropout_rate, "attention_probs_dropout_prob": 0.0,
            "max_position_embeddings": cfg.max_len, "type_vocab_size": 1,
            "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": PAD,
            "tie_word_embeddings": True}
  if labels:
    w["bert.pooler.dense.weight"] = _np(params["pooler"]["kernel"]).T.copy()
    w["bert.pooler.dense.bias"] = _np(params["pooler"]["bias"])
    w["classifier.weight"] = _np(params["classifier"]["kernel"]).T.copy()
    w["classifier.bias"] = _np(params["classifier"]["bias"])
    config.update(architectures=["BertForSequenceClassification"],
                  id2label={str(i): name for i, name in enumerate(labels)},
                  label2id={name: i for i, name in enumerate(labels)},
                  classifier_dropout=cfg.dropout_rate)
  else:
    t = "cls.predictions.transform"
    w[f"{t}.dense.weight"] = _np(params["mlm_dense"]["kernel"]).T.copy()
    w[f"{t}.dense.bias"] = _np(params["mlm_dense"]["bias"])
    w[f"{t}.LayerNorm.weight"], w[f"{t}.LayerNorm.bias"] = _norm(params["mlm_norm"], 1.0 / root)
    w["cls.predictions.bias"] = _np(params["mlm_bias"])
    config.update(architectures=["BertForMaskedLM"])
  return w, config


def _linear(w: dict, name: str, kernel: np.ndarray, bias: np.ndarray) -> None:
  """A torch Linear's parameters ([out, in] weight) from an [in, out] kernel."""
  w[f"{name}.weight"], w[f"{name}.bias"] = np.ascontiguousarray(kernel.T), bias


def _bart_attention(w: dict, name: str, p, d: int) -> None:
  a = _attention(p, d)
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"),
                       ("out", "out_proj")):
    _linear(w, f"{name}.{theirs}", a[f"{ours}_kernel"], a[f"{ours}_bias"])


def _marian(cfg, params) -> tuple[dict, dict]:
  """MarianMTModel: the paper's post-LN model with sqrt(D)-scaled embeddings, as ours. Its
  position tables are state, written as ours (sin and cos interleaved)."""
  d = cfg.d_model
  positions = _position_table(cfg, params)
  w = {"model.shared.weight": _np(params["src_embed"]["embedding"]),
       "model.encoder.embed_positions.weight": positions,
       "model.decoder.embed_positions.weight": positions.copy(),
       "final_logits_bias": np.zeros((1, cfg.tgt_vocab_size), np.float32)}
  w["model.encoder.embed_tokens.weight"] = w["model.shared.weight"]
  w["model.decoder.embed_tokens.weight"] = w["model.shared.weight"]
  w["lm_head.weight"] = w["model.shared.weight"]
  stacks = (("encoder", cfg.num_encoder_layers, (("self_attn", "self_attention",
                                                  "attention_sublayer"),)),
            ("decoder", cfg.num_decoder_layers, (("self_attn", "self_attention",
                                                  "self_attention_sublayer"),
                                                 ("encoder_attn", "cross_attention",
                                                  "cross_attention_sublayer"))))
  for stack, count, attentions in stacks:
    for i, layer in enumerate(build.layer_params(params, stack, count)):
      h = f"model.{stack}.layers.{i}"
      for theirs, attention, sublayer in attentions:
        _bart_attention(w, f"{h}.{theirs}", layer[attention], d)
        w[f"{h}.{theirs}_layer_norm.weight"], w[f"{h}.{theirs}_layer_norm.bias"] = _norm(
            layer[sublayer]["norm"])
      _linear(w, f"{h}.fc1", _np(layer["ffn"]["wi"]["kernel"]), _np(layer["ffn"]["wi"]["bias"]))
      _linear(w, f"{h}.fc2", _np(layer["ffn"]["wo"]["kernel"]), _np(layer["ffn"]["wo"]["bias"]))
      w[f"{h}.final_layer_norm.weight"], w[f"{h}.final_layer_norm.bias"] = _norm(
          layer["ffn_sublayer"]["norm"])
  config = {"architectures": ["MarianMTModel"], "model_type": "marian",
            "vocab_size": cfg.tgt_vocab_size, "decoder_vocab_size": cfg.tgt_vocab_size,
            "max_position_embeddings": cfg.max_len, "d_model": d,
            "encoder_layers": cfg.num_encoder_layers, "decoder_layers": cfg.num_decoder_layers,
            "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
            "encoder_ffn_dim": cfg.ffn_dim, "decoder_ffn_dim": cfg.ffn_dim,
            "activation_function": ACTIVATIONS[cfg.activation], "dropout": cfg.dropout_rate,
            "attention_dropout": 0.0, "activation_dropout": 0.0, "scale_embedding": True,
            "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
            "is_encoder_decoder": True, "decoder_start_token_id": BOS,
            "forced_eos_token_id": None}
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
    tok.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
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
VOCABULARY_TABLES = ("transformer.wte.weight", "bert.embeddings.word_embeddings.weight",
                     "cls.predictions.bias")
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
  for name in VOCABULARY_TABLES:
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
  params = jax.device_get(restored.params)
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
    text = tokenizer_json(tok, mask=kind == "encoder_only",
                          prepend_bos=kind in ("decoder_only", "classifier"),
                          append_eos=kind == "encoder_decoder")
  hf_config.update(ids)
  from safetensors.numpy import save_file
  with fs.new_directory(output) as partial:
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / huggingface.CONFIG).write_text(json.dumps(hf_config, indent=2))
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
      (partial / "generation_config.json").write_text(json.dumps(
          {**ids, **start, "suppress_tokens": never, "do_sample": False}, indent=2))
  logging.info("Exported step %d of %s to %s (%s)", step, workdir, output,
               hf_config["architectures"][0])
