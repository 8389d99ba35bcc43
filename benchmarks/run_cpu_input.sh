#!/usr/bin/env bash
# The input-path measurements on a CPU, one after the other on a quiet machine:
#   benchmarks/run_cpu_input.sh OUT SYNTH1M SYNTH5M [pipeline] [first_step_1m] [first_step_5m] [train]
# (all four parts unless some are named). SYNTH1M and SYNTH5M are corpora written by
# benchmarks/synthetic_corpus.py, each prepared once (tfds array_record files, tokenizer, token
# cache) by
#   python train.py --config configs/synthetic.py:cpu --workdir W --config.data.data_dir DIR \
#       --config.data.tfds_dir DIR/tfds --config.run.num_steps 1
# JSON and logs go to OUT; the `train` part reads $DATA/fra-eng (default data/, from `download`).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 synth1m=$2 synth5m=$3
shift 3
parts=${*:-pipeline first_step_1m first_step_5m train}
py=${PYTHON:-.venv/bin/python}
data=${DATA:-data}
mkdir -p "$out"

pipeline() {  # Tokenize + pack throughput, 1 and 2 grain workers, the whole 1M corpus.
  $py benchmarks/input_pipeline.py --config configs/synthetic.py --set data.data_dir="$synth1m" \
      --set data.tfds_dir="$synth1m/tfds" --workers 1 2 --batches 200 \
      --json "$out/input_pipeline.json" 2>&1 | tee "$out/input_pipeline.log"
}

first_step() {  # Seconds to the first step; peak memory up to step 20. Fresh workdir.
  local corpus=$1 name
  name=$(basename "$corpus")
  rm -rf "$out/w_$name"
  $py benchmarks/first_step.py --json "$out/first_step_$name.json" --stop_at_step 20 -- \
      --config configs/synthetic.py:cpu --workdir "$out/w_$name" --config.data.data_dir "$corpus" \
      --config.data.tfds_dir "$corpus/tfds" --config.run.num_steps 100 2>&1 | tail -20 \
      | tee "$out/first_step_$name.log"
}
first_step_1m() { first_step "$synth1m"; }
first_step_5m() { first_step "$synth5m"; }

train() {  # train.py on the default config (150 steps), then train_step.py --real_data.
  rm -rf "$out/w_default"
  $py train.py --config configs/fra_eng.py --workdir "$out/w_default" \
      --config.data.data_dir "$data/fra-eng" --config.run.num_steps 150 --config.run.log_every 50 \
      --config.eval.every 1000 --config.run.checkpoint_every 1000 --config.eval.bleu_sentences 0 \
      > "$out/train_default.log" 2>&1
  cp "$out/w_default/metrics.jsonl" "$out/train_default_metrics.jsonl"
  $py benchmarks/train_step.py --config configs/fra_eng.py --real_data \
      --data_dir "$data/fra-eng" --steps 20 --json "$out/train_step_real_data.json" \
      2>&1 | tee "$out/train_step_real_data.log"
}

for part in $parts; do "$part"; done
