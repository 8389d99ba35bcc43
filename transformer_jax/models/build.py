"""From the model section of a checked config and the tokenizers' vocabularies to the module of
its family: the frozen model config (padded vocabularies, the platform's attention and embedding
gradient) and the model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from transformer_jax import config as config_lib
from transformer_jax.models import embedding
from transformer_jax.models.attention import attention_impl
from transformer_jax.models.common import TransformerConfig
from transformer_jax.models.transformer import (LanguageModel, MaskedLanguageModel,
                                                SequenceClassifier, Transformer)


def padded_vocab(size: int, multiple: int = 128) -> int:
  """Vocabulary rounded up so that it splits evenly over tensor-parallel devices."""
  return -(-size // multiple) * multiple


def model_config(model: config_lib.ModelConfig, src_vocab: int, tgt_vocab: int,
                 platform: str | None = None, max_len: int = 0,
                 num_labels: int = 0) -> TransformerConfig:
  """The frozen model config of the model section and the tokenizers' vocabularies (padded);
  `platform`: the one the program is compiled for (picks `auto`'s attention_impl and
  embed_grad); `max_len`: data.max_len (the rows of learned positions); `num_labels`: an
  encoder-only classifier's labels (0: a masked language model)."""
  fields = dataclasses.asdict(model)
  fields["embed_grad"] = embedding.grad_impl(model.embed_grad, platform)
  # Pallas kernels run natively on TPUs only.
  fields["interpret_kernels"] = (platform or jax.default_backend()) != "tpu"
  fields["attention_impl"] = attention_impl(model.attention_impl, model.dtype,
                                            model.d_model // model.num_heads, platform)
  if model.family == "encoder_only":  # The mask id follows the tokenizer's pieces.
    src_vocab = tgt_vocab = mask_id(tgt_vocab) + 1
  return TransformerConfig(src_vocab_size=padded_vocab(src_vocab),
                           tgt_vocab_size=padded_vocab(tgt_vocab), max_len=max_len,
                           num_labels=num_labels, **fields)


def mask_id(vocab_size: int) -> int:
  """The id an encoder-only model reads in place of a masked token: the first after the
  tokenizer's `vocab_size` pieces (no piece of the text can spell it)."""
  return vocab_size


def build_model(cfg: TransformerConfig):
  """The module of the config's family (an encoder-only model with labels: the classifier)."""
  if cfg.family == "encoder_only" and cfg.num_labels:
    return SequenceClassifier(cfg)
  return {"decoder_only": LanguageModel, "encoder_only": MaskedLanguageModel}.get(
      cfg.family, Transformer)(cfg)


def abstract_params(model: Transformer | LanguageModel):
  """The model's parameters as shapes and dtypes, still boxed with their logical axis names
  (the checkpointer turns those into shardings); nothing runs."""
  dummy = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  inputs = (dummy, dummy) if model.cfg.family == "encoder_decoder" else (dummy,)
  # The key is made inside, so that nothing here runs (each op run eagerly is a program to
  # compile or load).
  return jax.eval_shape(lambda *x: model.init(jax.random.PRNGKey(0), *x), *inputs)["params"]


def layer_params(params, prefix: str, count: int) -> list[dict]:
  """Each layer's parameters, as unscanned models name them (encoder_0, ...), from either stack
  (a scanned one holds [layers, ...] arrays): what exports read layer by layer."""
  if f"{prefix}_stack" in params:
    stacked = params[f"{prefix}_stack"]["layers"]["block"]
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)]
  return [params[f"{prefix}_{i}"] for i in range(count)]


def scanned_like(params: dict, template) -> dict:
  """`params` named as an unscanned model's (encoder_0, ...), in `template`'s layout: where it
  holds a scanned stack, the layers stacked into its [layers, ...] arrays (`layer_params`
  backwards)."""
  params = dict(params)
  for prefix in ("encoder", "decoder"):
    if f"{prefix}_stack" in template:
      count = sum(1 for name in params if name.startswith(f"{prefix}_") and name[-1].isdigit())
      layers = [params.pop(f"{prefix}_{i}") for i in range(count)]
      params[f"{prefix}_stack"] = {"layers": {"block": jax.tree.map(
          lambda *x: jnp.stack(x), *layers)}}
  return params
