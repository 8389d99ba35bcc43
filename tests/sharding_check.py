"""Run by test_sharding.py in a fresh process with 8 fake CPU devices.

Trains the tiny model for a few steps on one device and on each (data, fsdp, tensor) mesh given
("8,1,1" ...; "8,1,1:sorted" with that embedding gradient, model.embed_grad; "2,2,2:scatter:muon"
with that optimizer, optimizer.name, against one device with it) over the same
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


def run(mesh_shape, devices, embed_grad="scatter", optimizer="adamw"):
  config = config_lib.parse(fra_eng.get_config())
  optimizer = dataclasses.replace(
      config.optimizer, warmup_steps=2, name=optimizer,
      schedule="constant" if optimizer == "schedule_free_adamw" else config.optimizer.schedule)
  mesh = sharding.make_mesh(mesh_shape, devices)
  model = Transformer(tiny_model_config(dropout_rate=0.1, embed_grad=embed_grad))
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(optimizer, config.run.num_steps, model), 0, mesh, 12,
      ema=optimizer.name == "schedule_free_adamw")
  p_train, _ = step_lib.jit_steps(shardings, mesh, step_lib.StepConfig())
  losses = []
  with sharding.mesh_context(mesh):
    for batch in batches(4):
      state, metrics = p_train(state, sharding.global_batch(batch, mesh))
      losses.append(float(metrics["loss"]))
  kernel = state.params["encoder_0"]["ffn"]["wi"]["kernel"]  # [embed, mlp]
  # The optimizer's copies of that kernel (moments, momentum, schedule-free's points): split
  # as the kernel is.
  copies = {tuple(x.addressable_shards[0].data.shape)
            for path, x in jax.tree_util.tree_flatten_with_path((state.opt_state,
                                                                 state.ema_params))[0]
            if "['encoder_0']['ffn']['wi']['kernel']" in jax.tree_util.keystr(path)}
  return {"losses": losses, "wi_shard": list(kernel.addressable_shards[0].data.shape),
          "wi_copies": sorted(map(list, copies)),
          "embed_shard": list(state.params["src_embed"]["embedding"]
                              .addressable_shards[0].data.shape)}


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  meshes, single = {}, {}
  for arg in sys.argv[1:]:
    shape, embed_grad, optimizer = (arg.split(":") + ["", ""])[:3]
    meshes[arg] = run(tuple(int(s) for s in shape.split(",")), jax.devices(),
                      embed_grad or "scatter", optimizer or "adamw")
    if (optimizer or "adamw") not in single:
      single[optimizer or "adamw"] = run((1, 1, 1), jax.devices()[:1],
                                         optimizer=optimizer or "adamw")
  print(json.dumps({"single": single, "meshes": meshes}))
