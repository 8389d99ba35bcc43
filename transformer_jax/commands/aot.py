"""Compiles the training programs for a TPU topology or GPU target on a host without one.

  python -m transformer_jax aot --config configs/wmt14_base.py --topology v5e:2x4
  python -m transformer_jax aot --install_plugins
  python -m transformer_jax aot --install_cudnn   # cuDNN attention for GPU targets

Exit status 0 when every program fits the chip's memory, 3 when one does not, 1 on bad input.
Reads transformer_jax/training/aot.py for what is compiled and reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformer_jax import errors, fs
from transformer_jax.training import aot, targets


def main(argv):
  from absl import flags
  F = flags.FLAGS
  with errors.reported():
    if len(argv) > 1:
      raise targets.AotError(f"unexpected arguments {argv[1:]}")
    if F.install_plugins or F.install_cudnn:
      command = targets.install_command("all" if F.install_plugins else "cudnn",
                                        targets.plugins_dir(F.plugins))
      print(command)
      sys.exit(subprocess.call(command.split()))
    if F.config is None or not F.topology:
      raise targets.AotError("--config and --topology are required")
    programs = [p.strip() for p in F.programs.split(",") if p.strip()]
    unknown = sorted(set(programs) - set(targets.PROGRAMS))
    if unknown or not programs:
      raise targets.AotError(f"--programs {F.programs!r}: choose from "
                             f"{', '.join(targets.PROGRAMS)}")
    from transformer_jax.runs.workdir import check_file_outside_runs, check_outside_runs
    if F.json:
      fs.check_output_file(F.json, "--json")
      check_file_outside_runs(F.json, "--json")  # Never over a run's or a dataset's file.
    if F.hlo and Path(F.hlo).exists() and not Path(F.hlo).is_dir():
      raise targets.AotError(f"--hlo {F.hlo} is a file, not a directory")
    if F.hlo:
      check_outside_runs(F.hlo, "--hlo")
    target = targets.Target.parse(F.topology, F.num_slices)
    if F.save_train_step:
      if "train" not in programs:
        raise targets.AotError("--save_train_step needs the train program in --programs")
      fs.check_output_file(F.save_train_step, "--save_train_step")
      check_file_outside_runs(F.save_train_step, "--save_train_step")
    report = aot.compile_report(F.config, target, programs,
                                progress=lambda s: print(s, file=sys.stderr, flush=True),
                                save_train_step=F.save_train_step, hlo_dir=F.hlo)
  report["config"] = F["config"].value if hasattr(F["config"], "value") else None
  print(aot.format_report(report))
  if F.json:
    fs.replace_file(F.json, (json.dumps(report, indent=2, default=str) + "\n").encode())
  if not report["fits"]:
    too_big = [k for k, p in report["programs"].items() if not p["fits"]]
    print(f"error: {', '.join(too_big)} does not fit in {report['chip']}'s "
          f"{report['hbm_bytes_per_device'] / targets.GIB:.2f} GiB per device", file=sys.stderr)
    sys.exit(3)


def define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
  flags.DEFINE_string("topology", None, "Target: a TPU topology (v5e:2x4, v6e:2x2, v4:2x2x2, "
                      "v5p:2x2x2), GPUs (h100:1, h100:8, a100:8, h100:2x8 for 2 hosts of 8) or "
                      "this host's CPU as N devices (cpu:8).")
  flags.DEFINE_integer("num_slices", 1, "TPU slices (multi-slice), each of --topology.")
  flags.DEFINE_string("programs", ",".join(targets.PROGRAMS), "Which programs to compile.")
  flags.DEFINE_string("json", None, "Write the report here as JSON.")
  flags.DEFINE_string("plugins", None, "Directory of the compiler plugins (default: "
                      f"${targets.PLUGINS_ENV} or {targets.DEFAULT_PLUGINS}).")
  flags.DEFINE_string("save_train_step", None, "Also write the compiled train step here, for "
                      "train.py --config.run.compiled_train_step on the target.")
  flags.DEFINE_string("hlo", None, "Write each program's optimized HLO text into this "
                      "directory (PROGRAM.hlo.txt): what runs on the target.")
  flags.DEFINE_bool("install_plugins", False, "Install the pinned libtpu and CUDA plugin into "
                    "--plugins and exit.")
  flags.DEFINE_bool("install_cudnn", False, "Install the pinned cuDNN library into --plugins "
                    "and exit (0.7 GB; compiles cuDNN's fused attention for GPU targets).")


def run() -> None:
  # Before jax is imported: it reads JAX_PLATFORMS and looks for CUDA's version module once.
  targets.prepare_environment()
  targets.use_plugins(targets.plugins_dir(next((a.split("=", 1)[1] for a in sys.argv
                                        if a.startswith("--plugins=")), None)))
  with targets.plugin_load_noise_dropped():  # jax finds (and loads) the plugins as it starts.
    import jax
    jax.devices()
  from absl import app
  from transformer_jax.commands import launch
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
