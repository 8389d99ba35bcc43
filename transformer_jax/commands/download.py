"""The corpora and the held-out test sets from their public sources, in the layout the configs'
`data.data_dir` and the README's commands read.

  python -m transformer_jax download --out data
  python -m transformer_jax download --out data --sets en-fr-test

Sets: fra-eng (d2l's corpus, the main job's), multi30k, en-fr-test (Tatoeba's 2021-08-07 test
release less every pair sharing a sentence with fra-eng, newstest2014, Multi30k's 2016 test),
shakespeare (the 42 works the language-model configs read). Each file is checked against the one
the project's figures were measured on; a set already whole in --out is not fetched again.
"""

from __future__ import annotations

from absl import app, flags

from transformer_jax import errors
from transformer_jax.commands import launch
from transformer_jax.data.download import MIRROR_ENV, SETS, DownloadError, download


def define_flags() -> None:
  flags.DEFINE_string("out", None, "Directory to write the sets into (created if missing; "
                      "files already there and equal are kept).")
  flags.DEFINE_list("sets", list(SETS), f"Which sets: {', '.join(SETS)}.")
  flags.DEFINE_string("mirror", None, "Read the source files from this directory (by their "
                      f"file names) instead of downloading them; default ${MIRROR_ENV}.")


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported("interrupted; the files already written are whole: run the same "
                       "command to write the rest"):
    if len(argv) > 1:
      raise DownloadError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.out:
      raise DownloadError("--out is required: the directory to write the sets into")
    written = download(FLAGS.out, FLAGS.sets, FLAGS.mirror)
  corpora = [s for s in FLAGS.sets if s != "en-fr-test"]  # The test sets are not trained on.
  hint = (f"; train with --config.data.data_dir {FLAGS.out}/{corpora[0]}" if len(corpora) == 1
          else f"; train with --config.data.data_dir {FLAGS.out}/NAME (NAME: "
          f"{', '.join(corpora)})" if corpora else "")
  print(f"Wrote {len(written)} files under {FLAGS.out}{hint}")


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
