"""A GPT-2-small-sized decoder-only language model (124M parameters), for accelerators.

12 pre-LN blocks of causal self-attention and FFN, d_model 768, 12 heads, FFN 3072, learned
positions over 1,024 tokens, a 50,257-piece vocabulary (padded to 50,304) tied to the output,
bfloat16, AdamW (0.9, 0.95, weight decay 0.1) with a cosine schedule, 64 rows x 1,024 tokens a
step. Compiled for TPU/GPU topologies without them:
  python -m transformer_jax aot --config configs/lm_gpt2_small.py --topology v5e:2x4
Trained on one H100 for 300 steps on the Shakespeare works (a 16,384-piece tokenizer):
  bash benchmarks/run_gpu.sh OUT lm
6.2 steps/s, 388-393k tokens/s, 25% MFU (docs/language_models.md). `data.dataset` is
`text_documents`: set `data.data_dir` to a directory of *.txt files.
"""

from transformer_jax.config import base_config, smoke, variants


def get_config(arg=None):
  arg = variants(arg, ("smoke",))
  c = base_config()
  c.data.update(dataset="text_documents", vocab_size=50_257, max_len=1024, batch_size=64)
  c.model.update(family="decoder_only", positions="learned", num_encoder_layers=0,
                 num_decoder_layers=12, d_model=768, num_heads=12, ffn_dim=3072,
                 dropout_rate=0.0, pre_ln=True, dtype="bfloat16", scan_layers=True,
                 remat="dots")
  c.optimizer.update(schedule="cosine", learning_rate=6e-4, warmup_steps=2000, adam_b2=0.95,
                     adam_eps=1e-8, weight_decay=0.1)
  c.step.label_smoothing = 0.0
  c.run.update(num_steps=100_000, checkpoint_every=2000)
  c.eval.update(every=2000, bleu_sentences=0)
  return smoke(c) if "smoke" in arg else c
