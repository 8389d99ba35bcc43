"""The training loop: trains a config to its num_steps in a workdir, resuming from the latest
checkpoint there. `python train.py` (or `python -m transformer_jax train`) runs it.
"""

from __future__ import annotations

import collections
import contextlib
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer_jax import config as config_lib, errors, fs, sharding
from transformer_jax.models import build, flops as flops_lib
from transformer_jax.training import (aot, checks, finetune, goodput, preemption as preemption_lib,
                                      resume, steps as step_lib, tasks, writers)
from transformer_jax.training.bleu_eval import BleuEval
from transformer_jax.data import documents, pipeline
from transformer_jax.runs.workdir import Workdir


def train_and_evaluate(config: ml_collections.ConfigDict | config_lib.Config,
                       workdir: str, started: float | None = None) -> step_lib.TrainState:
  """Trains to `run.num_steps`, resuming from the latest checkpoint in `workdir`. `started`:
  when this life of the run began, for its goodput ledger (train.py: the process's start;
  default: now)."""
  ledger = goodput.Ledger(time.time() if started is None else started)
  # Every check that can fail comes before anything is prepared, compiled or written.
  cfg = checks.validated(config)
  checks.check_paths(cfg)
  mesh = checks.checked_mesh(cfg)
  run_dir = Workdir(workdir)
  primary = jax.process_index() == 0
  if primary:  # The first host holds the writer lock for every host of the run.
    run_dir.check_free()
  resume.check_resumable(run_dir, cfg)
  fs.check_writable(run_dir.path, "--workdir")
  # One run writes a workdir at a time (the first host holds the lock for them all).
  with run_dir.writer_lock() if primary else contextlib.nullcontext():
    return _train(cfg, mesh, run_dir, ledger)


def _train(cfg: config_lib.Config, mesh, run_dir: Workdir,
           ledger: goodput.Ledger) -> step_lib.TrainState:
  """train_and_evaluate's run, its config and workdir checked."""
  data_cfg, run, ev = cfg.data, cfg.run, cfg.eval
  task = tasks.of(cfg.model.family, data_cfg.dataset)
  workdir = run_dir.path
  # Fine-tuning reads the other run only while this one has no checkpoint of its own.
  source = (finetune.check_source(cfg, run.init_from)
            if run.init_from and not run_dir.checkpoint_steps() else None)
  primary, hosts = jax.process_index() == 0, jax.process_count()

  data = task.prepare(
      cfg, workdir, trained_labels=run_dir.labels(), is_first_host=primary,
      tokenizer_from=source,
      wait_for_first_host=lambda: hosts > 1 and multihost_utils.sync_global_devices("data"))
  if primary and data.label_names:  # A classifier's, in the order of its outputs.
    run_dir.write_labels(data.label_names)
  # A Ctrl-C that library code swallowed (one raised in a __del__ is only printed) still stops.
  errors.raise_if_interrupted()
  workdir.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir",
                    run.compilation_cache_dir or str(run_dir.jax_cache))
  model = build.build_model(build.model_config(
      cfg.model, data.tokenizers.src.vocab_size, data.tokenizers.tgt.vocab_size,
      max_len=data_cfg.max_len, num_labels=len(data.label_names)))
  state, state_shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg.optimizer, run.num_steps, model), run.seed, mesh,
      data_cfg.max_len, ema=cfg.eval_params_kept)
  masking = task.masking(data.tokenizers.tgt.vocab_size, cfg.step, data.tokenizers.tgt)
  p_train, p_eval = step_lib.jit_steps(state_shardings, mesh, cfg.step, masking)
  if run.compiled_train_step:  # Compiled ahead of time: checked to be this very program.
    p_train = aot.load_train_step(run.compiled_train_step, p_train, state, mesh,
                                  data_cfg.batch_size, data_cfg.max_len)
    logging.info("Running the train step compiled ahead of time in %s", run.compiled_train_step)
  stream = task.stream(cfg, data, pipeline.resolve_workers(data_cfg.num_workers),
                       jax.process_index(), hosts)
  eval_data, fixed = task.held_out(cfg, data, stream, jax.process_index(), hosts)
  if ev.num_batches > 0:
    eval_data = eval_data[:ev.num_batches]
  if masking:  # The same masks at every evaluation.
    eval_data = step_lib.masked_once(eval_data, masking, run.seed)
  per_char = task.per_character and _per_character(data, eval_data, hosts)

  ckpt = run_dir.checkpointer(run.checkpoint_every, run.keep_checkpoints)
  ledger.enter("restore")
  restored = ckpt.restore_latest(state, state_shardings)
  ledger.enter("startup")
  if restored:
    start, state, data_state = restored
    logging.info("Resuming from the checkpoint of step %d in %s%s", start, ckpt.directory,
                 f" (run.init_from={run.init_from!r} is not read again)" if run.init_from else "")
    stream.set_state(data_state)
  elif source:
    start = 0
    state = finetune.start_from(state, source, model, mesh, state_shardings)
  else:
    start = 0
    logging.info("No checkpoint in %s: starting from scratch", ckpt.directory)
  if primary:  # One writer; only once the checkpoints are known to be this run's.
    run_dir.write_config(cfg)
    ledger.open(workdir, start)  # Before the metrics lose the steps a killed life logged.

  writer = writers.create(workdir, primary, resume_step=start)
  if start == 0:
    writer.write_hparams({f"{name}.{k}": v for name, fields in cfg.to_dict().items()
                           for k, v in fields.items()})
  progress = writers.Progress(run.num_steps, start, ev.every)
  schedule = step_lib.learning_rate_schedule(cfg.optimizer, run.num_steps)
  bleu_eval = data.bleu_pairs and BleuEval(
      model, data.tokenizers, data.bleu_pairs, data_cfg.max_len, ev.batch_size)
  # Each batch's model FLOPs (this host's rows), counted as it goes to the devices, in order.
  step_flops = collections.deque()
  peak = flops_lib.peak_flops(jax.local_devices()[0].device_kind, run.peak_flops)

  def to_devices(batch):
    step_flops.append(flops_lib.batch_flops(model.cfg, batch))
    return sharding.global_batch(batch, mesh)

  batches = pipeline.Prefetched(stream, to_devices)
  capacity = data_cfg.batch_size * data_cfg.max_len
  guard = step_lib.NonFiniteGuard(run.nonfinite, run.max_nonfinite_in_row)
  errors.raise_if_interrupted()  # From here on a signal stops the loop with a checkpoint.
  preemption = preemption_lib.Preemption(multi_process=hosts > 1)

  def save(step):
    guard.check()  # Raises before a state with a dropped (non-finite) step in `stop` mode.
    if not step_lib.all_finite((state.params, state.ema_params)):
      raise step_lib.NonFiniteError(f"the parameters at step {step} are not finite: not saved")
    ckpt.save(step, state, batches.state, force=True)

  try:
    with sharding.mesh_context(mesh):
      history = []
      for step in range(start + 1, run.num_steps + 1):
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          batch = next(batches)
          ledger.enter_step(step)
          state, metrics = p_train(state, batch)
          history.append(metrics)  # Device arrays: read only when logged, no sync per step.
          guard.record(step, metrics["nonfinite"])
        if step % run.log_every == 0 or step == run.num_steps:
          guard.check()
          finite = [m for m in history if not float(m["nonfinite"])] or history
          summary = {k: float(np.mean([m[k] for m in finite])) for k in finite[0]
                     if k != "nonfinite"}
          rate = progress.report(step, ledger.goodput())
          summary.update(tokens_per_sec=summary["tokens"] * len(finite) / rate["seconds"],
                         padding_fraction=1.0 - summary["tokens"] / capacity,
                         learning_rate=float(schedule(step - 1)),
                         skipped_steps=guard.skipped,
                         model_flops_per_sec=sum(step_flops.popleft() for _ in history)
                         / rate["seconds"] / jax.local_device_count())
          if peak:  # Model-FLOPs utilisation of one device.
            summary["mfu"] = summary["model_flops_per_sec"] / peak
          writer.write_scalars(step, {"steps_per_sec": rate["steps_per_sec"],
                                      "train/goodput": ledger.goodput(),
                                      **{f"train/{k}": v for k, v in summary.items()}})
          history = []
        if step % ev.every == 0 or step == run.num_steps:
          ledger.enter("eval")
          eval_start = time.perf_counter()
          result = step_lib.summarize_eval(
              [p_eval(state, sharding.global_batch(b, mesh)) for b in eval_data], per_char)
          if not task.corpus.perplexity:
            result.pop("perplexity")
          result.update(fixed)
          if bleu_eval:
            result["bleu"], examples = bleu_eval(state.eval_params())
            writer.write_texts(step, {"eval/examples": "\n".join(examples)})
          writer.write_scalars(step, {f"eval/{k}": v for k, v in result.items()})
          progress.exclude(time.perf_counter() - eval_start)  # Throughput excludes evaluation.
        stop = preemption.should_stop(step)
        if step % run.checkpoint_every == 0 or step == run.num_steps or stop:
          ledger.enter("save")
          save(step)
        ledger.finished(step)
        if stop:
          ckpt.wait()
          logging.warning("Stopped at step %d by a signal; its checkpoint is saved in %s. "
                          "Run the same command to resume.", step, ckpt.directory)
          break
  finally:  # Also on an error: finish the checkpoint being written, flush the logs.
    ledger.enter("other")
    stream.close()
    writer.flush()
    ledger.enter("save")
    ckpt.close()  # Waits for the last checkpoint.
    ledger.enter("other")
    preemption.restore()
    ledger.close()
  return state


def _per_character(data: pipeline.Prepared, eval_data: list, hosts: int) -> dict[str, float]:
  """What a language model's evaluation divides by: the characters its eval batches stand for
  (all hosts' rows), and the bits a unigram model of the training tokens spends on them."""
  chars = documents.characters(eval_data, data.tokenizers.tgt)
  bits = documents.unigram_bits(data.train, eval_data, data.tokenizers.tgt.vocab_size)
  if hosts > 1:
    chars, bits = (float(np.sum(multihost_utils.process_allgather(np.float64(x))))
                   for x in (chars, bits))
  logging.info("Evaluation: %d characters of held-out documents; a unigram model of the "
               "training tokens spends %.3f bits a character on them", chars, bits / chars)
  return {"characters": chars, "unigram_bits": bits}
