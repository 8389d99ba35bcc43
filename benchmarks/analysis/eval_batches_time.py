"""One in-training evaluation of configs/fra_eng.py timed twice (initial parameters): the
validation loss over the split and the greedy BLEU of 256 sentences. Run from the repository
root: PYTHONPATH=. python benchmarks/analysis/eval_batches_time.py
(it reads the tokenizer and token cache of the workdir runs/rD). Output of 2026-11-23:
eval_batches_time.txt (before: eval_batches without `pack`; after: with pack=config.data.packing)."""
import sys, time
sys.argv = sys.argv[:1]

from transformer_jax import config as config_lib, sharding

from transformer_jax.models import build

from transformer_jax.training import checks
from transformer_jax.training import steps as step_lib
from transformer_jax.training.bleu_eval import BleuEval
from transformer_jax.data import pipeline
from transformer_jax.models.transformer import Transformer
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("c", "configs/fra_eng.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
config = m.get_config()
config.data.data_dir = "../shared/data/fra-eng"
import os
for kv in os.environ.get("SETS", "").split():
  k, v = kv.split("="); config[k] = type(config[k])(v)
mesh = checks.checked_mesh(config)
workdir = pathlib.Path("runs/rD")
data = pipeline.prepare(config_lib.parse(config).data, workdir, num_bleu_sentences=config.eval.bleu_sentences, is_first_host=True, wait_for_first_host=lambda: False)
model = Transformer(build.model_config(config_lib.parse(config).model, data.tokenizers.src.vocab_size, data.tokenizers.tgt.vocab_size))
state, sh = step_lib.create_train_state(model, step_lib.make_optimizer(config_lib.parse(config).optimizer, config.run.num_steps), 0, mesh, config.data.max_len)
eval_data = pipeline.eval_batches(data.eval, batch_size=config.eval.batch_size, max_len=config.data.max_len, overlong=config.data.overlong, pack=config.data.packing, process_index=0, process_count=1)
p_train, p_eval = step_lib.jit_steps(sh, mesh, config_lib.parse(config).step)
bleu = BleuEval(model, data.tokenizers, data.bleu_pairs, config.data.max_len, config.eval.batch_size)
print("eval batches", len(eval_data), eval_data[0]["inputs"].shape if isinstance(eval_data[0], dict) else "")
with sharding.mesh_context(mesh):
  for rep in range(2):
    t = time.perf_counter(); r = step_lib.summarize_eval([p_eval(state, sharding.global_batch(b, mesh)) for b in eval_data]); t1 = time.perf_counter()
    b = bleu(state.eval_params()); t2 = time.perf_counter()
    print(f"rep {rep}: eval loss {t1-t:.1f}s bleu {t2-t1:.1f}s", flush=True)
