#!/usr/bin/env bash
# The wheels that benchmarks/run_gpu.sh installs on a GPU machine whose image has jax with CUDA
# (and flax, optax, orbax) but not the project's other dependencies, downloaded here for that
# machine's Python (default 3.12, manylinux x86_64):
#   bash benchmarks/gpu_wheels.sh [DIR] [PYTHON_VERSION]      (DIR default: wheels/, ~12 MB)
# Then carry DIR beside the repository to the GPU machine (run_gpu.sh reads $WHEELS, default
# wheels/). `promise` (a tfds dependency) has no wheel on PyPI: one is built here.
set -euo pipefail
dir=${1:-wheels}
pyver=${2:-3.12}
py=${PYTHON:-python3}
mkdir -p "$dir"
$py -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --dest "$dir" \
    grain==0.2.18 array-record tensorflow-datasets==4.9.10 clu==0.0.12 tensorboardX \
    ml-collections pysbd importlib_resources dm-tree simple-parsing tensorflow-metadata \
    immutabledict termcolor toml docstring-parser portpicker sentencepiece sacrebleu \
    portalocker tabulate colorama lxml etils wrapt regex cloudpickle
$py -m pip wheel -q --no-deps --wheel-dir "$dir" promise
du -sh "$dir"
