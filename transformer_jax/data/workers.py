"""grain worker processes for a map over indices, in order, with prefetch."""

from __future__ import annotations

import numpy as np


class OrderedMap:
  """An iterator over fn(start), fn(start + 1), ... fn(stop - 1), in that order.

  Computed by `num_workers` grain worker processes (each takes every num_workers-th index;
  grain hands the results back round-robin), or by one background thread when it is 0.
  `close()` stops the workers and frees the shared memory of the results they had made.
  """

  def __init__(self, start: int, stop: int, fn, num_workers: int, buffer: int = 2):
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
    self._iter = iter(ds)

  def __iter__(self):
    return self

  def __next__(self):
    # Copied out of grain's shared memory, which is then freed at once: nothing handed on
    # (a batch's views, an array on a CPU device) keeps it alive until exit.
    return {k: np.array(v) for k, v in next(self._iter).items()}

  def close(self) -> None:
    self._iter.close()
    _wait_for_shared_memory_release()


def _wait_for_shared_memory_release() -> None:
  """grain frees a result's shared memory on a background thread; results dropped as the
  workers stop are freed before this returns (else Python's resource tracker reports them as
  leaked at exit). Its one thread runs requests in order, so an empty request that has run
  means every earlier one has."""
  from grain._src.python.ipc import shared_memory_array
  pool = getattr(shared_memory_array.SharedMemoryArray, "_del_thread_pool", None)
  if pool is not None:
    pool.apply(int)
