import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, xla_flags
from transformer_jax import sharding


MESHES = {  # (data, fsdp, tensor): the shard shapes of an FFN kernel and an embedding table.
    "8,1,1": ([32, 64], [128, 32]),  # Pure data parallelism: parameters replicated.
    "2,2,2": ([16, 32], [64, 16]),  # embed split over fsdp=2, mlp and vocab over tensor=2.
    "1,8,1": ([4, 64], [128, 4]),  # embed split 8 ways.
    # The embedding gradients without a scatter (each data shard sorts its own tokens: of 4
    # shards in one process, tests/unit/test_embedding.py).
    "2,2,2:sorted": ([16, 32], [64, 16]),
    "2,2,2:onehot": ([16, 32], [64, 16]),
    # Muon's Newton-Schulz on matrices split both ways; schedule-free's state and evaluation
    # point.
    "2,2,2:scatter:muon": ([16, 32], [64, 16]),
    "2,2,2:scatter:schedule_free_adamw": ([16, 32], [64, 16]),
}


@pytest.fixture(scope="module")
def trained_on_meshes():
  """One process with 8 fake devices trains on one device and on each of MESHES."""
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "tests.sharding_check", *MESHES], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_meshes_give_single_device_losses_and_split_parameters(trained_on_meshes, mesh_shape):
  optimizer = (mesh_shape.split(":") + ["", ""])[2] or "adamw"
  single = trained_on_meshes["single"][optimizer]
  mesh = trained_on_meshes["meshes"][mesh_shape]
  np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=2e-5)
  assert single["losses"][-1] < single["losses"][0]
  assert [mesh["wi_shard"], mesh["embed_shard"]] == list(MESHES[mesh_shape])
  assert mesh["wi_copies"] == [mesh["wi_shard"]]  # The optimizer's state is split alike.
  assert single["wi_shard"] == [32, 64]


def test_mesh_shape_resolves_and_rejects():
  assert sharding.mesh_shape((-1, 2, 1), 8) == (4, 2, 1)
  with pytest.raises(ValueError, match="needs 4 devices, found 8"):
    sharding.mesh_shape((2, 2, 1), 8)
  with pytest.raises(ValueError, match="does not divide"):
    sharding.mesh_shape((-1, 3, 1), 8)
