"""The training loop: trains a config to its num_steps in a workdir, resuming from the latest
checkpoint there. `python train.py` (or `python -m transformer_jax train`) runs it.
"""

from __future__ import annotations

import collections
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer_jax import (aot, flops as flops_lib, fs, preemption as preemption_lib, sections,
                             sharding, train_lib, writers)
from transformer_jax.bleu_eval import BleuEval
from transformer_jax.data import pipeline
from transformer_jax.model import Transformer
from transformer_jax.workdir import Workdir


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> train_lib.TrainState:
  """Trains to `config.num_steps`, resuming from the latest checkpoint in `workdir`."""
  # Every check that can fail comes before anything is prepared, compiled or written.
  sections.validated(config)
  mesh = sections.checked_mesh(config)
  run_dir = Workdir(workdir)
  run_dir.check_resumable(config)
  workdir = run_dir.path
  fs.check_writable(workdir, "--workdir")
  primary, hosts = jax.process_index() == 0, jax.process_count()

  data_cfg = sections.data_config(config)
  data = pipeline.prepare(
      data_cfg, workdir, num_bleu_sentences=config.num_bleu_sentences, is_first_host=primary,
      wait_for_first_host=lambda: hosts > 1 and multihost_utils.sync_global_devices("data"))
  workdir.mkdir(parents=True, exist_ok=True)
  if primary:  # One writer.
    run_dir.write_config(config)
  jax.config.update("jax_compilation_cache_dir",
                    config.compilation_cache_dir or str(run_dir.jax_cache))
  model = Transformer(sections.model_config(config, data.tokenizers.src.vocab_size,
                                            data.tokenizers.tgt.vocab_size))
  opt_cfg = sections.optimizer_config(config)
  state, state_shardings = train_lib.create_train_state(
      model, train_lib.make_optimizer(opt_cfg), config.seed, mesh, config.max_len,
      ema=config.ema_decay > 0)
  p_train, p_eval = train_lib.jit_steps(state_shardings, mesh, sections.step_config(config))
  if config.compiled_train_step:  # Compiled ahead of time: checked to be this very program.
    p_train = aot.load_train_step(config.compiled_train_step, p_train, state, mesh,
                                  config.batch_size, config.max_len)
    logging.info("Running the train step compiled ahead of time in %s",
                 config.compiled_train_step)
  stream = pipeline.TrainStream(
      data.train, batch_size=config.batch_size, max_len=config.max_len, overlong=config.overlong,
      seed=config.seed, pack=config.packing, num_workers=data_cfg.num_workers,
      process_index=jax.process_index(), process_count=hosts, concat_prob=config.concat_prob,
      concat_max=config.concat_max)
  pipeline.log_selection(config.train_split, stream.selection, config.max_len)
  eval_data = pipeline.eval_batches(
      data.eval, batch_size=config.eval_batch_size, max_len=config.max_len,
      overlong=config.overlong, pack=config.packing, process_index=jax.process_index(),
      process_count=hosts)
  if config.num_eval_batches > 0:
    eval_data = eval_data[:config.num_eval_batches]

  ckpt = run_dir.checkpointer(config.checkpoint_every, config.keep_checkpoints)
  restored = ckpt.restore_latest(state, state_shardings)
  if restored:
    start, state, data_state = restored
    logging.info("Resuming from the checkpoint of step %d in %s", start, ckpt.directory)
    stream.set_state(data_state)
  else:
    start = 0
    logging.info("No checkpoint in %s: starting from scratch", ckpt.directory)

  writer = writers.create(workdir, primary, resume_step=start)
  if start == 0:
    writer.write_hparams(config.to_dict())
  progress = writers.Progress(config.num_steps, start)
  schedule = train_lib.learning_rate_schedule(opt_cfg)
  bleu_eval = data.bleu_pairs and BleuEval(
      model, data.tokenizers, data.bleu_pairs, config.max_len, config.eval_batch_size)
  # Each batch's model FLOPs (this host's rows), counted as it goes to the devices, in order.
  step_flops = collections.deque()
  peak = flops_lib.peak_flops(jax.local_devices()[0].device_kind, config.peak_flops)

  def to_devices(batch):
    step_flops.append(flops_lib.batch_flops(model.cfg, batch))
    return sharding.global_batch(batch, mesh)

  batches = pipeline.Prefetched(stream, to_devices)
  capacity = config.batch_size * config.max_len
  guard = train_lib.NonFiniteGuard(config.nonfinite, config.max_nonfinite_in_row)
  preemption = preemption_lib.Preemption(multi_process=hosts > 1)

  def save(step):
    guard.check()  # Raises before a state with a dropped (non-finite) step in `stop` mode.
    if not train_lib.all_finite((state.params, state.ema_params)):
      raise train_lib.NonFiniteError(f"the parameters at step {step} are not finite: not saved")
    ckpt.save(step, state, batches.state, force=True)

  try:
    with sharding.mesh_context(mesh):
      history = []
      for step in range(start + 1, config.num_steps + 1):
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          state, metrics = p_train(state, next(batches))
          history.append(metrics)  # Device arrays: read only when logged, no sync per step.
          guard.record(step, metrics["nonfinite"])
        if step % config.log_every == 0 or step == config.num_steps:
          guard.check()
          finite = [m for m in history if not float(m["nonfinite"])] or history
          summary = {k: float(np.mean([m[k] for m in finite])) for k in finite[0]
                     if k != "nonfinite"}
          rate = progress.report(step)
          summary.update(tokens_per_sec=summary["tokens"] * len(finite) / rate["seconds"],
                         padding_fraction=1.0 - summary["tokens"] / capacity,
                         learning_rate=float(schedule(step - 1)),
                         skipped_steps=guard.skipped,
                         model_flops_per_sec=sum(step_flops.popleft() for _ in history)
                         / rate["seconds"] / jax.local_device_count())
          if peak:  # Model-FLOPs utilisation of one device.
            summary["mfu"] = summary["model_flops_per_sec"] / peak
          writer.write_scalars(step, {"steps_per_sec": rate["steps_per_sec"],
                                      **{f"train/{k}": v for k, v in summary.items()}})
          history = []
        if step % config.eval_every == 0 or step == config.num_steps:
          eval_start = time.perf_counter()
          result = train_lib.summarize_eval(
              [p_eval(state, sharding.global_batch(b, mesh)) for b in eval_data])
          if bleu_eval:
            result["bleu"], examples = bleu_eval(state.eval_params())
            writer.write_texts(step, {"eval/examples": "\n".join(examples)})
          writer.write_scalars(step, {f"eval/{k}": v for k, v in result.items()})
          progress.exclude(time.perf_counter() - eval_start)  # Throughput excludes evaluation.
        stop = preemption.should_stop(step)
        if step % config.checkpoint_every == 0 or step == config.num_steps or stop:
          save(step)
        if stop:
          ckpt.wait()
          logging.warning("Stopped at step %d by a signal; its checkpoint is saved in %s. "
                          "Run the same command to resume.", step, ckpt.directory)
          break
  finally:  # Also on an error: finish the checkpoint being written, flush the logs.
    stream.close()
    writer.flush()
    ckpt.close()
    preemption.restore()
  return state
