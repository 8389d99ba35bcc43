"""Run by test_sharding.py in a fresh process with 8 fake CPU devices.

Trains the tiny model for a few steps on one device and on each (data, fsdp, tensor) mesh given
("8,1,1" ...; "8,1,1:sorted" with that embedding gradient, model.embed_grad) over the same
batches and prints the losses and how the parameters were split,
as JSON.
"""

import dataclasses
import json
import sys

import jax
import numpy as np

from tests.conftest import tiny_model_config
from transformer_jax import config as config_lib, sharding
from transformer_jax.training import steps as step_lib
from transformer_jax.models.transformer import Transformer
from configs import fra_eng


def batches(n, rows=16, length=12, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    lengths = rng.integers(3, length + 1, size=(rows, 2))
    pos = np.arange(length)[None]
    src_seg = (pos < lengths[:, :1]).astype(np.int32)
    tgt_seg = (pos < lengths[:, 1:]).astype(np.int32)
    tokens = lambda seg: (rng.integers(4, 128, size=(rows, length)) * seg).astype(np.int32)
    targets = tokens(tgt_seg)
    yield {"inputs": tokens(src_seg), "inputs_segment_ids": src_seg,
           "inputs_positions": pos.repeat(rows, 0) * src_seg,
           "decoder_inputs": np.concatenate([np.ones((rows, 1), np.int32), targets[:, :-1]], 1)
           * tgt_seg, "targets": targets, "targets_segment_ids": tgt_seg,
           "targets_positions": pos.repeat(rows, 0) * tgt_seg}


def run(mesh_shape, devices, embed_grad="scatter"):
  config = config_lib.parse(fra_eng.get_config())
  optimizer = dataclasses.replace(config.optimizer, warmup_steps=2)
  mesh = sharding.make_mesh(mesh_shape, devices)
  model = Transformer(tiny_model_config(dropout_rate=0.1, embed_grad=embed_grad))
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(optimizer, config.run.num_steps), 0, mesh, 12)
  p_train, _ = step_lib.jit_steps(shardings, mesh, step_lib.StepConfig())
  losses = []
  with sharding.mesh_context(mesh):
    for batch in batches(4):
      state, metrics = p_train(state, sharding.global_batch(batch, mesh))
      losses.append(float(metrics["loss"]))
  kernel = state.params["encoder_0"]["ffn"]["wi"]["kernel"]  # [embed, mlp]
  return {"losses": losses, "wi_shard": list(kernel.addressable_shards[0].data.shape),
          "embed_shard": list(state.params["src_embed"]["embedding"]
                              .addressable_shards[0].data.shape)}


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  meshes = {}
  for arg in sys.argv[1:]:
    shape, _, embed_grad = arg.partition(":")
    meshes[arg] = run(tuple(int(s) for s in shape.split(",")), jax.devices(),
                      embed_grad or "scatter")
  print(json.dumps({"single": run((1, 1, 1), jax.devices()[:1]), "meshes": meshes}))
