"""Acceptance checks on one GPU (run by benchmarks/gpu_check.sh; never by the tests).

Every check runs the real trainer (``python -m megatron_recipes.train``) as a user would, on the built-in
corpus, and ends as PASS, FAIL or SKIP (with the reason) in one table; the exit code is 1 when any check
failed or crashed. Nothing is hidden: a crashed run is a FAIL with the tail of its log. Tiny models and
tens of steps: the whole table takes a few minutes on an H200 (budget 8).

  stack       CUDA present; the log names megatron-core/TE/torch/CUDA and the layer spec that ran, which
              must be Transformer Engine's when TE imports (else megatron-core's local spec)
  tiny, 1b    throughput: tokens/s, step time, MFU, peak memory (bf16, fusions as the machine allows)
  sft_keeps   bf16 full fine-tuning from a pretrained checkpoint, one Adam step at lr 1e-5 (representable:
              1e-50 is 0 in fp32 and would prove nothing): every fp32 main parameter starts from the
              checkpoint's weight (|moved| <= lr, as Adam's first step moves each element by
              lr*|g|/(|g|+eps)), at least one element of each tensor moves by ~lr (the optimizer ran), and
              each bf16 weight is its main parameter rounded to bf16 (weights follow the main params)
  lora        LoRA SFT on the tiny base (tiny_llama_lora, one rank): trains, only adapters and the
              modules_to_save are checkpointed, the loss falls
  fsdp_zero3  Megatron-FSDP zero3 SFT from the base with a save and an evaluation mid-run: the losses and
              the validation loss match megatron DDP's run of the same steps within 2%
  packed_sft  that DDP run: packed SFT (THD on Transformer Engine, the local spec's block mask on the
              CPU lane) from the base, the loss falls
  moe         a tiny MoE with MLA and one MTP layer (grouped GEMM where TE runs): trains, the loss falls
  fp8         (TE, compute capability >= 8.9) FP8 current scaling: mean loss over the last 10 of 60 steps
              within 2% of bf16's (published FP8 recipes track bf16 to well under 1%)
  fp8_gather  (TE, cc >= 8.9) fp8_param_gather from the pretrained base: the losses of the first 5 steps
              stay at the base's level (within a quarter of the way back to the random-init loss)
  fp16        (GPU) fp16 with dynamic loss scaling learns like bf16: its loss drop over 60 steps is at
              least 80% of bf16's
  overlap     overlap_grad_reduce + overlap_param_gather: a checkpoint saved mid-run (step 3 of 5) is
              bit-identical to the one saved without the overlaps (one GPU: DP=1, so this proves the
              code path and the forced sync run on CUDA; the DP=2 case is a CPU-lane test)

Bit-for-bit comparisons (sft_keeps, overlap) run with train.deterministic=true (megatron-core's
deterministic_mode), NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO set and
torch.use_deterministic_algorithms on, as Megatron-LM's --deterministic-mode asks.
GPU_CHECK_SMALL=1 runs the same logic on the CPU lane at toy sizes; checks that need CUDA/TE say SKIP.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import train_support as ts  # noqa: E402  (checkpoint readers shared with the CPU-lane tests)

SMALL = bool(os.environ.get("GPU_CHECK_SMALL"))  # a dry run of the checks' logic on the CPU lane (no GPU)
FP8_TOLERANCE = 0.02
MATCH_TOLERANCE = 0.02
COMMON = [
    "cluster=h200_8gpu", "cluster.gpus_per_node=1", "parallel=none", "precision=bf16", "checkpoint.load=none",
    "logging.log_interval=1", "logging.eval_interval=100000", "logging.eval_iters=0", "logging.plot=false",
    "logging.tensorboard=false",
]
TINY = ["train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=32"]
SFT = ["train.seq_length=512", "train.micro_batch_size=1", "train.global_batch_size=8"]  # packed rows: THD wants mbs 1
if SMALL:
    CORPUS = ["data.builtin_max_files=80", "data.builtin_vocab_size=600"]
    TINY = ["train.seq_length=32", "train.micro_batch_size=4", "train.global_batch_size=8", *CORPUS]
    SFT = ["train.seq_length=128", "train.micro_batch_size=1", "train.global_batch_size=2", *CORPUS]
WARM = "optimizer.lr_warmup_iters=5"
CONSTANT = ["optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant"]
ONE_B = [
    "model.name=llama_1b_check", "model.num_layers=16", "model.hidden_size=2048", "model.num_attention_heads=32",
    "model.num_query_groups=8", "model.ffn_hidden_size=8192", "model.max_position_embeddings=2048",
    "train.seq_length=2048", "train.micro_batch_size=4", "train.global_batch_size=32",
    "optimizer.lr=3.0e-4", "optimizer.min_lr=3.0e-5", "optimizer.lr_warmup_iters=5",
]
MLA = ["model.multi_latent_attention=true", "model.qk_layernorm=true", "model.q_lora_rank=32", "model.kv_lora_rank=32",
       "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.num_query_groups=4"]
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
# the trainer's entry with torch's deterministic kernels on (warn_only: an op without one is named in the log)
DETERMINISTIC_ENTRY = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
                       "from megatron_recipes.train import main; sys.exit(main())")
Row = Tuple[str, str, str]


class Run:
    def __init__(self, path: Path, records: List[Dict], meta: Dict):
        self.path, self.meta, self.records = path, meta, records
        self.losses = [r["loss"] for r in records if "loss" in r]
        self.val_losses = [r["val_loss"] for r in records if isinstance(r.get("val_loss"), (int, float))]

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"


class Work:
    def __init__(self, root: Path):
        self.root = root
        self.cache: Dict[str, Run] = {}

    def train(self, name: str, *overrides: str, recipe: str = "tiny_llama_cpu", deterministic: bool = False) -> Run:
        if name in self.cache:  # runs shared by several checks (the base, bf16 over 60 steps) run once
            return self.cache[name]
        run_dir = self.root / name
        entry = ["-c", DETERMINISTIC_ENTRY] if deterministic else ["-m", "megatron_recipes.train"]
        cmd = [sys.executable, *entry, recipe, f"run.dir={run_dir}", f"data.cache_dir={self.root / 'cache'}",
               *COMMON, *overrides, *(["train.deterministic=true"] if deterministic else [])]
        env = {**os.environ, **DETERMINISTIC_ENV} if deterministic else None
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        (self.root / f"{name}.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"run {name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2500:]}")
        log = run_dir / "log.jsonl"
        meta = next(json.loads(ln)["metadata"] for ln in log.read_text().splitlines() if '"METADATA"' in ln)
        self.cache[name] = Run(run_dir, [r["data"] for r in ts.step_records(log)], meta)
        return self.cache[name]

    def base(self) -> Run:
        """The pretrained tiny Llama (bf16) every fine-tuning check starts from."""
        return self.train("base", "seed=7", f"train.train_iters={10 if SMALL else 20}", WARM, *TINY)

    def bf16_60(self) -> Run:
        return self.train("bf16_60", "train.train_iters=60", "checkpoint.save=false", WARM, *TINY)


def _machine():
    from megatron_recipes.models import capabilities

    return capabilities.detect()


def _needs_fp8() -> Optional[str]:
    m = _machine()
    if not m.transformer_engine or m.compute_capability < (8, 9):
        return f"needs Transformer Engine and compute capability >= 8.9 (TE {m.transformer_engine}, cc {m.compute_capability})"
    return None


def _falls(losses: List[float], by: float = 0.0) -> bool:
    return len(losses) >= 4 and statistics.mean(losses[-3:]) < losses[0] - by


def check_stack(work: Work) -> Row:
    import torch

    if not torch.cuda.is_available():
        return ("stack", "SKIP" if SMALL else "FAIL", "no CUDA device: this check is for a GPU machine")
    from megatron_recipes.models import capabilities

    meta = work.train("stack", "train.train_iters=2", "optimizer.lr_warmup_iters=1", "checkpoint.save=false", *TINY).meta
    expected = "transformer_engine" if capabilities.detect().transformer_engine else "local"
    detail = f"{torch.cuda.get_device_name()}; {json.dumps(meta['versions'])}; spec {meta['layer_spec']} (expected {expected})"
    return ("stack", "PASS" if meta["layer_spec"] == expected else "FAIL", detail)


def check_throughput(work: Work, name: str, overrides: List[str], steps: int) -> Row:
    if name == "1b" and SMALL:
        return (name, "SKIP", "GPU_CHECK_SMALL: a 1B model is not a CPU-lane size")
    run = work.train(name, f"train.train_iters={steps}", "checkpoint.save=false", *overrides)
    recs = [r for r in run.records if "loss" in r][3:]  # warm-up steps (compilation, allocator growth)
    med = lambda k: statistics.median(r[k] for r in recs)  # noqa: E731
    mfu = med("mfu")
    detail = (f"{run.meta['params_on_rank0'] / 1e6:.0f}M params: {med('tokens_per_sec'):,.0f} tokens/s, "
              f"{med('step_time_s') * 1e3:.1f} ms/step, MFU {mfu:.1%}, peak {max(r['peak_mem_gib'] for r in recs):.1f} GiB, "
              f"final loss {recs[-1]['loss']:.3f}; fusions {sorted(k for k, v in run.meta['fusions'].items() if v)}")
    return (name, "PASS" if mfu > 0 else "FAIL", detail)


def check_sft_keeps_weights(work: Work) -> Row:
    """One Adam step at a representable lr: main params = checkpoint weights +- lr, weights = bf16(main)."""
    import torch

    lr = 1e-5
    base = work.base()
    sft = work.train("sft_keeps", f"checkpoint.pretrained={base.checkpoints}", "train.train_iters=1",
                     f"optimizer.lr={lr}", f"optimizer.min_lr={lr}", "optimizer.weight_decay=0.0", *CONSTANT, *TINY,
                     deterministic=True)
    a = ts.stored_tensors(max(base.checkpoints.glob("iter_*")))
    b = ts.stored_tensors(sft.checkpoints / "iter_0000001")
    weights = [k for k in a if not k.startswith("optimizer.")]
    too_far, unmoved, not_rounded = [], [], []
    for k in weights:
        start, main = a[k].double(), b[f"optimizer.state.param.{k}"].double()
        moved = (main - start).abs()
        ulp = torch.finfo(torch.float32).eps * start.abs()  # fp32 rounding of the stored main param
        if bool((moved > lr * 1.01 + ulp).any()):
            too_far.append(f"{k} ({moved.max().item():.2e})")
        if not bool((moved > 0.5 * lr).any()):
            unmoved.append(k)
        if not b[k].equal(b[f"optimizer.state.param.{k}"].to(b[k].dtype)):
            not_rounded.append(k)
    ok = weights and not (too_far or unmoved or not_rounded)
    return ("sft_keeps", "PASS" if ok else "FAIL",
            f"{len(weights)} tensors, lr {lr:g}: moved more than lr {too_far[:3]}, did not move {unmoved[:3]}, "
            f"weight != bf16(main param) {not_rounded[:3]}")


def check_lora(work: Work) -> Row:
    base = work.base()
    run = work.train("lora", f"checkpoint.pretrained={base.checkpoints}", "train.train_iters=12",
                     "checkpoint.save_interval=12", "optimizer.lr_warmup_iters=2", *SFT, recipe="tiny_llama_lora")
    saved = [k for k in ts.stored_tensors(run.checkpoints / "iter_0000012") if not k.startswith("optimizer.")]
    base_only = [k for k in saved if "lora" not in k.lower() and "adapter" not in k.lower() and "output_layer" not in k]
    ok = _falls(run.losses) and saved and not base_only
    return ("lora", "PASS" if ok else "FAIL",
            f"loss {run.losses[0]:.3f} -> {statistics.mean(run.losses[-3:]):.3f} (last 3); {len(saved)} tensors saved, "
            f"frozen base tensors among them {base_only[:3]}")


def _sft_pair(work: Work) -> Tuple[Run, Run]:
    base = work.base()
    args = [f"checkpoint.pretrained={base.checkpoints}", "train.train_iters=6", "checkpoint.save_interval=3",
            "logging.eval_interval=3", "logging.eval_iters=1", "optimizer.lr_warmup_iters=1", *SFT]
    ddp = work.train("sft_ddp", *args, recipe="tiny_llama_sft")
    fsdp = work.train("sft_fsdp", *args, "parallel.fsdp=true", "parallel.sharding=zero3", recipe="tiny_llama_sft_fsdp")
    return ddp, fsdp


def _rel(a: List[float], b: List[float]) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf")) if len(a) == len(b) else float("inf")


def check_fsdp(work: Work) -> Row:
    ddp, fsdp = _sft_pair(work)
    saved = sorted(p.name for p in fsdp.checkpoints.glob("iter_*"))
    loss_rel, val_rel = _rel(fsdp.losses, ddp.losses), _rel(fsdp.val_losses, ddp.val_losses)
    ok = "iter_0000003" in saved and len(fsdp.val_losses) >= 2 and loss_rel <= MATCH_TOLERANCE and val_rel <= MATCH_TOLERANCE
    return ("fsdp_zero3", "PASS" if ok else "FAIL",
            f"saved {saved}; {len(fsdp.val_losses)} evaluations; vs DDP: losses within {loss_rel:.2%}, "
            f"val_loss within {val_rel:.2%} (limit {MATCH_TOLERANCE:.0%})")


def check_packed(work: Work) -> Row:
    ddp, _ = _sft_pair(work)
    how = "THD (Transformer Engine)" if ddp.meta["layer_spec"] == "transformer_engine" else "block mask (local spec)"
    return ("packed_sft", "PASS" if _falls(ddp.losses) else "FAIL",
            f"{how}: loss {ddp.losses[0]:.3f} -> {statistics.mean(ddp.losses[-3:]):.3f} (last 3 of {len(ddp.losses)})")


def check_moe(work: Work) -> Row:
    run = work.train("moe", "model=tiny_moe", *MLA, "model.mtp_num_layers=1", "train.train_iters=20",
                     "checkpoint.save=false", WARM, *TINY)
    grouped = "grouped GEMM" if run.meta["layer_spec"] == "transformer_engine" else "sequential experts (local spec)"
    return ("moe", "PASS" if _falls(run.losses, by=0.3) else "FAIL",
            f"MoE 4x top-2 + MLA + MTP, {grouped}: loss {run.losses[0]:.3f} -> {statistics.mean(run.losses[-3:]):.3f} (last 3 of 20)")


def check_fp8(work: Work) -> Row:
    why = _needs_fp8()
    if why:
        return ("fp8", "SKIP", why)
    bf16 = statistics.mean(work.bf16_60().losses[-10:])
    fp8 = statistics.mean(work.train("fp8_60", "precision=fp8_tensorwise", "train.train_iters=60", "checkpoint.save=false",
                                     WARM, *TINY).losses[-10:])
    rel = abs(fp8 - bf16) / bf16
    return ("fp8", "PASS" if rel <= FP8_TOLERANCE else "FAIL",
            f"mean loss of steps 51-60: bf16 {bf16:.4f}, fp8 {fp8:.4f}, relative {rel:.2%} (limit {FP8_TOLERANCE:.0%})")


def check_fp8_param_gather(work: Work) -> Row:
    why = _needs_fp8()
    if why:
        return ("fp8_gather", "SKIP", why)
    base = work.base()
    random_init, trained = base.losses[0], base.losses[-1]
    run = work.train("fp8_gather", f"checkpoint.pretrained={base.checkpoints}", "precision=fp8_tensorwise",
                     "precision.fp8_param_gather=true", "optimizer.use_distributed_optimizer=true", "train.train_iters=5",
                     "checkpoint.save=false", "optimizer.lr=1e-4", "optimizer.min_lr=1e-4", *CONSTANT, *TINY)
    limit = trained + 0.25 * (random_init - trained)
    ok = max(run.losses) <= limit
    return ("fp8_gather", "PASS" if ok else "FAIL",
            f"base: random init {random_init:.3f} -> trained {trained:.3f}; fp8_param_gather steps 1-5 "
            f"{[round(x, 3) for x in run.losses]} (limit {limit:.3f})")


def check_fp16(work: Work) -> Row:
    if not _machine().cuda:
        return ("fp16", "SKIP", "fp16 parameters need a GPU (rule machine.fp16_needs_gpu)")
    bf16 = work.bf16_60().losses
    fp16 = work.train("fp16_60", "precision.params_dtype=fp16", "train.train_iters=60", "checkpoint.save=false",
                      WARM, *TINY).losses
    drop = lambda ls: ls[0] - statistics.mean(ls[-10:])  # noqa: E731
    ratio = drop(fp16) / drop(bf16)
    return ("fp16", "PASS" if ratio >= 0.8 else "FAIL",
            f"loss drop over 60 steps: bf16 {drop(bf16):.3f}, fp16 {drop(fp16):.3f} ({ratio:.0%} of bf16's; at least 80%)")


def check_overlap(work: Work) -> Row:
    tensors = []
    for flag in ("false", "true"):
        run = work.train(f"overlap_{flag}", "train.train_iters=5", "checkpoint.save_interval=3",
                         "optimizer.use_distributed_optimizer=true", f"parallel.overlap_grad_reduce={flag}",
                         f"parallel.overlap_param_gather={flag}", "optimizer.lr_warmup_iters=1", *TINY, deterministic=True)
        tensors.append(ts.stored_tensors(run.checkpoints / "iter_0000003"))
    differ = ts.differing_tensors(*tensors)
    return ("overlap", "FAIL" if differ else "PASS", f"{len(differ)} of {len(tensors[0])} tensors differ {differ[:3]}")


def main() -> int:
    root = Path(os.environ.get("WORK") or tempfile.mkdtemp(prefix="gpu_check-"))
    root.mkdir(parents=True, exist_ok=True)
    work = Work(root)
    steps_tiny, steps_1b = int(os.environ.get("STEPS_TINY", 10 if SMALL else 40)), int(os.environ.get("STEPS_1B", 30))
    checks = [
        ("stack", lambda: check_stack(work)),
        ("tiny", lambda: check_throughput(work, "tiny", [*TINY, WARM], steps_tiny)),
        ("1b", lambda: check_throughput(work, "1b", ONE_B, steps_1b)),
        ("sft_keeps", lambda: check_sft_keeps_weights(work)),
        ("lora", lambda: check_lora(work)),
        ("fsdp_zero3", lambda: check_fsdp(work)),
        ("packed_sft", lambda: check_packed(work)),
        ("moe", lambda: check_moe(work)),
        ("fp8", lambda: check_fp8(work)),
        ("fp8_gather", lambda: check_fp8_param_gather(work)),
        ("fp16", lambda: check_fp16(work)),
        ("overlap", lambda: check_overlap(work)),
    ]
    only = [c for c in os.environ.get("ONLY", "").split(",") if c]
    rows: List[Row] = []
    started = time.monotonic()
    for name, fn in checks:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            rows.append(fn())
        except Exception as exc:  # a crash is a failure, shown in the table with its cause
            traceback.print_exc()
            rows.append((name, "FAIL", f"{type(exc).__name__}: {str(exc)[-600:]}"))
        print(f"{rows[-1][0]}: {rows[-1][1]} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\n{'check':<11} {'result':<6} detail")
    for name, result, detail in rows:
        print(f"{name:<11} {result:<6} {detail}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps([dict(zip(("check", "result", "detail"), r)) for r in rows], indent=2))
    print(f"\n{time.monotonic() - started:.0f} s in all; logs: {root}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
