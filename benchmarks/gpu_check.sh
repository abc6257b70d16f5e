#!/usr/bin/env bash
# One prepared GPU check (never used by tests): on a single GPU, train the tiny Llama and a ~1B Llama for
# a few dozen steps each through `python -m megatron_recipes.train`, then print tokens/s, MFU and peak
# memory per model. The Transformer Engine spec is used when TE imports, else megatron-core's local spec
# with the project's SDPA core attention (flash/memory-efficient kernels).
#
#   bash benchmarks/gpu_check.sh                # from the repository root, on a machine with one GPU
#   STEPS_1B=20 bash benchmarks/gpu_check.sh    # fewer steps
#
# Needs python3 with CUDA torch, and megatron-core, hydra-core, omegaconf, antlr4-python3-runtime,
# transformers, tokenizers importable (pip install -e ".[gpu]" does it). On a machine without a
# package index, point WHEELS at a folder of wheels for its Python (downloaded elsewhere with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... megatron-core hydra-core omegaconf
# antlr4-python3-runtime`); they are installed into a scratch folder first. Results also go to
# $OUT/gpu_check.json when OUT is set. Data: the built-in corpus (standard-library sources), no downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS_TINY=${STEPS_TINY:-40}
STEPS_1B=${STEPS_1B:-30}
WORK=${WORK:-$(mktemp -d)}
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl
  export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import importlib.util, torch
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
te = importlib.util.find_spec("transformer_engine") is not None
import megatron.core
ver = getattr(megatron.core, "__version__", "?")
print(f"torch {torch.__version__}, megatron-core {ver}, GPU {torch.cuda.get_device_name()}, "
      f"Transformer Engine {'importable: TE spec' if te else 'absent: local spec with SDPA attention'}")
EOF

COMMON=(cluster=h200_8gpu cluster.gpus_per_node=1 parallel=none precision=bf16 checkpoint.save=false
        checkpoint.load=none logging.log_interval=5 logging.eval_interval=100000 logging.eval_iters=0
        logging.plot=false logging.tensorboard=false "data.cache_dir=$WORK/cache")

run() {  # name, overrides...
  local name=$1; shift
  echo "== $name"
  "$PY" -m megatron_recipes.train tiny_llama_cpu "run.dir=$WORK/$name" "${COMMON[@]}" "$@" 2>&1 | grep -E "^(step|training|error|  )" || true
}

run tiny train.train_iters="$STEPS_TINY" train.seq_length=512 train.micro_batch_size=32 train.global_batch_size=64 \
    optimizer.lr_warmup_iters=5
# ~1.0B parameters (16 x 2048, GQA 32/8 heads, SwiGLU 8192; the built-in 4096-token vocabulary).
run llama_1b model.name=llama_1b_check model.num_layers=16 model.hidden_size=2048 model.num_attention_heads=32 \
    model.num_query_groups=8 model.ffn_hidden_size=8192 model.max_position_embeddings=2048 train.seq_length=2048 \
    train.micro_batch_size=4 train.global_batch_size=32 train.train_iters="$STEPS_1B" optimizer.lr=3.0e-4 \
    optimizer.min_lr=3.0e-5 optimizer.lr_warmup_iters=5

WORK="$WORK" "$PY" - <<'EOF'
import json, os, statistics
from pathlib import Path
from megatron_recipes.training.sinks import step_records
work, rows = Path(os.environ["WORK"]), {}
print(f"\n{'model':<10} {'params':>8} {'tokens/s':>10} {'step ms':>9} {'MFU':>7} {'peak mem GiB':>13} {'final loss':>11}")
for name in ("tiny", "llama_1b"):
    log = work / name / "log.jsonl"
    if not log.is_file():
        print(f"{name:<10} (no log: the run failed, see above)")
        continue
    meta = next(json.loads(l) for l in log.read_text().splitlines() if '"METADATA"' in l)["metadata"]
    recs = [r["data"] for r in step_records(log) if "loss" in r["data"]][1:]  # the first window holds warm-up
    if not recs:
        continue
    med = lambda k: statistics.median(r[k] for r in recs)
    rows[name] = {"params": meta["params_on_rank0"], "tokens_per_sec": med("tokens_per_sec"), "step_time_s": med("step_time_s"),
                  "mfu": med("mfu"), "peak_mem_gib": max(r["peak_mem_gib"] for r in recs), "final_loss": recs[-1]["loss"],
                  "layout": meta["layout"]}
    r = rows[name]
    print(f"{name:<10} {r['params']/1e6:>7.0f}M {r['tokens_per_sec']:>10,.0f} {r['step_time_s']*1e3:>9.1f} {r['mfu']:>7.1%} "
          f"{r['peak_mem_gib']:>13.1f} {r['final_loss']:>11.3f}")
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(rows, indent=2))
EOF
