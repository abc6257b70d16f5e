"""Acceptance checks on one GPU (run by benchmarks/gpu_check.sh; never by the tests).

Every check runs the real trainer (``python -m megatron_recipes.train``) as a user would, on the built-in
corpus, and ends as PASS, FAIL or SKIP (with the reason) in one table; the exit code is 1 when any check
failed or crashed. Nothing is hidden: a crashed run is a FAIL with the tail of its log.

  stack       CUDA present; the log names megatron-core/TE/torch/CUDA and the layer spec that ran, which
              must be Transformer Engine's when TE imports (else megatron-core's local spec)
  tiny, 1b    throughput: tokens/s, step time, MFU, peak memory (bf16, fusions as the machine allows)
  sft_keeps   bf16 fine-tuning from a pretrained checkpoint: one step at lr 1e-50 leaves the bf16 weights
              and the fp32 main parameters bit-identical to the checkpoint's
  fp8         (TE, compute capability >= 8.9) FP8 current scaling trains the tiny model over the same
              steps with a mean loss over the last 10 of 60 steps within 2% of bf16's (published FP8
              recipes track bf16 loss curves to well under 1%; 2% leaves room for a 2M-parameter model)
  overlap     overlap_grad_reduce + overlap_param_gather: a checkpoint saved mid-run (step 3 of 5) is
              bit-identical to the one saved without the overlaps (one GPU: DP=1, so this proves the
              code path and the forced sync run on CUDA; the DP=2 case is a CPU-lane test)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import train_support as ts  # noqa: E402  (checkpoint readers shared with the CPU-lane tests)

FP8_TOLERANCE = 0.02
COMMON = [
    "cluster=h200_8gpu",
    "cluster.gpus_per_node=1",
    "parallel=none",
    "precision=bf16",
    "checkpoint.load=none",
    "logging.log_interval=1",
    "logging.eval_interval=100000",
    "logging.eval_iters=0",
    "logging.plot=false",
    "logging.tensorboard=false",
]
TINY = ["train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=32"]
if os.environ.get("GPU_CHECK_SMALL"):  # a dry run of the checks' logic on the CPU lane (no GPU)
    TINY = ["train.seq_length=32", "train.micro_batch_size=4", "train.global_batch_size=8", "data.builtin_max_files=80",
            "data.builtin_vocab_size=600"]
WARM = "optimizer.lr_warmup_iters=5"
ONE_B = [
    "model.name=llama_1b_check", "model.num_layers=16", "model.hidden_size=2048", "model.num_attention_heads=32",
    "model.num_query_groups=8", "model.ffn_hidden_size=8192", "model.max_position_embeddings=2048",
    "train.seq_length=2048", "train.micro_batch_size=4", "train.global_batch_size=32",
    "optimizer.lr=3.0e-4", "optimizer.min_lr=3.0e-5", "optimizer.lr_warmup_iters=5",
]
Row = Tuple[str, str, str]


class Work:
    def __init__(self, root: Path):
        self.root = root

    def train(self, name: str, *overrides: str) -> Tuple[Path, List[Dict], Dict]:
        run_dir = self.root / name
        cmd = [sys.executable, "-m", "megatron_recipes.train", "tiny_llama_cpu", f"run.dir={run_dir}",
               f"data.cache_dir={self.root / 'cache'}", *COMMON, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (self.root / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"run {name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2500:]}")
        log = run_dir / "log.jsonl"
        meta = next(json.loads(ln)["metadata"] for ln in log.read_text().splitlines() if '"METADATA"' in ln)
        return run_dir, [r["data"] for r in ts.step_records(log) if "loss" in r["data"]], meta


def check_stack(work: Work) -> Row:
    import torch

    if not torch.cuda.is_available():
        return ("stack", "FAIL", "no CUDA device: this check is for a GPU machine")
    from megatron_recipes.models import capabilities

    _, _, meta = work.train("stack", "train.train_iters=2", "optimizer.lr_warmup_iters=1", "checkpoint.save=false", *TINY)
    expected = "transformer_engine" if capabilities.detect().transformer_engine else "local"
    ok = meta["layer_spec"] == expected
    detail = f"{torch.cuda.get_device_name()}; {json.dumps(meta['versions'])}; spec {meta['layer_spec']} (expected {expected})"
    return ("stack", "PASS" if ok else "FAIL", detail)


def check_throughput(work: Work, name: str, overrides: List[str], steps: int) -> Row:
    _, recs, meta = work.train(name, f"train.train_iters={steps}", "checkpoint.save=false", *overrides)
    recs = recs[3:]  # warm-up steps (compilation, allocator growth)
    med = lambda k: statistics.median(r[k] for r in recs)  # noqa: E731
    mfu = med("mfu")
    detail = (f"{meta['params_on_rank0'] / 1e6:.0f}M params: {med('tokens_per_sec'):,.0f} tokens/s, "
              f"{med('step_time_s') * 1e3:.1f} ms/step, MFU {mfu:.1%}, peak {max(r['peak_mem_gib'] for r in recs):.1f} GiB, "
              f"final loss {recs[-1]['loss']:.3f}; fusions {sorted(k for k, v in meta['fusions'].items() if v)}")
    return (name, "PASS" if mfu > 0 else "FAIL", detail)


def check_sft_keeps_weights(work: Work) -> Row:
    pre, _, _ = work.train("sft_pre", "seed=7", "train.train_iters=10", WARM, *TINY)
    start = f"checkpoint.pretrained={pre / 'checkpoints'}"
    sft, _, _ = work.train("sft", start, "train.train_iters=1", "optimizer.lr=1e-50", "optimizer.min_lr=1e-50",
                           "optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant", *TINY)
    a = ts.stored_tensors(pre / "checkpoints" / "iter_0000010")
    b = ts.stored_tensors(sft / "checkpoints" / "iter_0000001")
    weights = [k for k in a if not k.startswith("optimizer.")]
    changed = [k for k in weights if not b[k].equal(a[k])]
    main = [k for k in weights if not b[f"optimizer.state.param.{k}"].equal(a[k].float())]
    ok = not changed and not main and bool(weights)
    return ("sft_keeps", "PASS" if ok else "FAIL", f"{len(weights)} tensors; weights changed {changed[:3]}, main params off {main[:3]}")


def check_fp8(work: Work) -> Row:
    from megatron_recipes.models import capabilities

    m = capabilities.detect()
    if not m.transformer_engine or m.compute_capability < (8, 9):
        return ("fp8", "SKIP", f"needs Transformer Engine and compute capability >= 8.9 (TE {m.transformer_engine}, cc {m.compute_capability})")
    losses = {}
    for precision in ("bf16", "fp8_tensorwise"):
        _, recs, _ = work.train(f"fp8_{precision}", f"precision={precision}", "train.train_iters=60", "checkpoint.save=false", WARM, *TINY)
        losses[precision] = statistics.mean(r["loss"] for r in recs[-10:])
    rel = abs(losses["fp8_tensorwise"] - losses["bf16"]) / losses["bf16"]
    ok = rel <= FP8_TOLERANCE
    return ("fp8", "PASS" if ok else "FAIL", f"mean loss of steps 51-60: bf16 {losses['bf16']:.4f}, fp8 {losses['fp8_tensorwise']:.4f}, relative {rel:.2%} (limit {FP8_TOLERANCE:.0%})")


def check_overlap(work: Work) -> Row:
    tensors = []
    for flag in ("false", "true"):
        run, _, _ = work.train(f"overlap_{flag}", "train.train_iters=5", "checkpoint.save_interval=3",
                               "optimizer.use_distributed_optimizer=true", f"parallel.overlap_grad_reduce={flag}",
                               f"parallel.overlap_param_gather={flag}", "optimizer.lr_warmup_iters=1", *TINY)
        tensors.append(ts.stored_tensors(run / "checkpoints" / "iter_0000003"))
    differ = ts.differing_tensors(*tensors)
    return ("overlap", "FAIL" if differ else "PASS", f"{len(differ)} of {len(tensors[0])} tensors differ {differ[:3]}")


def main() -> int:
    root = Path(os.environ.get("WORK") or tempfile.mkdtemp(prefix="gpu_check-"))
    root.mkdir(parents=True, exist_ok=True)
    work = Work(root)
    steps_tiny, steps_1b = int(os.environ.get("STEPS_TINY", 40)), int(os.environ.get("STEPS_1B", 30))
    checks = [
        ("stack", lambda: check_stack(work)),
        ("tiny", lambda: check_throughput(work, "tiny", [*TINY, WARM], steps_tiny)),
        ("1b", lambda: check_throughput(work, "1b", ONE_B, steps_1b)),
        ("sft_keeps", lambda: check_sft_keeps_weights(work)),
        ("fp8", lambda: check_fp8(work)),
        ("overlap", lambda: check_overlap(work)),
    ]
    only = [c for c in os.environ.get("ONLY", "").split(",") if c]
    rows: List[Row] = []
    for name, fn in checks:
        if only and name not in only:
            continue
        try:
            rows.append(fn())
        except Exception as exc:  # a crash is a failure, shown in the table with its cause
            traceback.print_exc()
            rows.append((name, "FAIL", f"{type(exc).__name__}: {str(exc)[-600:]}"))
        print(f"{rows[-1][0]}: {rows[-1][1]}", flush=True)
    print(f"\n{'check':<10} {'result':<6} detail")
    for name, result, detail in rows:
        print(f"{name:<10} {result:<6} {detail}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps([dict(zip(("check", "result", "detail"), r)) for r in rows], indent=2))
    print(f"\nlogs: {root}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
