#!/usr/bin/env bash
# The acceptance script for a machine with one GPU (never used by tests). It runs benchmarks/gpu_check.py:
# the software stack and the layer spec that actually ran (Transformer Engine's when TE imports),
# throughput/MFU of the tiny Llama and a ~1B Llama, bf16 fine-tuning from a pretrained checkpoint whose
# one optimizer step moves every main parameter by at most the lr (weights = bf16 of the main params),
# LoRA SFT, Megatron-FSDP zero3 with a save and an evaluation (losses as DDP's), packed SFT (THD), a tiny
# MoE with MLA and MTP (grouped GEMM), FP8 within 2% of bf16's loss, fp8_param_gather from a pretrained
# checkpoint staying at its loss, fp16 learning like bf16 (the FP8 checks when TE and an FP8 GPU are
# there), and a checkpoint saved with overlap_param_gather equal bit for bit to the synced one
# (deterministic settings). A few minutes on an H200 (budget 8). It prints one table (also
# $OUT/gpu_check.json when OUT is set) and exits non-zero when any check fails or crashes.
# GPU_CHECK_SMALL=1 runs the same logic at toy sizes on the CPU lane (CUDA/TE checks say SKIP).
#
#   bash benchmarks/gpu_check.sh                  # from the repository root
#   STEPS_1B=20 bash benchmarks/gpu_check.sh      # fewer steps for the 1B throughput run
#   ONLY=sft_keeps,overlap bash benchmarks/gpu_check.sh
#   GPU_CHECK_SMALL=1 bash benchmarks/gpu_check.sh   # CPU lane, toy sizes (no GPU)
#
# Needs python3 with CUDA torch and this project importable (pip install -e ".[gpu]", or the image). On
# a machine without a package index, point WHEELS at a folder of wheels for its Python (downloaded
# elsewhere with `pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1
# hydra-core omegaconf antlr4-python3-runtime`); they are installed into a scratch folder first.
# Logs of every run stay in $WORK (a fresh temporary folder unless set). Data: the built-in corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
export WORK
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl
  export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py
