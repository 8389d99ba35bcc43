"""Translating a whole file with this project and with CTranslate2 on the same weights.

  python benchmarks/decode_vs_ctranslate2.py --workdir runs/fra_eng \
      --input data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.eng \
      --reference data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.fra \
      --json benchmarks/results/NAME.json

The workdir is exported to CTranslate2 (`transformer_jax.interop.export`, float32) and loaded as
float32 and as int8 (CTranslate2 quantizes on load). Every engine translates every source whole (no
sentence splitting), greedy and with beam 4, on the same number of threads (`--threads`: XLA's
CPU thread pool and CTranslate2's intra_threads). A first pass of each engine and mode is a
A warm-up of each engine and mode translates one source of every source width (a multiple of
8 tokens): ours compiles its decoder for each batch shape there, and that time is reported as
compile time. Then `--rounds` timed passes over the whole file alternate between the engines
(A B C A B C), so that a busy machine slows all alike. CTranslate2 batches by
`--ct2_batch_tokens` (8,192: its fastest of the settings tried, docs/translating.md), ours by
translate's defaults. Reported: sentences/s and target tokens/s (SentencePiece pieces of the
outputs) of the median pass, BLEU of the outputs (sacreBLEU against --reference), and how many
outputs equal ours. Beam search: each engine's own length normalization at --alpha (ours GNMT's
((5 + n) / 6) ** alpha, CTranslate2's n ** alpha).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, use_cpu_threads  # noqa: E402


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--input", required=True)
  parser.add_argument("--reference", default=None)
  parser.add_argument("--limit", type=int, default=0, help="Only the first N sources (0: all).")
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--alpha", type=float, default=None,
                      help="Length penalty; default: the workdir's decode.alpha.")
  parser.add_argument("--batch_size", type=int, default=64,
                      help="Ours: sentences per batch (at most, with --batch_tokens).")
  parser.add_argument("--batch_tokens", type=int, default=1024,
                      help="Ours: decoder rows x source tokens per batch (0: --batch_size).")
  parser.add_argument("--ct2_batch_tokens", type=int, default=8192,
                      help="CTranslate2's max_batch_size in tokens (its fastest setting of those "
                           "tried here); 0: --ct2_batch examples.")
  parser.add_argument("--ct2_batch", type=int, default=64,
                      help="CTranslate2's max_batch_size in examples, with --ct2_batch_tokens 0.")
  parser.add_argument("--ct2_limit", choices=("ours", "default"), default="ours",
                      help="CTranslate2's output limit: ours (the model's max_len + 10, the "
                      "most translate allows a source of max_len) or its own default (256).")
  parser.add_argument("--modes", default="greedy,beam")
  parser.add_argument("--engines", default="ours,ct2-float32,ct2-int8",
                      help="ours: translate's decoding slots (--slots); ours-batches: its "
                      "fixed batches (--batch_size, --batch_tokens); ours-int8, ours-shortlist, "
                      "ours-int8-shortlist: the slots with int8 weights, the workdir's "
                      "vocabulary shortlist, both; ct2-float32, ct2-int8, each with -vmap: "
                      "CTranslate2 with the same shortlist as its vocabulary map.")
  parser.add_argument("--slots", default="auto", help="ours' decoding slots: 'auto' or a count.")
  parser.add_argument("--lanes", default="auto", help="ours' streams of slots: 'auto' or a count.")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  # XLA's CPU thread pool: set before jax starts.
  use_cpu_threads(args.threads)

  import jax
  import sacrebleu
  import sentencepiece as spm

  from transformer_jax.decoding import platforms, shortlist
  from transformer_jax.decoding.inputs import read_lines
  from transformer_jax.decoding.options import DecodeOptions
  from transformer_jax.decoding.lines import BEAM_BUDGET, translate_lines
  from transformer_jax.decoding.translator import Translator

  lines = read_lines(args.input)
  references = read_lines(args.reference) if args.reference else None
  if args.limit:
    lines = lines[:args.limit]
    references = references and references[:args.limit]
  engine_names = args.engines.split(",")
  translators = {}
  for name in engine_names:
    if name.startswith("ours"):
      translators[name] = Translator(
          args.workdir, int8_weights="-int8" in name,
          shortlist=shortlist.for_workdir(args.workdir) if "-shortlist" in name else None)
      if args.lanes != "auto":
        translators[name].lanes = int(args.lanes)
  translator = next(iter(translators.values()))
  alpha = translator.config.decode.alpha if args.alpha is None else args.alpha
  sp = spm.SentencePieceProcessor(model_proto=translator.tokenizers.src.model_proto)
  sources = [sp.encode(line, out_type=str) for line in lines]
  max_len = translator.max_src_len

  # One source of each width (tokens with <eos>, rounded up to 8): the warm-up.
  widths = {}
  for i, pieces in enumerate(sources):
    widths.setdefault(-(-min(len(pieces) + 1, max_len) // 8), i)
  warm_up = sorted(widths.values())

  with tempfile.TemporaryDirectory() as tmp:
    engines = {}
    for name in engine_names:
      if name.startswith("ours"):
        engines[name] = None
        continue
      import ctranslate2
      from transformer_jax.interop import export
      if not (Path(tmp) / "ct2").exists():
        export.export(args.workdir, "ctranslate2", Path(tmp) / "ct2")
      if name.endswith("-vmap") and not (Path(tmp) / "ct2" / "vmap.txt").exists():
        shutil.copy(shortlist.for_workdir(args.workdir), Path(tmp) / "ct2" / "vmap.txt")
      engines[name] = ctranslate2.Translator(str(Path(tmp) / "ct2"), device="cpu",
                                             compute_type=name.split("-")[1],
                                             inter_threads=1, intra_threads=args.threads)

    def run(name: str, beam: int, which: list[int]) -> list[str]:
      if name.startswith("ours"):
        options = DecodeOptions(beam_size=beam, alpha=alpha)
        kwargs = {"batch_tokens": args.batch_tokens} if args.batch_tokens else {}
        if not name.startswith("ours-batches"):
          kwargs["num_slots"] = (platforms.CPU.slots(beam) if args.slots == "auto"
                                 else int(args.slots))
        return translate_lines(translators[name], [lines[i] for i in which], options,
                               args.batch_size, progress=False, **kwargs)
      limit = dict(max_decoding_length=max_len + 10) if args.ct2_limit == "ours" else {}
      batching = (dict(max_batch_size=args.ct2_batch_tokens, batch_type="tokens")
                  if args.ct2_batch_tokens else dict(max_batch_size=args.ct2_batch))
      results = engines[name].translate_batch(
          [sources[i] for i in which], beam_size=beam, length_penalty=alpha,
          use_vmap=name.endswith("-vmap"),
          max_input_length=max_len, **limit, **batching)
      return [sp.decode_pieces(r.hypotheses[0]) for r in results]

    rows, everything = [], list(range(len(lines)))
    for mode in args.modes.split(","):
      beam = 1 if mode == "greedy" else args.beam_size
      outputs, first, times = {}, {}, {name: [] for name in engines}
      stepped = lambda name: sum(d.rows_stepped
                                 for d in translators[name]._slot_decoders.values())
      rows_stepped = {}
      for name in engines:  # Warm-up: compiles ours for every width (in slots: every
        start = time.perf_counter()  # encoder batch size too, so a whole pass).
        run(name, beam, everything if name in translators else warm_up)
        first[name] = time.perf_counter() - start
        print(f"{mode} {name}: warm-up ({len(warm_up)} sources) {first[name]:.1f} s", flush=True)
      for _ in range(args.rounds):
        for name in engines:
          slotted = name in translators and not name.startswith("ours-batches")
          start, before = time.perf_counter(), slotted and stepped(name)
          out = run(name, beam, everything)
          times[name].append(time.perf_counter() - start)
          if slotted:  # The decoder rows the slots' steps computed in one pass.
            rows_stepped[name] = stepped(name) - before
          assert outputs.setdefault(name, out) == out, f"{name}: another pass, other outputs"
          print(f"{mode} {name}: {times[name][-1]:.1f} s", flush=True)
      for name in engines:
        median = statistics.median(times[name])
        tokens = sum(len(ids) for ids in sp.encode(outputs[name]))
        row = {"engine": name, "mode": mode, "beam_size": beam, "sentences": len(lines),
               "median_s": median, "passes_s": times[name], "warm_up_s": first[name],
               "sentences_per_s": len(lines) / median,
               "target_tokens_per_s": tokens / median,
               "same_as_ours": sum(a == b for a, b in zip(outputs[name], outputs.get("ours", [])))}
        if name in rows_stepped:
          row["decoder_rows_stepped"] = rows_stepped[name]
        if references:
          row["bleu"] = sacrebleu.corpus_bleu(outputs[name], [references]).score
        rows.append(row)

  cpu = cpu_model()
  header = (f"{cpu}, {os.cpu_count()} cores, {args.threads} threads per engine; jax "
            f"{jax.__version__}, ctranslate2 {_version('ctranslate2')}; {len(lines)} sources of "
            f"{Path(args.input).name}; step {translator.step} of {Path(args.workdir).name}; "
            f"alpha {alpha}; ours: --slots {args.slots}, {translator.lanes} lanes; ours-batches: batches of "
            f"{args.batch_size} sentences, {args.batch_tokens} tokens (beam search "
            f"{BEAM_BUDGET}x that); "
            f"CTranslate2: output limit {args.ct2_limit}, batches of " + (f"{args.ct2_batch_tokens} tokens"
                                           if args.ct2_batch_tokens else
                                           f"{args.ct2_batch} sentences")
            + f"; {time.strftime('%Y-%m-%d')}")
  print(header)
  print(f"{'mode':<7} {'engine':<13} {'sent/s':>8} {'tok/s':>8} {'median s':>9} {'warm-up s':>9} "
        f"{'BLEU':>6} {'= ours':>7} {'vs ct2-f32':>10}")
  for r in rows:
    base = next((b for b in rows if b["mode"] == r["mode"] and b["engine"] == "ct2-float32"), r)
    print(f"{r['mode']:<7} {r['engine']:<13} {r['sentences_per_s']:>8.1f} "
          f"{r['target_tokens_per_s']:>8.0f} {r['median_s']:>9.1f} {r['warm_up_s']:>9.1f} "
          f"{r.get('bleu', float('nan')):>6.2f} {r['same_as_ours']:>7} "
          f"{r['sentences_per_s'] / base['sentences_per_s']:>9.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "command": sys.argv, "rows": rows},
                                          indent=2))


if __name__ == "__main__":
  main()
