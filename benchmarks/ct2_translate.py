"""CTranslate2's side of a whole-command comparison: translate a file with a model exported by
`python -m transformer_jax export --to ctranslate2`, as a user of CTranslate2 would.

  python benchmarks/ct2_translate.py --model runs/fra_eng_ct2 --input SRC --output HYP \
      --beam_size 4 --alpha 1.0 --threads 2

Sources are cut into SentencePiece pieces with the exported tokenizer.model, translated whole in
batches of --batch_tokens tokens, and the outputs joined back into text. Output limit: 74 tokens
(this project's own limit for its 64-token sources; --default_limit: CTranslate2's 256).
--compute_type int8 quantizes on load; --vmap decodes with the exported vocabulary map.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="A CTranslate2 model directory.")
  parser.add_argument("--input", required=True)
  parser.add_argument("--output", required=True)
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--alpha", type=float, default=1.0, help="CTranslate2's length_penalty.")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--batch_tokens", type=int, default=8192)
  parser.add_argument("--max_input_length", type=int, default=64)
  parser.add_argument("--compute_type", default="float32", help="float32, int8, ...: "
                      "CTranslate2 quantizes a float32 model on load.")
  parser.add_argument("--vmap", action="store_true", help="Decode with the model's vocabulary "
                      "map (vmap.txt, which export writes from the workdir's shortlist).")
  parser.add_argument("--default_limit", action="store_true", help="CTranslate2's own output "
                      "limit (256) instead of --max_input_length + 10.")
  args = parser.parse_args()
  if args.vmap and not (Path(args.model) / "vmap.txt").exists():
    raise SystemExit(f"--vmap: {args.model} has no vmap.txt")

  import ctranslate2
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor(model_file=str(Path(args.model) / "tokenizer.model"))
  lines = Path(args.input).read_text(encoding="utf-8").split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  engine = ctranslate2.Translator(args.model, device="cpu", compute_type=args.compute_type,
                                  inter_threads=1, intra_threads=args.threads)
  sources = [sp.encode(line, out_type=str) for line in lines]
  results = engine.translate_batch(
      sources, beam_size=args.beam_size, length_penalty=args.alpha,
      max_input_length=args.max_input_length, use_vmap=args.vmap,
      max_batch_size=args.batch_tokens, batch_type="tokens",
      **({} if args.default_limit else {"max_decoding_length": args.max_input_length + 10}))
  Path(args.output).write_text("".join(sp.decode_pieces(r.hypotheses[0]) + "\n"
                                       for r in results), encoding="utf-8")


if __name__ == "__main__":
  main()
