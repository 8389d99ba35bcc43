"""grain worker processes for a map over indices, in order, with prefetch."""

from __future__ import annotations


def ordered_map(start: int, stop: int, fn, num_workers: int, buffer: int = 2):
  """An iterator over fn(start), fn(start + 1), ... fn(stop - 1), in that order.

  Computed by `num_workers` grain worker processes (each takes every num_workers-th index;
  grain hands the results back round-robin), or by one background thread when it is 0.
  """
  import grain
  from absl import flags
  if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; outside absl.app: defaults.
    flags.FLAGS.mark_as_parsed()
  ds = grain.MapDataset.range(start, stop).map(fn)
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0 if num_workers else 1,
                                            prefetch_buffer_size=buffer))
  if num_workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                     per_worker_buffer_size=buffer))
  return iter(ds)
