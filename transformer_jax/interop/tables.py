"""One table of parameter names per architecture, that export and import both read (CTranslate2's
layers: export only).

A `Rule` ties parameters of ours (paths in the model's tree, `/`-separated) to one tensor of
another format through a `Transform` and its inverse: export reads the table left to right,
import right to left. A `Table` holds the rules of the model's own parameters and, for each
stack of layers, the rules of one layer, `{i}` standing for its number. What is not a renaming
stays in the format's own code: a vocabulary's ids renumbered, a position table cut to
data.max_len, constant tensors that one side has and the other does not.

Shapes: D model dim, N heads, H head dim (D = N * H); ours are [D, N, H] for a query, key or
value kernel, [N, H, D] for the output's, [N, H] for their biases; an [in, out] kernel is a
torch Linear's [out, in] weight transposed, and GPT-2's Conv1D keeps [in, out].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from transformer_jax.models import build
from transformer_jax.models.common import sinusoidal_positions


@dataclasses.dataclass(frozen=True)
class Transform:
  """theirs = to_theirs(ours, cfg) for a list of our arrays; ours = to_ours(theirs, cfg)."""
  to_theirs: Callable[[list[np.ndarray], object], np.ndarray]
  to_ours: Callable[[np.ndarray, object], list[np.ndarray]]

  def then(self, other: "Transform") -> "Transform":
    """`self`, then `other` on its result (and back in the opposite order)."""
    return Transform(lambda xs, cfg: other.to_theirs([self.to_theirs(xs, cfg)], cfg),
                     lambda y, cfg: self.to_ours(other.to_ours(y, cfg)[0], cfg))


def _root(cfg) -> float:
  return float(np.sqrt(cfg.d_model))


SAME = Transform(lambda xs, cfg: xs[0], lambda y, cfg: [y])
# An [in, out] kernel as torch's Linear keeps it, [out, in].
LINEAR = Transform(lambda xs, cfg: xs[0].T, lambda y, cfg: [y.T])
# Our embeddings are scaled by sqrt(D) on input, GPT-2's and BERT's are not: their token table
# is ours times sqrt(D), and the LayerNorm before the tied projection ours over sqrt(D).
TIMES_ROOT = Transform(lambda xs, cfg: xs[0] * _root(cfg), lambda y, cfg: [y / _root(cfg)])
OVER_ROOT = Transform(lambda xs, cfg: xs[0] / _root(cfg), lambda y, cfg: [y * _root(cfg)])


def _heads(cfg) -> tuple[int, int, int]:
  return cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads


# [D, N, H] <-> [D, D] (in x out); [N, H, D] <-> [D, D]; [N, H] <-> [D].
HEADS_IN = Transform(lambda xs, cfg: xs[0].reshape(cfg.d_model, cfg.d_model),
                     lambda y, cfg: [y.reshape(_heads(cfg))])
HEADS_OUT = Transform(lambda xs, cfg: xs[0].reshape(cfg.d_model, cfg.d_model),
                      lambda y, cfg: [y.reshape(_heads(cfg)[1:] + (cfg.d_model,))])
HEADS_BIAS = Transform(lambda xs, cfg: xs[0].reshape(cfg.d_model),
                       lambda y, cfg: [y.reshape(_heads(cfg)[1:])])


def joined(part: Transform, axis: int, parts: int = 3) -> Transform:
  """`parts` of ours, each through `part`, side by side along `axis` of one tensor of theirs
  (GPT-2's query | key | value; CTranslate2's key | value of cross-attention)."""
  def to_ours(y, cfg):
    return [part.to_ours(x, cfg)[0] for x in np.split(y, parts, axis=axis)]
  return Transform(lambda xs, cfg: np.concatenate([part.to_theirs([x], cfg) for x in xs], axis),
                   to_ours)


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: tuple[str, ...]  # Paths in our parameters; several where `transform` joins them.
  theirs: str
  transform: Transform = SAME


def rule(ours: str | tuple[str, ...], theirs: str, transform: Transform = SAME) -> Rule:
  return Rule((ours,) if isinstance(ours, str) else ours, theirs, transform)


@dataclasses.dataclass(frozen=True)
class Stack:
  """The layers of one stack: ours `{ours}_{i}` (an unscanned model's names), theirs under
  `theirs` with `{i}`, `count` of them as the config's field of that name says."""
  ours: str
  theirs: str
  count: str
  rules: tuple[Rule, ...]


@dataclasses.dataclass(frozen=True)
class Table:
  rules: tuple[Rule, ...]
  stacks: tuple[Stack, ...] = ()

  def all_rules(self, cfg):
    """(our paths, their name, transform) of every tensor, layers numbered."""
    for r in self.rules:
      yield r.ours, r.theirs, r.transform
    for stack in self.stacks:
      for i in range(getattr(cfg, stack.count)):
        for r in stack.rules:
          yield (tuple(f"{stack.ours}_{i}/{p}" for p in r.ours), stack.theirs.format(i=i) + "."
                 + r.theirs, r.transform)


def norm(ours: str, theirs: str, transform: Transform = SAME) -> tuple[Rule, Rule]:
  """A LayerNorm: our scale and bias, their weight and bias."""
  return rule(f"{ours}/scale", f"{theirs}.weight", transform), rule(f"{ours}/bias",
                                                                    f"{theirs}.bias", transform)


def linear(ours: str, theirs: str, transform: Transform = LINEAR) -> tuple[Rule, Rule]:
  """A dense layer: our kernel [in, out] and bias, their weight and bias."""
  return rule(f"{ours}/kernel", f"{theirs}.weight", transform), rule(f"{ours}/bias",
                                                                     f"{theirs}.bias")


def attention(ours: str, theirs: str, names: tuple[str, str, str, str],
              weight: Transform) -> tuple[Rule, ...]:
  """Separate query, key, value and output projections, their `names` in that order, each
  weight through `weight` after our heads are flattened."""
  rules = []
  for kind, name in zip(("query", "key", "value"), names):
    rules += [rule(f"{ours}/{kind}_kernel", f"{theirs}.{name}.weight", HEADS_IN.then(weight)),
              rule(f"{ours}/{kind}_bias", f"{theirs}.{name}.bias", HEADS_BIAS)]
  return (*rules, rule(f"{ours}/out_kernel", f"{theirs}.{names[3]}.weight",
                       HEADS_OUT.then(weight)),
          rule(f"{ours}/out_bias", f"{theirs}.{names[3]}.bias"))


GPT2 = Table(
    rules=(rule("embed/embedding", "transformer.wte.weight", TIMES_ROOT),
           rule("position_embedding", "transformer.wpe.weight"),
           *norm("decoder_norm", "transformer.ln_f", OVER_ROOT)),
    stacks=(Stack("decoder", "transformer.h.{i}", "num_decoder_layers", (
        *norm("self_attention_sublayer/norm", "ln_1"),
        rule(tuple(f"self_attention/{k}_kernel" for k in ("query", "key", "value")),
             "attn.c_attn.weight", joined(HEADS_IN, axis=1)),  # Conv1D: [in, out], q | k | v.
        rule(tuple(f"self_attention/{k}_bias" for k in ("query", "key", "value")),
             "attn.c_attn.bias", joined(HEADS_BIAS, axis=0)),
        rule("self_attention/out_kernel", "attn.c_proj.weight", HEADS_OUT),
        rule("self_attention/out_bias", "attn.c_proj.bias"),
        *norm("ffn_sublayer/norm", "ln_2"),
        *linear("ffn/wi", "mlp.c_fc", SAME), *linear("ffn/wo", "mlp.c_proj", SAME))),))

_BERT_ENCODER = Stack("encoder", "bert.encoder.layer.{i}", "num_encoder_layers", (
    *attention("self_attention", "attention", ("self.query", "self.key", "self.value",
                                               "output.dense"), LINEAR),
    *norm("attention_sublayer/norm", "attention.output.LayerNorm"),
    *linear("ffn/wi", "intermediate.dense"), *linear("ffn/wo", "output.dense"),
    *norm("ffn_sublayer/norm", "output.LayerNorm")))
# BERT's token-type table is not ours: every token is of type 0, whose row the import adds
# into the position table and the export writes as zeros.
_BERT_EMBEDDINGS = (rule("embed/embedding", "bert.embeddings.word_embeddings.weight", TIMES_ROOT),
                    rule("position_embedding", "bert.embeddings.position_embeddings.weight"),
                    *norm("embed_norm", "bert.embeddings.LayerNorm"))
BERT_MASKED_LM = Table(
    rules=(*_BERT_EMBEDDINGS, *linear("mlm_dense", "cls.predictions.transform.dense"),
           *norm("mlm_norm", "cls.predictions.transform.LayerNorm", OVER_ROOT),
           rule("mlm_bias", "cls.predictions.bias")),
    stacks=(_BERT_ENCODER,))
BERT_CLASSIFIER = Table(
    rules=(*_BERT_EMBEDDINGS, *linear("pooler", "bert.pooler.dense"),
           *linear("classifier", "classifier")),
    stacks=(_BERT_ENCODER,))

_MARIAN_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
_MARIAN_FFN = (*linear("ffn/wi", "fc1"), *linear("ffn/wo", "fc2"),
               *norm("ffn_sublayer/norm", "final_layer_norm"))
# One shared table (model.share_embeddings and tie_output), under each of Marian's names.
MARIAN = Table(
    rules=tuple(rule("src_embed/embedding", name) for name in (
        "model.shared.weight", "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight", "lm_head.weight")) + (
        rule("position_embedding", "model.encoder.embed_positions.weight"),
        rule("position_embedding", "model.decoder.embed_positions.weight")),
    stacks=(Stack("encoder", "model.encoder.layers.{i}", "num_encoder_layers", (
        *attention("self_attention", "self_attn", _MARIAN_ATTENTION, LINEAR),
        *norm("attention_sublayer/norm", "self_attn_layer_norm"), *_MARIAN_FFN)),
            Stack("decoder", "model.decoder.layers.{i}", "num_decoder_layers", (
        *attention("self_attention", "self_attn", _MARIAN_ATTENTION, LINEAR),
        *norm("self_attention_sublayer/norm", "self_attn_layer_norm"),
        *attention("cross_attention", "encoder_attn", _MARIAN_ATTENTION, LINEAR),
        *norm("cross_attention_sublayer/norm", "encoder_attn_layer_norm"), *_MARIAN_FFN))))


def _ct2_norm(ours: str, theirs: str) -> tuple[Rule, Rule]:
  return rule(f"{ours}/scale", f"{theirs}.gamma"), rule(f"{ours}/bias", f"{theirs}.beta")


def _ct2_attention(ours: str, theirs: str, groups: tuple[tuple[str, ...], ...]) -> tuple:
  """Our projections as CTranslate2's linears ([out, in] weights): each group of ours (query,
  key, value) fused into one linear, in order, then the output projection."""
  rules = []
  for i, names in enumerate(groups):
    rules += [rule(tuple(f"{ours}/{n}_kernel" for n in names), f"{theirs}.linear.{i}.weight",
                   joined(HEADS_IN.then(LINEAR), axis=0, parts=len(names))),
              rule(tuple(f"{ours}/{n}_bias" for n in names), f"{theirs}.linear.{i}.bias",
                   joined(HEADS_BIAS, axis=0, parts=len(names)))]
  n = len(groups)
  return (*rules, rule(f"{ours}/out_kernel", f"{theirs}.linear.{n}.weight",
                       HEADS_OUT.then(LINEAR)),
          rule(f"{ours}/out_bias", f"{theirs}.linear.{n}.bias"))


_CT2_FFN = (*_ct2_norm("ffn_sublayer/norm", "ffn.layer_norm"),
            *linear("ffn/wi", "ffn.linear_0"), *linear("ffn/wo", "ffn.linear_1"))
_QKV = (("query", "key", "value"),)
# CTranslate2's Transformer spec, named by its attributes (`encoder.layer.0.ffn.linear_0.weight`):
# the layers (the embeddings, positions, output and final norms are no renaming:
# ctranslate2.py writes them).
CTRANSLATE2_LAYERS = Table(rules=(), stacks=(
    Stack("encoder", "encoder.layer.{i}", "num_encoder_layers", (
        *_ct2_attention("self_attention", "self_attention", _QKV),
        *_ct2_norm("attention_sublayer/norm", "self_attention.layer_norm"), *_CT2_FFN)),
    Stack("decoder", "decoder.layer.{i}", "num_decoder_layers", (
        *_ct2_attention("self_attention", "self_attention", _QKV),
        *_ct2_norm("self_attention_sublayer/norm", "self_attention.layer_norm"),
        *_ct2_attention("cross_attention", "attention", (("query",), ("key", "value"))),
        *_ct2_norm("cross_attention_sublayer/norm", "attention.layer_norm"), *_CT2_FFN))))


def complete(cfg, params) -> dict:
  """Our parameters as an unscanned model names them, with what the formats always hold: the
  position table's values (a sinusoid's at 0 .. max_len - 1, where ours are fixed) and zeros
  for the attention biases a model without them (model.attention_bias=False) lacks."""
  out = {name: value for name, value in params.items() if not name.endswith("_stack")}
  for prefix, count in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    for i, layer in enumerate(build.layer_params(params, prefix, count)):
      layer = dict(layer)
      for name in ("self_attention", "cross_attention"):
        if name in layer:
          layer[name] = {**_zero_biases(cfg), **layer[name]}
      out[f"{prefix}_{i}"] = layer
  if cfg.positions != "learned":
    out["position_embedding"] = np.asarray(
        sinusoidal_positions(np.arange(cfg.max_len)[None], cfg.d_model)[0])
  return out


def _zero_biases(cfg) -> dict[str, np.ndarray]:
  heads = (cfg.num_heads, cfg.d_model // cfg.num_heads)
  return {**{f"{kind}_bias": np.zeros(heads, np.float32) for kind in ("query", "key", "value")},
          "out_bias": np.zeros(cfg.d_model, np.float32)}



def _get(tree: dict, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def _put(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[leaf] = value


def to_theirs(table: Table, params: dict, cfg) -> dict[str, np.ndarray]:
  """Their tensors (float32, contiguous) from our parameters, named as an unscanned model
  names them (encoder_0, ...: build.layer_params gives that layout)."""
  out = {}
  for ours, theirs, transform in table.all_rules(cfg):
    values = [np.asarray(_get(params, p), np.float32) for p in ours]
    out[theirs] = np.ascontiguousarray(transform.to_theirs(values, cfg), np.float32)
  return out


def to_ours(table: Table, tensor: Callable[[str], np.ndarray], cfg,
            shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
  """Our parameters (an unscanned model's tree) from their tensors, `tensor(name)` fetching
  one (and raising where it is missing). `shapes`: our parameters' shapes by path, checked as
  each tensor is read; a ValueError names the tensor of theirs that disagrees, and the shape
  this config needs of it."""
  out: dict = {}
  for ours, theirs, transform in table.all_rules(cfg):
    value = tensor(theirs)
    try:
      values = transform.to_ours(value, cfg)
      wrong = shapes is not None and any(tuple(x.shape) != shapes[p]
                                         for p, x in zip(ours, values) if p in shapes)
    except ValueError:  # A reshape or split that its shape does not allow.
      wrong = True
    if wrong and not all(p in shapes for p in ours):
      raise ValueError(f"{theirs} is {list(value.shape)}, which a model of this config cannot "
                       "read")
    if wrong:
      needed = transform.to_theirs([np.zeros(shapes[p], np.float32) for p in ours], cfg).shape
      raise ValueError(f"{theirs} is {list(value.shape)}, and this config needs "
                       f"{list(needed)}")
    for path, x in zip(ours, values):
      _put(out, path, x)
  return out
