import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax import sharding


def _check(mesh_shape):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "tests.sharding_check", mesh_shape], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh_shape,wi_shard,embed_shard", [
    ("8,1,1", [32, 64], [128, 32]),  # Pure data parallelism: parameters replicated.
    ("2,2,2", [16, 32], [64, 16]),  # embed split over fsdp=2, mlp and vocab over tensor=2.
    ("1,8,1", [4, 64], [128, 4]),  # embed split 8 ways.
])
def test_meshes_give_single_device_losses_and_split_parameters(mesh_shape, wi_shard, embed_shard):
  result = _check(mesh_shape)
  np.testing.assert_allclose(result["mesh"]["losses"], result["single"]["losses"], rtol=2e-5)
  assert result["single"]["losses"][-1] < result["single"]["losses"][0]
  assert result["mesh"]["wi_shard"] == wi_shard
  assert result["mesh"]["embed_shard"] == embed_shard
  assert result["single"]["wi_shard"] == [32, 64]


def test_mesh_shape_resolves_and_rejects():
  assert sharding.mesh_shape((-1, 2, 1), 8) == (4, 2, 1)
  with pytest.raises(ValueError, match="needs 4 devices, found 8"):
    sharding.mesh_shape((2, 2, 1), 8)
  with pytest.raises(ValueError, match="does not divide"):
    sharding.mesh_shape((-1, 3, 1), 8)
