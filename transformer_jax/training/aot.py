"""Compiles train.py's programs ahead of time for a named TPU topology or GPU target, on a host
that has neither, and reports what they need of each chip.

  python -m transformer_jax aot --config configs/wmt14_base.py --topology v5e:2x4
  python -m transformer_jax aot --config configs/wmt14_big.py --topology h100:8 \\
      --config.run.mesh_shape="(2,4,1)" --json OUT/big_h100.json

The programs are the ones train.py runs, built by the same library calls: the train state's
shapes and shardings (`step_lib.abstract_train_state`), the jitted train and eval steps with
their donation and step config (`step_lib.jit_steps`), and the beam-search decoder of
translate. No device, no data and no tokenizer is needed: the vocabulary is the config's
`vocab_size` (the joint SentencePiece model has exactly that many pieces).

Per program and device it reports arguments, outputs, temporaries and their total against the
chip's memory, with a verdict; the FLOPs XLA counts against the analytic count of
`flops.model_flops`; and the collectives of the compiled program (kind, count, bytes). The exit
status is 0 when every program fits, 3 when one does not, 1 on bad input.

The compilers come from plugins that a TPU or GPU host would have (targets.py). A compiled
train step can be saved and loaded by train.py on the target (`load_train_step`).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import re
import time
from pathlib import Path

from transformer_jax import fs
from transformer_jax.training import hlo as hlo_lib
from transformer_jax.training.targets import (GIB, PROGRAMS, AotError, Target, cudnn_found,
                                              install_command, plugins_dir)

# The labels a classifier's programs are compiled for: the data decides how many a run has, and
# the head's size hardly changes the programs.
AOT_LABELS = 8


def _abstract_batch(rows: int, max_len: int, mesh, documents: bool = False,
                    labelled: bool = False):
  """A batch's shapes: sentence pairs, a language model's documents (`documents`), or a
  classifier's labelled texts (`labelled`)."""
  import jax
  import jax.numpy as jnp
  from transformer_jax import sharding
  from transformer_jax.data.packing import FEATURES, LM_FEATURES
  sh = sharding.batch_sharding(mesh)
  spec = jax.ShapeDtypeStruct((rows, max_len), jnp.int32, sharding=sh)
  batch = {k: spec for k in (LM_FEATURES if documents or labelled else FEATURES)}
  if labelled:
    batch["labels"] = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sh)
  return batch


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
  import jax
  import numpy as np
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
  return total


def _table_shapes(params) -> list[tuple[int, int]]:
  """The per-device shapes of the embedding tables (parameters named `embedding`)."""
  import jax
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if getattr(path[-1], "key", None) == "embedding":
      out.append(tuple(x.sharding.shard_shape(x.shape)))
  return out


def _compiler_options(target: Target) -> dict:
  """XLA options of a compile for `target` on this host. For GPUs: XLA would sort large
  arrays (the sorted embedding gradient's) with CUB, whose scratch size it asks of the CUDA
  runtime, absent here; its own sort kernel compiles without one (what runs is otherwise the
  same program)."""
  return {"xla_gpu_enable_cub_radix_sort": False} if target.platform == "gpu" else {}


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  mem = {f: int(getattr(m, f, 0) or 0) for f in fields}
  # Donated arguments alias outputs: their bytes are counted once.
  mem["total_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
                        - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"])
  return mem


def _xla_flops(compiled) -> float | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  flops = cost.get("flops") if cost else None
  return float(flops) if flops and flops > 0 else None


_OOM = re.compile(r"(Ran out of memory|RESOURCE_EXHAUSTED)")


def compile_report(config, target: Target, programs=PROGRAMS, beam_size: int = 4,
                   progress=print, save_train_step: str | None = None,
                   hlo_dir: str | None = None) -> dict:
  """Compiles `programs` of `config` for `target`; returns the report (JSON-ready).
  `save_train_step`: also write the compiled train step there (see load_train_step);
  `hlo_dir`: write each program's optimized HLO there as PROGRAM.hlo.txt."""
  import jax
  import numpy as np
  from transformer_jax import config as config_lib, sharding
  from transformer_jax.models import build, flops as flops_lib
  from transformer_jax.training import checks, steps as step_lib, tasks
  cfg = checks.validated(config)
  data = cfg.data
  devices = target.devices()
  try:
    mesh = checks.checked_mesh(cfg, devices)
  except config_lib.ConfigError as e:
    raise AotError(f"{target.name} ({len(devices)} devices): {e}") from None
  vocab = data.vocab_size
  task = tasks.of(cfg.model.family, data.dataset)
  labelled, documents = task.corpus is tasks.LABELLED, task.corpus.documents
  model_cfg = build.model_config(cfg.model, vocab, vocab, platform=target.platform,
                                 max_len=data.max_len, num_labels=AOT_LABELS * labelled)
  if model_cfg.attention_impl == "cudnn" and target.platform == "gpu" and not cudnn_found():
    raise AotError(
        f"cuDNN's fused attention (model.attention_impl={cfg.model.attention_impl!r}: "
        f"{model_cfg.dtype} on a GPU) needs cuDNN's library to compile; install it with: "
        f"{install_command('cudnn', plugins_dir())} (or compile XLA's attention: "
        "--config.model.attention_impl=xla)")
  model = build.build_model(model_cfg)
  tx = step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps, model)
  state, state_shardings = step_lib.abstract_train_state(
      model, tx, mesh, data.max_len, ema=cfg.eval_params_kept)
  masking = task.masking(vocab, cfg.step)
  p_train, p_eval = step_lib.jit_steps(state_shardings, mesh, cfg.step, masking)
  n = len(devices)
  report = {
      "target": target.name, "platform": target.platform, "chip": target.chip,
      "num_devices": n, "num_slices": target.num_slices,
      "hbm_bytes_per_device": target.hbm_bytes,
      "mesh": dict(zip(sharding.MESH_AXES, (int(s) for s in mesh.devices.shape))),
      "batch_size": data.batch_size, "max_len": data.max_len,
      "grad_accum_steps": cfg.step.grad_accum_steps, "loss_chunks": cfg.step.loss_chunks,
      "vocab_size": vocab, "num_labels": model_cfg.num_labels, "dtype": model_cfg.dtype,
      "attention_impl": model_cfg.attention_impl,
      "embed_grad": model_cfg.embed_grad, "compiler_options": _compiler_options(target),
      "scan_layers": model_cfg.scan_layers, "remat": model_cfg.remat,
      "params_bytes_per_device": _per_device_bytes(state.params),
      "opt_state_bytes_per_device": _per_device_bytes(state.opt_state),
      "jax": jax.__version__, "programs": {},
  }
  full = lambda rows: np.full(rows, data.max_len)  # Every row one sentence of max_len.

  def lowered(name):
    with sharding.mesh_context(mesh):
      if name == "train":
        return p_train.lower(state, _abstract_batch(data.batch_size, data.max_len, mesh,
                                                    documents, labelled))
      if name == "eval":
        batch = _abstract_batch(cfg.eval.batch_size, data.max_len, mesh, documents, labelled)
        if masking:  # Evaluation reads masks drawn once (the train step draws its own).
          batch.update(masked_inputs=batch["targets"],
                       masked=jax.ShapeDtypeStruct(batch["targets"].shape, np.bool_,
                                                   sharding=batch["targets"].sharding))
        return p_eval.lower(state, batch)
      return _decoder(model, state_shardings.params, mesh, data.max_len, beam_size,
                      target.platform).lower(
          state.params, _abstract_batch(cfg.eval.batch_size, data.max_len, mesh)["inputs"])

  analytic = {"train": flops_lib.model_flops(model_cfg, full(data.batch_size),
                                             full(data.batch_size)),
              "eval": flops_lib.model_flops(model_cfg, full(cfg.eval.batch_size),
                                            full(cfg.eval.batch_size)) / 3.0,
              "decode": None}  # Beam search's count depends on when beams finish.
  if documents and "decode" in programs:  # `decode` is translate's encoder-decoder search.
    programs = [p for p in programs if p != "decode"]
    report["not_compiled"] = {"decode": "translate's decoder (encoder-decoder models only)"}
  for name in programs:
    progress(f"compiling {name} for {target.name} ...")
    start = time.perf_counter()
    entry = {}
    try:
      program = lowered(name)
      compiled = program.compile(compiler_options=_compiler_options(target))
      if name == "train" and save_train_step:
        _save_executable(compiled, program, target, n, save_train_step)
    except Exception as e:  # XLA raises XlaRuntimeError (or ValueError) with the status text.
      text = str(e)
      if not _OOM.search(text):
        raise
      entry.update(fits=False, error=" ".join(text.split())[:500])
    else:
      entry.update(_memory(compiled))
      entry["fits"] = entry["total_bytes"] <= target.hbm_bytes
      entry["xla_flops_per_device"] = _xla_flops(compiled)
      hlo = compiled.as_text()
      entry["collectives"] = hlo_lib.collectives(hlo)
      entry["scatters"] = hlo_lib.scatters(hlo)
      entry["custom_calls"] = hlo_lib.custom_calls(hlo)
      entry["while_loops"] = hlo_lib.while_loops(hlo)
      entry["embedding_scatters"] = hlo_lib.embedding_scatters(entry["scatters"],
                                                       _table_shapes(state.params))
      if name in ("train", "eval"):
        rows = data.batch_size if name == "train" else cfg.eval.batch_size
        layers = tuple({model_cfg.num_encoder_layers, model_cfg.num_decoder_layers} - {0})
        entry["step_shape"] = hlo_lib.step_shape(hlo, hlo_lib.Dims(
            rows // (mesh.shape["data"] * mesh.shape["fsdp"]), data.max_len,
            model_cfg.tgt_vocab_size, layers))
      if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        fs.replace_file(Path(hlo_dir) / f"{name}.hlo.txt", hlo.encode())
    entry["compile_seconds"] = round(time.perf_counter() - start, 1)
    if analytic[name] is not None:
      entry["analytic_flops_per_device"] = analytic[name] / n
      if entry.get("xla_flops_per_device"):
        entry["xla_over_analytic"] = entry["xla_flops_per_device"] / entry[
            "analytic_flops_per_device"]
    report["programs"][name] = entry
  report["fits"] = all(p["fits"] for p in report["programs"].values())
  return report


_FORMAT = 1


def _program_digest(lowered) -> str:
  """What must be equal for a saved executable to stand in for a jitted step: its program."""
  return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _save_executable(compiled, lowered, target: Target, num_devices: int, path: str) -> None:
  """Writes a compiled train step with what load_train_step checks (whole, or not at all)."""
  import jax
  from jax.experimental import serialize_executable
  payload, _, _ = serialize_executable.serialize(compiled)
  blob = {"format": _FORMAT, "jax": jax.__version__, "platform": target.platform,
          "target": target.name, "num_devices": num_devices,
          "program_sha256": _program_digest(lowered), "executable": payload}
  fs.replace_file(path, pickle.dumps(blob))


def load_train_step(path: str | Path, p_train, state, mesh, batch_size: int, max_len: int):
  """The train step compiled ahead of time and saved at `path` (`--save_train_step`), loaded in
  place of `p_train` (step_lib.jit_steps's), which it must equal: the same program (config,
  shardings, mesh, jax) for this host's platform and device count.

  Raises:
    AotError: the file cannot be read, or holds another program or another target's.
  """
  import jax
  from jax.experimental import serialize_executable
  from transformer_jax import sharding
  path = Path(path)
  try:
    blob = pickle.loads(path.read_bytes())
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
      raise ValueError("not a saved train step")
  except (OSError, pickle.UnpicklingError, ValueError, EOFError) as e:
    raise AotError(f"compiled_train_step {path} cannot be read ({e})") from None
  here = (jax.__version__, jax.default_backend(), mesh.size)
  saved = (blob["jax"], blob["platform"], blob["num_devices"])
  if here != saved:
    raise AotError(f"compiled_train_step {path} was compiled for {blob['target']} with jax "
                   f"{blob['jax']} ({blob['num_devices']} {blob['platform']} devices); this run "
                   f"has jax {here[0]} and {here[2]} {here[1]} devices")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  with sharding.mesh_context(mesh):
    lowered = p_train.lower(abstract, _abstract_batch(batch_size, max_len, mesh))
  if _program_digest(lowered) != blob["program_sha256"]:
    raise AotError(f"compiled_train_step {path} holds another program than this run's train "
                   "step (the config, mesh or code differ): compile it again for this config")
  return serialize_executable.deserialize_and_load(blob["executable"], lowered.in_tree,
                                                   lowered.out_tree)


def _decoder(model, param_shardings, mesh, max_len: int, beam_size: int, platform: str):
  """translate's decoder (generation.translate_ids) jitted over `mesh`: source rows split over the
  data-parallel devices, parameters placed as in training, beams' rows copied as on
  `platform` (decoding/platforms.py)."""
  import jax
  from transformer_jax import sharding
  from transformer_jax.decoding import platforms
  from transformer_jax.decoding.generation import translate_ids
  return jax.jit(functools.partial(translate_ids, model, max_len=max_len + 10, beam_size=beam_size,
                                   row_copy=platforms.settings(platform).row_copy),
                 in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.batch_sharding(mesh))


def _size(n: int) -> str:
  return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.2f} MiB"


def format_report(report: dict) -> str:
  """The report as a few lines of text."""
  mesh = "x".join(str(v) for v in report["mesh"].values())
  lines = [f"{report['target']}: {report['num_devices']} x {report['chip']} "
           f"({_size(report['hbm_bytes_per_device'])} each), mesh data x fsdp x tensor = "
           f"{mesh}, batch {report['batch_size']} x {report['max_len']}, {report['dtype']}, "
           f"attention {report['attention_impl']}, embedding gradient {report['embed_grad']}",
           f"  per device: parameters {_size(report['params_bytes_per_device'])}, optimizer "
           f"state {_size(report['opt_state_bytes_per_device'])}"]
  for name, p in report["programs"].items():
    if "error" in p:
      lines.append(f"  {name}: DOES NOT FIT: {p['error'][:300]}")
      continue
    verdict = ("fits" if p["fits"] else
               f"DOES NOT FIT by {_size(p['total_bytes'] - report['hbm_bytes_per_device'])}")
    flops = ""
    if p.get("xla_flops_per_device"):
      flops = f"; XLA {p['xla_flops_per_device'] / 1e9:,.2f} GFLOP/device"
      if p.get("analytic_flops_per_device"):
        flops += (f" vs analytic {p['analytic_flops_per_device'] / 1e9:,.2f} "
                  f"({p['xla_over_analytic']:.3f}x)")
    elif p.get("analytic_flops_per_device"):
      flops = (f"; analytic {p['analytic_flops_per_device'] / 1e9:,.2f} GFLOP/device "
               "(XLA gives no count for this target)")
    coll = ", ".join(f"{k} {v['count']} ({_size(v['bytes'])})"
                     for k, v in sorted(p["collectives"].items())) or "none"
    lines.append(f"  {name}: args {_size(p['argument_size_in_bytes'])} + outputs "
                 f"{_size(p['output_size_in_bytes'])} - aliased {_size(p['alias_size_in_bytes'])}"
                 f" + temps {_size(p['temp_size_in_bytes'])} = {_size(p['total_bytes'])}: "
                 f"{verdict}{flops}; collectives: {coll}; scatters into an embedding table: "
                 f"{p['embedding_scatters']}; compiled in {p['compile_seconds']} s")
    if "step_shape" in p:
      lines.extend(hlo_lib.format_shape(p["step_shape"]))
  for name, why in report.get("not_compiled", {}).items():
    lines.append(f"  {name}: not compiled: {why}")
  return "\n".join(lines)
