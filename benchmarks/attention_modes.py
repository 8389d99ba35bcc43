"""Causal self-attention, forward plus backward, three ways (needs an NVIDIA GPU for cuDNN):

  python benchmarks/attention_modes.py [--batch 96 --length 256 --heads 8 --head_dim 64]

- cuDNN with the boolean mask, which jax hands to cuDNN as a bias (what the model does, since
  packed rows need a per-segment mask);
- cuDNN with `is_causal=True` and no mask (cuDNN's own causal mode; fits unpacked rows only);
- XLA's attention with the mask.
Prints the largest gradient difference against XLA's and the median time of 30 round-robin calls.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=96)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=30)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("error: cuDNN attention needs an NVIDIA GPU; this machine has none")
  b, t, n, h = args.batch, args.length, args.heads, args.head_dim
  q, k, v, cotangent = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16)
                        for key in jax.random.split(jax.random.key(0), 4))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, 1, t, t))
  modes = {
      "cudnn, mask as bias": dict(mask=mask, implementation="cudnn"),
      "cudnn, is_causal": dict(is_causal=True, implementation="cudnn"),
      "xla, mask": dict(mask=mask, implementation="xla"),
  }

  def grad_fn(kwargs):
    def loss(q, k, v):  # [B, T, N, H] -> a scalar whose gradient is the attention's backward.
      out = jax.nn.dot_product_attention(q, k, v, **kwargs)
      return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

  fns = {name: grad_fn(kwargs) for name, kwargs in modes.items()}
  grads = {name: fn(q, k, v)[1] for name, fn in fns.items()}
  times = {name: [] for name in fns}
  for _ in range(args.rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times[name].append(time.perf_counter() - start)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; [{b}, {t}, {n}, {h}] bf16")
  for name in fns:
    diff = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(grads[name], grads["xla, mask"]))
    print(f"{name:22s} fwd+bwd median {np.median(times[name]) * 1e3:7.3f} ms, "
          f"largest gradient difference from XLA's {diff:.4f}")


if __name__ == "__main__":
  main()
