"""A local Hugging Face checkpoint of GPT-2 or BERT read as this project's model: what
`run.init_from` takes when it names one (training/finetune.py), with no network and no torch.

  GPT2LMHeadModel  -> decoder_only: pre-LN blocks, learned positions, a final LayerNorm and an
                      output tied to the token table.
  BertForMaskedLM  -> encoder_only: post-LN blocks, learned positions, BERT's LayerNorm after the
                      embeddings (model.embed_norm), the masked-LM head and its output bias.

The export's mapping (serving/huggingface.py) read backwards. Our embeddings are scaled by
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

import numpy as np

from transformer_jax.data.tokenizer import HuggingFaceTokenizer, Tokenizers
from transformer_jax.errors import UserError

ARCHITECTURES = {"GPT2LMHeadModel": "decoder_only", "BertForMaskedLM": "encoder_only"}
# Their activation names -> model.activation (gelu_new is GELU's tanh approximation).
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
CONFIG = "config.json"  # The format's own, not a workdir's.


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
    """Every saved tensor as float32 NumPy, by its name without the model prefix
    ("transformer."; BERT's old LayerNorm gamma/beta read as weight/bias)."""
    from safetensors.numpy import load_file
    files = ([self.path / WEIGHTS] if (self.path / WEIGHTS).is_file() else
             [self.path / f for f in sorted(set(json.loads((self.path / INDEX).read_text())
                                                ["weight_map"].values()))])
    out = {}
    for file in files:
      for name, value in load_file(str(file)).items():
        name = name.removeprefix("transformer.")
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias")
        out[name] = value.astype(np.float32)
    return out

  def params(self, cfg, tokenizer: HuggingFaceTokenizer) -> dict[str, object]:
    """Our model's parameters (NumPy, unscanned names: decoder_0, ...) holding the checkpoint's
    weights, for the frozen model config `cfg` (padded vocabulary, max_len) and the tokenizer
    made from this checkpoint. Raises CheckpointError where a tensor is missing or of another
    shape than the config says."""
    t = _Tensors(self.tensors(), self.path)
    if self.family == "decoder_only":
      return _gpt2(t, cfg, tokenizer)
    return _bert(t, cfg, tokenizer)


class _Tensors:
  """The checkpoint's tensors, fetched by name with a shape check."""

  def __init__(self, tensors: dict[str, np.ndarray], path: Path):
    self.tensors, self.path = tensors, path

  def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.tensors:
      raise CheckpointError(f"{self.path} has no tensor {name!r}")
    value = self.tensors[name]
    if value.shape != tuple(shape):
      raise CheckpointError(f"{self.path}: {name} is {list(value.shape)}, and this config "
                            f"needs {list(shape)}")
    return value

  def rows(self, name: str, width: int) -> np.ndarray:
    """A table of `width` columns and any number of rows (a vocabulary's, positions')."""
    rows = self.tensors[name].shape[0] if name in self.tensors else 0
    return self(name, (rows, width))


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


def _heads(kernel: np.ndarray, cfg) -> np.ndarray:
  """[D, D] (in x out) -> [D, N, H]."""
  return kernel.reshape(cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)


def _norm(weight: np.ndarray, bias: np.ndarray, scale: float = 1.0) -> dict:
  return {"scale": weight * scale, "bias": bias * scale}


def _attention(q, k, v, o, biases, cfg) -> dict:
  """Our attention's parameters from [D, D] in x out kernels (q, k, v, o) and [D] biases."""
  n, h = cfg.num_heads, cfg.d_model // cfg.num_heads
  out = {f"{name}_kernel": _heads(w, cfg) for name, w in (("query", q), ("key", k),
                                                          ("value", v))}
  out.update({f"{name}_bias": b.reshape(n, h) for name, b in zip(("query", "key", "value"),
                                                                  biases[:3])})
  out["out_kernel"] = o.reshape(n, h, cfg.d_model)
  out["out_bias"] = biases[3]
  return out


def _check_vocabulary(vocab: int, tokenizer: HuggingFaceTokenizer, path: Path) -> None:
  largest = max(max(tokenizer.ids), tokenizer.mask or 0)
  if largest >= vocab:
    raise CheckpointError(f"{path}: its tokenizer has id {largest}, past the {vocab} rows of "
                          "its token table")


def _gpt2(t: _Tensors, cfg, tokenizer: HuggingFaceTokenizer) -> dict:
  d, f, root = cfg.d_model, cfg.ffn_dim, float(np.sqrt(cfg.d_model))
  wte = t.rows("wte.weight", d)
  _check_vocabulary(len(wte), tokenizer, t.path)
  params = {"embed": {"embedding": _token_table(wte, tokenizer, cfg.tgt_vocab_size) / root},
            "position_embedding": t.rows("wpe.weight", d)[:cfg.max_len]}
  for i in range(cfg.num_decoder_layers):
    h = f"h.{i}"
    qkv, qkv_bias = t(f"{h}.attn.c_attn.weight", (d, 3 * d)), t(f"{h}.attn.c_attn.bias", (3 * d,))
    params[f"decoder_{i}"] = {
        "self_attention_sublayer": {"norm": _norm(t(f"{h}.ln_1.weight", (d,)),
                                                  t(f"{h}.ln_1.bias", (d,)))},
        "self_attention": _attention(  # Conv1D: [in, out], q | k | v.
            *np.split(qkv, 3, axis=1), t(f"{h}.attn.c_proj.weight", (d, d)),
            [*np.split(qkv_bias, 3), t(f"{h}.attn.c_proj.bias", (d,))], cfg),
        "ffn_sublayer": {"norm": _norm(t(f"{h}.ln_2.weight", (d,)), t(f"{h}.ln_2.bias", (d,)))},
        "ffn": {"wi": {"kernel": t(f"{h}.mlp.c_fc.weight", (d, f)),
                       "bias": t(f"{h}.mlp.c_fc.bias", (f,))},
                "wo": {"kernel": t(f"{h}.mlp.c_proj.weight", (f, d)),
                       "bias": t(f"{h}.mlp.c_proj.bias", (d,))}}}
  params["decoder_norm"] = _norm(t("ln_f.weight", (d,)), t("ln_f.bias", (d,)), root)
  return params


def _bert(t: _Tensors, cfg, tokenizer: HuggingFaceTokenizer) -> dict:
  d, f, root = cfg.d_model, cfg.ffn_dim, float(np.sqrt(cfg.d_model))
  e = "bert.embeddings"
  table = t.rows(f"{e}.word_embeddings.weight", d)
  _check_vocabulary(len(table), tokenizer, t.path)
  types = t.rows(f"{e}.token_type_embeddings.weight", d)  # Every token here is of type 0.
  params = {"embed": {"embedding": _token_table(table, tokenizer, cfg.src_vocab_size) / root},
            "position_embedding": t.rows(f"{e}.position_embeddings.weight", d)[:cfg.max_len]
                                  + types[0],
            "embed_norm": _norm(t(f"{e}.LayerNorm.weight", (d,)), t(f"{e}.LayerNorm.bias", (d,)))}
  linear = lambda name, i, o: (t(f"{name}.weight", (o, i)).T, t(f"{name}.bias", (o,)))
  for i in range(cfg.num_encoder_layers):
    h = f"bert.encoder.layer.{i}"
    (q, qb), (k, kb), (v, vb) = (linear(f"{h}.attention.self.{n}", d, d)
                                 for n in ("query", "key", "value"))
    o, ob = linear(f"{h}.attention.output.dense", d, d)
    wi, wib = linear(f"{h}.intermediate.dense", d, f)
    wo, wob = linear(f"{h}.output.dense", f, d)
    params[f"encoder_{i}"] = {
        "self_attention": _attention(q, k, v, o, [qb, kb, vb, ob], cfg),
        "attention_sublayer": {"norm": _norm(t(f"{h}.attention.output.LayerNorm.weight", (d,)),
                                             t(f"{h}.attention.output.LayerNorm.bias", (d,)))},
        "ffn": {"wi": {"kernel": wi, "bias": wib}, "wo": {"kernel": wo, "bias": wob}},
        "ffn_sublayer": {"norm": _norm(t(f"{h}.output.LayerNorm.weight", (d,)),
                                       t(f"{h}.output.LayerNorm.bias", (d,)))}}
  p = "cls.predictions"
  dense, dense_bias = linear(f"{p}.transform.dense", d, d)
  bias = next((n for n in (f"{p}.decoder.bias", f"{p}.bias") if n in t.tensors), f"{p}.bias")
  params.update(
      mlm_dense={"kernel": dense, "bias": dense_bias},
      mlm_norm=_norm(t(f"{p}.transform.LayerNorm.weight", (d,)),
                     t(f"{p}.transform.LayerNorm.bias", (d,)), root),
      mlm_bias=_token_table(t(bias, (len(table),))[:, None], tokenizer,
                            cfg.src_vocab_size)[:, 0])
  return params
