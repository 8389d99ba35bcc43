"""Every per-platform decoding setting in one table: what `translate` and `serve` use on a CPU, a
GPU or a TPU where the user names none. Each field says why its values are what they are."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Platform:
  # Decoder rows one step computes when no slot count is named (greedy slots; a beam of K takes
  # K rows). On a 2-core CPU 128 rows decoded the Tatoeba sources faster than 64 or 256, greedy
  # and beam 4; an accelerator's step grows far slower than its rows.
  rows: int
  # Streams of slots a file is decoded by at once, each driven by a thread of its own. A CPU's
  # matrix products on a decoder step's few rows keep its cores only partly busy: on 2 cores a
  # second stream stepping at the same time computed about 1.45x the rows a second of one. An
  # accelerator runs one program at a time.
  lanes: int
  # The smallest active size a run program is compiled for, as a fraction of the slots. A CPU's
  # step costs about its rows; an accelerator's grows far slower (one H100, beam 4: 0.30 ms at
  # 64 rows, 1.23 ms at 1,024), and every size is a program more to compile and load.
  min_rows_fraction: int
  # Source tokens an encoder program computes at once (0: each batch whole). On a CPU a larger
  # batch is encoded a chunk of rows after another, inside the program: 128 sources of 32 or 64
  # tokens took 1.2-1.9x as long in one pass as in chunks of 1,024 tokens on 2 cores.
  encode_tokens: int
  # The source widths of translate's slot decoders below the model's max_len. On a CPU a
  # step's attention and a beam's cache reordering cost as much as the slots' width, and most
  # sentences are short; on an accelerator they cost little at any width, while every class is
  # a set of programs more to compile and load, and a tail of few running searches more.
  width_classes: tuple[int, ...]
  # How a beam step (and a slot refill) moves the cache rows of beams that continue another
  # beam: "loop" copies the rows that moved one at a time, in place (on a CPU most rows stay,
  # and a copy of every row is a pass over the whole cache); "gather" takes every row from its
  # parent at once (on a GPU each pass of the loop is kernels of its own: on one H100 a beam-4
  # step of 1,024 rows took 10.1 ms with the loop, 1.2 ms with the gather).
  row_copy: str
  # The widths a language model's decoding slots read a prompt in: one chunk a step, beside
  # the running sequences' decode steps, the narrowest that holds what is left of the prompt
  # (all compiled into one program); the widest only while no other sequence decodes, the
  # next to widest bounding how long a step stalls running streams. On 2 cores, a model of
  # max_len 512 (d_model 256, 4 layers) served a 510-token prompt's first token in 112 ms
  # with 256-wide chunks, 219 ms with 64-wide ones (16 tokens: 50 ms); an accelerator reads a
  # wide chunk in about the time of one position.
  prompt_chunks: tuple[int, ...]

  def slots(self, beam_size: int) -> int:
    """The slots for searches of `beam_size` beams where the user names no count."""
    return max(1, self.rows // beam_size)


CPU = Platform(rows=128, lanes=2, min_rows_fraction=16, encode_tokens=1024,
               width_classes=(16, 32), row_copy="loop", prompt_chunks=(16, 64, 256))
ACCELERATOR = Platform(rows=1024, lanes=1, min_rows_fraction=1, encode_tokens=0,
                       width_classes=(), row_copy="gather", prompt_chunks=(64, 512))
TABLE = {"cpu": CPU, "gpu": ACCELERATOR, "tpu": ACCELERATOR}
# A platform jax names otherwise: the CPU's settings, one lane.
OTHER = dataclasses.replace(CPU, lanes=1)


def settings(platform: str) -> Platform:
  """The decoding settings of `platform` (jax's name: "cpu", "gpu", "tpu")."""
  return TABLE.get(platform, OTHER)
