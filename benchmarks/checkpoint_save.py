"""What a checkpoint save costs the training loop: synchronous against asynchronous, for both optimizer formats.

    python benchmarks/checkpoint_save.py [steps=12] [save_interval=3] [nproc=2]

Runs ``megatron-recipes train tiny_llama_cpu`` four times in this one run, on a model of ~10M parameters
(a save writes ~150 MB over two DP ranks with the distributed optimizer): ``checkpoint.async_save`` off
and on, ``checkpoint.optimizer_format`` fully_reshardable (DP rank 0 gathers the optimizer state) and
dp_reshardable (each rank writes its own shard). Prints, side by side, the seconds the training loop was
blocked per save (the trainer's own count: time in ``save`` plus waiting for a background save; printed
at the end of each run), the run's wall time, and the peak resident memory of the largest process
(``getrusage`` of the run's processes: a rank, or a forked writer). On the CPU lane the
async writer forks per save, which costs more than it hides for writes this small; the figures are for
the record, the point of async saving is a cluster's minutes-long writes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model.num_layers=4", "model.hidden_size=384", "model.num_attention_heads=6", "model.num_query_groups=2",
         "model.ffn_hidden_size=1152", "model.vocab_size=4096"]
SMALL = ["train.seq_length=64", "train.global_batch_size=8", "train.micro_batch_size=2", "logging.eval_interval=1000",
         "logging.eval_iters=0", "logging.plot=false", "logging.tensorboard=false", "precision=fp32"]
# the run under a small parent whose getrusage(children) is this run's alone: the largest process's peak RSS
_PEAK = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
         "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")
BLOCKED = re.compile(r"checkpoint saves: (\d+) written .*?blocked ([0-9.]+) s by them \(([0-9.]+) s per save\)")


def _run(tmp: Path, name: str, steps: int, interval: int, nproc: int, extra: list) -> dict:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "megatron_recipes.train", "tiny_llama_cpu", f"run.dir={run_dir}",
           f"cluster.gpus_per_node={nproc}", f"cluster.nvlink_domain={nproc}", "parallel.tp=1", "parallel.pp=1",
           f"train.train_iters={steps}", f"checkpoint.save_interval={interval}", "checkpoint.keep_last=2",
           *MODEL, *SMALL, *extra]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd[1:]]
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - began
    peak = re.search(r"PEAK_KB (\d+)", proc.stderr)
    peak_mb = int(peak.group(1)) / 1024 if peak else float("nan")
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    found = BLOCKED.search(proc.stdout + proc.stderr)
    if found is None:
        raise SystemExit(f"{name}: the trainer printed no save summary:\n{proc.stdout[-3000:]}")
    return {"saves": int(found.group(1)), "blocked_s": float(found.group(2)), "per_save_s": float(found.group(3)),
            "wall_s": wall, "peak_mb": peak_mb}


def main(argv: list) -> int:
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    steps, interval, nproc = int(opts.get("steps", 12)), int(opts.get("save_interval", 3)), int(opts.get("nproc", 2))
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        for fmt in ("fully_reshardable", "dp_reshardable"):
            for asynchronous in (False, True):
                name = f"{fmt}-{'async' if asynchronous else 'sync'}"
                extra = [f"checkpoint.optimizer_format={fmt}", f"checkpoint.async_save={str(asynchronous).lower()}"]
                rows.append((fmt, asynchronous, _run(Path(tmp), name, steps, interval, nproc, extra)))
                print(f"  ran {name}", flush=True)
    print(f"\n{steps} steps, a save every {interval}, {nproc} ranks (DP={nproc}, distributed optimizer), ~10M parameters")
    print(f"{'optimizer format':<20}{'save':<8}{'saves':>6}{'blocked/save s':>16}{'blocked s':>11}{'wall s':>9}{'peak RSS MB*':>14}")
    for fmt, asynchronous, r in rows:
        print(f"{fmt:<20}{'async' if asynchronous else 'sync':<8}{r['saves']:>6}{r['per_save_s']:>16.3f}{r['blocked_s']:>11.2f}"
              f"{r['wall_s']:>9.1f}{r['peak_mb']:>14.0f}")
    for fmt in ("fully_reshardable", "dp_reshardable"):
        sync, asyn = (r for f, _, r in rows if f == fmt)
        print(f"{fmt}: async/sync blocked time per save = {asyn['per_save_s'] / max(sync['per_save_s'], 1e-9):.2f}")
    print("* the largest single process of that run (a rank, or a forked writer), getrusage of its children")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
