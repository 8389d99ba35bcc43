#!/usr/bin/env bash
# The GPU rows of benchmarks/README.md in one go, for a short loan of a GPU machine:
#   bash benchmarks/run_gpu.sh OUT_DIR [PART]        (DRY=1 ...: the same at toy sizes on a CPU)
# On an image with jax + CUDA but not tfds, grain, clu or ml_collections, it first installs the
# wheels in $WHEELS (default wheels/, made here by benchmarks/gpu_wheels.sh and carried along).
# PART real (the default): the paper's base size on real text. The embedding-gradient tests on
#         the GPU, a 300k-pair synthetic corpus with WMT-like lengths and Zipf-distributed words,
#         then on it (configs/synthetic.py, 96 x 256 bf16, cuDNN attention) the token-id probe
#         (benchmarks/token_ids.py) with the embedding gradient by scatter-add, sorted segment
#         sums and a one-hot product. On one H100 (2026-11-25) it fit in one 600 s command.
# PART train: the same corpus, then train.py for 300 steps (tokens/s, MFU: about 3 min on one
#         H100), then train_step.py on packed batches and the random-id control for each
#         embedding gradient (each command fits its own tokenizer: over 200 s each).
# PART 1: the GPU-only tests (cuDNN == XLA attention), then train_step.py at the paper's base and
#         big sizes in bfloat16 with cuDNN attention (attention_impl=auto).
# PART 2: the cuDNN test again, base size with the unsafe_rbg PRNG (dropout masks), the two sizes
#         with XLA attention, PyTorch side by side at base size, decode speed.
# PART 3: the fused (chunked) loss and gradient accumulation at base and big size (memory report
#         and step time, round-robin), ours against eager and torch.compile'd PyTorch at base
#         size, and the base step's profile with and without the chunked loss.
# PART decode: the main job (configs/fra_eng.py) trained on the GPU, then `translate` on the
#         Tatoeba sources with decoding slots, beam 4 and greedy, each twice (an empty, then a
#         filled compilation cache), timed whole; DECODE_RUNS="4:auto 4:1024 1:auto" picks the
#         beam sizes and slot counts (default "4:auto 1:auto"). Reads $DATA (default data/: made
#         by `python -m transformer_jax download --out data`, git-ignored; carry it along).
# PART lm: the language-model tests on the GPU, then configs/lm_gpt2_small.py (12 layers,
#         d_model 768, 64 x 1024 tokens, bf16) trained by train.py for 300 steps on the
#         Shakespeare works in $DATA/shakespeare (a 16,384-piece tokenizer: the works hold too
#         few distinct pieces for 50,257): step time, tokens/s, MFU.
# PART lm_peer: benchmarks/lm_vs_pytorch.py at that size: ours and the PyTorch peer trained
#         120 s each on the same batches, step time, tokens/s and validation bits per character.
# PART mfu: the language model at GPT-2 small's exact shape (benchmarks/gpt2_step.py: 64 x 1024
#         tokens, vocabulary 50,304) against the nanoGPT-style PyTorch peer under torch.compile,
#         round-robin in one process, with ours as configured and with each step lever (no remat;
#         row lengths for cuDNN's causal mask type; both; both with the layers unrolled); then
#         ours under the XLA flags of the GPU recipes; the base encoder-decoder queued back to
#         back; the profile by bucket of the GPT-2-shape step. Needs no data; not run yet (its
#         limits add to 14 min: expect about 7 on one H100 or H200).
# DRY=1: any part on a CPU at toy sizes, so that the script cannot rot between GPU loans (the
# test suite runs every part so: tests/system/test_run_gpu.py). Every command, flag and config
# override is the GPU run's; only sizes change: each config at its `:smoke` size, each count
# (steps, rounds, repeats, seconds, pairs, vocabulary, sentences) cut, of the variants of one
# command the last alone, a command repeated (for the big size, for a filled cache) run once,
# the pytest steps collected rather than run (the suite runs those tests itself), no
# nvidia-smi, XLA's backend optimizations off.
# Each command's JSON and the whole log go to OUT_DIR. A command that fails is reported and the
# next one still runs; the script's exit status is the number of failures (98: an OUT_DIR
# that a part would overwrite, 99: no wheels).
set -uo pipefail
dry=${DRY:-0}
n() { if [ "$dry" = 1 ]; then echo "$2"; else echo "$1"; fi; }  # n GPU_COUNT TOY_COUNT
cfg() { echo "configs/$1.py$(n '' :smoke)"; }  # cfg NAME: the config file, toy-sized in a dry run
# some A B ... Z: all of them on a GPU; in a dry run the last alone (the variants of one command
# share its flags and code paths at toy sizes, and the last combines the levers before it).
some() { if [ "$dry" = 1 ]; then echo "${@: -1}"; else echo "$@"; fi; }
variants() { for v in $(some "$@"); do printf -- '--variant %s ' "$v"; done; }  # variants A B ...

out=${1:?usage: benchmarks/run_gpu.sh OUT_DIR [real|train|1|2|3|decode|lm|lm_peer|mfu]}
part=${2:-real}
# The parts that train into OUT_DIR remove what they made there at the end (gigabytes of state
# not worth bringing back): they refuse an OUT_DIR that already holds those paths.
case $part in
  lm) made=(lm_gpt2_small tfds) ;;
  lm_peer) made=(tfds) ;;
  *) made=() ;;
esac
for name in "${made[@]}"; do
  if [ -e "$out/$name" ] || [ -L "$out/$name" ]; then
    echo "$out/$name exists: PART $part makes it and removes it at the end; pick a new OUT_DIR" >&2
    exit 98
  fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A dry run's programs run a step or two: compiled without LLVM's optimizations, each part
# takes about a quarter less time (its steps run slower, which nothing here measures).
if [ "$dry" = 1 ]; then
  export XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
fi
py=${PYTHON:-python3}
failures=0
if ! $py -c "import grain, tensorflow_datasets, clu, ml_collections, sentencepiece, sacrebleu" \
    2>/dev/null; then
  wheels=${WHEELS:-wheels}
  ls "$wheels"/*.whl >/dev/null || { echo "no wheels in $wheels: bash benchmarks/gpu_wheels.sh"; exit 99; }
  $py -m pip install -q --no-deps --no-index "$wheels"/*.whl || exit 99
fi

step() {  # step NAME SECONDS COMMAND...: runs one command under a time limit, logs its output.
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (exit $rc)"; failures=$((failures + 1)); }
}

gpu_info() {
  if [ "$dry" = 1 ]; then echo "dry run: toy sizes on $(uname -m)"; else
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; fi
}
pytest=($py -m pytest -q -p no:cacheprovider $(n '' --collect-only))

# 96 rows x 256 tokens a side, bfloat16, on uniform random ids: WMT14 cannot be downloaded from a
# machine without internet (parts real and train time real-like text, a synthetic corpus).
matmul=(--matmul_n "$(n 8192 256)")  # train_step.py's reference matrix product
base=(--config "$(cfg wmt14_base)" --steps "$(n 50 2)" --batches random "${matmul[@]}")
big=(--config "$(cfg wmt14_big)" --steps "$(n 50 2)" --batches random "${matmul[@]}")
if [ "$part" = real ]; then
  gpu_info
  $py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
          'optax', optax.__version__, jax.devices())"
  step embedding_tests 300 "${pytest[@]}" tests/unit/test_embedding.py
  corpus=$out/synth300k
  step corpus 300 $py benchmarks/synthetic_corpus.py --out "$corpus" --pairs "$(n 300000 5000)"
  data=(--data_dir "$corpus" --tfds_dir "$corpus/tfds")
  step token_ids 600 $py benchmarks/token_ids.py --config "$(cfg synthetic)" "${data[@]}" \
      $(variants model.embed_grad=scatter model.embed_grad=sorted model.embed_grad=onehot) \
      --batches "$(n 4 1)" --repeats "$(n 20 1)" --json "$out/token_ids.json"
elif [ "$part" = train ]; then
  corpus=$out/synth300k
  step corpus 300 $py benchmarks/synthetic_corpus.py --out "$corpus" --pairs "$(n 300000 5000)"
  step train_base 600 $py train.py --config "$(cfg synthetic)" --workdir "$out/train_base" \
      --config.data.data_dir "$corpus" --config.data.tfds_dir "$corpus/tfds" \
      --config.run.num_steps="$(n 300 4)" --config.run.log_every=50 --config.eval.every=100000 \
      --config.eval.bleu_sentences=0 --config.run.checkpoint_every=100000
  cp "$out/train_base/metrics.jsonl" "$out/train_base_metrics.jsonl" 2>/dev/null
  for grad in $(some sorted scatter onehot); do
    step "train_step_$grad" 400 $py benchmarks/train_step.py --config "$(cfg synthetic)" \
        --data_dir "$corpus" --tfds_dir "$corpus/tfds" --batches packed,random --steps "$(n 50 2)" \
        --set model.embed_grad=$grad "${matmul[@]}" --json "$out/train_step_$grad.json"
  done
elif [ "$part" = 1 ]; then
  gpu_info
  $py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
          'optax', optax.__version__, jax.devices())"
  step tests 240 "${pytest[@]}" tests/unit/test_model.py tests/unit/test_decode.py
  step base_cudnn 200 $py benchmarks/train_step.py "${base[@]}" --json "$out/base_cudnn.json"
  step big_cudnn 200 $py benchmarks/train_step.py "${big[@]}" --json "$out/big_cudnn.json"
elif [ "$part" = decode ]; then
  data=${DATA:-data}
  tatoeba=$data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng
  if [ "$dry" = 1 ]; then  # The first 32 sentences.
    for side in eng fra; do head -n 32 "$tatoeba.$side" > "$out/tatoeba32.$side"; done
    tatoeba=$out/tatoeba32
  fi
  step train_fra_eng 900 $py train.py --config "$(cfg fra_eng)" --workdir "$out/fra_eng" \
      --config.data.data_dir "$data/fra-eng" --config.data.tfds_dir "$out/tfds"
  # BEAM:SLOTS pairs, in order; each translates the file twice (the second with a filled cache).
  for pair in $(some ${DECODE_RUNS:-4:auto 1:auto}); do
    beam=${pair%%:*} slots=${pair#*:}
    for run in $(n "first second" first); do
      step "translate_beam${beam}_slots${slots}_$run" 600 bash -c "time $py -m transformer_jax \
          translate --workdir $out/fra_eng --input $tatoeba.eng --reference $tatoeba.fra \
          --output $out/tatoeba_beam${beam}_slots$slots.hyp --beam_size $beam --slots $slots \
          --compilation_cache_dir $out/translate_cache"
    done
  done
elif [ "$part" = lm ]; then
  data=${DATA:-data}
  lm_steps=$(n 300 4)
  gpu_info
  step lm_tests 200 "${pytest[@]}" tests/unit/test_language_model.py
  step lm_train 380 $py train.py --config "$(cfg lm_gpt2_small)" --workdir "$out/lm_gpt2_small" \
      --config.data.dataset=shakespeare --config.data.data_dir "$data/shakespeare" \
      --config.data.tfds_dir "$out/tfds" --config.data.vocab_size="$(n 16384 500)" \
      --config.run.num_steps="$lm_steps" --config.run.log_every=50 --config.eval.every="$lm_steps" \
      --config.run.checkpoint_every="$lm_steps" --config.optimizer.warmup_steps=100
  cp "$out/lm_gpt2_small/metrics.jsonl" "$out/lm_gpt2_small_metrics.jsonl" 2>/dev/null
  rm -rf "$out/lm_gpt2_small/checkpoints" "$out/tfds"  # 1.5 GB of state: not brought back.
elif [ "$part" = lm_peer ]; then
  data=${DATA:-data}
  step lm_vs_pytorch 580 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py benchmarks/lm_vs_pytorch.py \
      --config "$(cfg lm_gpt2_small)" --set data.dataset=shakespeare \
      --set "data.data_dir=$data/shakespeare" --set "data.tfds_dir=$out/tfds" \
      --set data.vocab_size="$(n 16384 500)" --set run.num_steps=100000 --seconds "$(n 120 5)" \
      --json "$out/lm_vs_pytorch.json"
  rm -rf "$out/tfds"
elif [ "$part" = mfu ]; then
  gpu_info
  $py -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
  lengths=model.attention_mask=lengths,data.packing=False
  step gpt2_vs_pytorch 400 $py benchmarks/gpt2_step.py --peers compiled --rounds "$(n 5 1)" --steps "$(n 10 1)" \
      --variant model.remat=none --variant $lengths --variant $lengths,model.remat=none \
      --variant $lengths,model.remat=none,model.scan_layers=False \
      --json "$out/gpt2_vs_pytorch.json"
  # The GPU recipes' flags (JAX-Toolbox GPU_performance.md, MaxText's a3 scripts), in a
  # process of their own: compare its "ours" with the run above.
  step gpt2_xla_flags 150 env XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true \
      --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer=" \
      $py benchmarks/gpt2_step.py --peers none --rounds "$(n 5 1)" --steps "$(n 10 1)" \
      --variant $lengths,model.remat=none --json "$out/gpt2_xla_flags.json"
  step base_step 150 $py benchmarks/train_step.py "${base[@]}" --json "$out/base_step.json"
  step gpt2_profile 120 $py benchmarks/profile_step.py --config "$(cfg lm_gpt2_small)" \
      --steps 3 --top 25 --json "$out/gpt2_profile.json"
elif [ "$part" = 3 ]; then
  for size in base $(n big ''); do  # At toy sizes the two configs are one model.
    step "variants_$size" 300 $py benchmarks/step_variants.py --config "$(cfg wmt14_$size)" \
        --steps "$(n 20 2)" $(variants step.loss_chunks=1 step.loss_chunks=4 step.loss_chunks=8 \
        step.grad_accum_steps=4 step.grad_accum_steps=4,step.loss_chunks=4) \
        --json "$out/variants_$size.json"
  done
  step compare_compile 300 env XLA_PYTHON_CLIENT_PREALLOCATE=false \
      $py benchmarks/compare_pytorch.py --config "$(cfg wmt14_base)" --compile \
      --rounds "$(n 4 1)" --steps "$(n 5 1)" --json "$out/compare_compile.json"
  for chunks in $(n "1 4" 4); do
    step "profile_chunks$chunks" 200 $py benchmarks/profile_step.py --config "$(cfg wmt14_base)" \
        --set step.loss_chunks=$chunks
  done
else
  step cudnn_test 120 "${pytest[@]}" -s tests/unit/test_model.py -k cudnn
  step base_cudnn_rbg 150 env JAX_DEFAULT_PRNG_IMPL=unsafe_rbg $py benchmarks/train_step.py \
      "${base[@]}" --json "$out/base_cudnn_rbg.json"
  step base_xla 150 $py benchmarks/train_step.py "${base[@]}" --set model.attention_impl=xla \
      --json "$out/base_xla.json"
  if [ "$dry" = 0 ]; then  # At toy sizes, base_xla's model (part 1 runs the big config).
    step big_xla 150 $py benchmarks/train_step.py "${big[@]}" --set model.attention_impl=xla \
        --json "$out/big_xla.json"
  fi
  # Both frameworks share the card: JAX allocates as it goes instead of taking 75% up front.
  step compare_base 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py benchmarks/compare_pytorch.py \
      --config "$(cfg wmt14_base)" --rounds "$(n 4 1)" --steps "$(n 5 1)" \
      --json "$out/compare_base.json"
  # A dry run times each decoder once at batches of 1 and 8 (the uncached baseline at batch 64
  # takes seconds a call on 2 CPU cores).
  step decode 120 $py benchmarks/decode.py --config "$(cfg fra_eng)" --out_len 64 \
      --batches "$(n 1,64 1,8)" --repeats "$(n 10 1)" --json "$out/decode.json"
fi
echo "=== failures: $failures"
exit "$failures"
