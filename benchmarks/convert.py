"""Conversion throughput and memory on a ~1B-parameter random Llama (CPU).

    python benchmarks/convert.py [--workdir DIR] [--layers 16] [--keep] [--no-reference]

Builds a Llama-3.2-1B-shaped model with transformers (random bf16 weights, saved as 1 GB shards), then
runs `convert import` (TP=1) and `convert export` each in a fresh process, so every phase starts from a
clean baseline. Reports seconds (the whole phase: config, checks, planning, streaming), MB/s over those
seconds, and peak RSS over the baseline (taken just before streaming) divided by the largest tensor group
(the biggest single megatron tensor: one layer's fused QKV or fc1, or the embedding), the streaming goal
being <= 1.25. Side by side, reading every HF tensor into memory at once shows what a non-streaming
converter holds. The logits check is skipped (--no-verify): this measures conversion only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_model(folder: Path, layers: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder), max_shard_size="1GB")
    return {"parameters": params, "seconds": time.perf_counter() - start}


def phase(kind: str, source: str, target: str) -> dict:
    """One conversion in this (fresh) process; its report as a dict."""
    from megatron_recipes.config.schema import ParallelConfig

    if kind == "import":
        from megatron_recipes.convert.importer import run_import

        r = run_import(Path(source), Path(target), ParallelConfig(), progress=False)
    elif kind == "export":
        from megatron_recipes.convert.exporter import run_export

        r = run_export(Path(source), Path(target), progress=False)
    else:  # the whole-model reference: every HF tensor in memory at once, as a non-streaming converter holds it
        from safetensors.torch import load_file

        from megatron_recipes.convert.memory import PeakRss

        start = time.perf_counter()
        with PeakRss() as peak:
            tensors = {}
            for shard in sorted(Path(source).glob("*.safetensors")):
                tensors.update({k: v.clone() for k, v in load_file(str(shard)).items()})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "streaming_seconds": seconds, "bytes": size, "peak_over_baseline": peak.result.over_baseline}
    return {
        "seconds": r.total_seconds,
        "streaming_seconds": r.seconds,
        "bytes": r.bytes_written,
        "peak_over_baseline": r.peak_rss - r.baseline_rss,
        "largest_group": r.largest_item,
    }


def _run_phase(kind: str, source: Path, target: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--phase", kind, str(source), str(target)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--phase", nargs=3, metavar=("KIND", "SOURCE", "TARGET"))
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(*args.phase)))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    hf, ckpt, out = work / "hf", work / "ckpt", work / "exported"
    for path in (ckpt, out):
        shutil.rmtree(path, ignore_errors=True)
    try:
        if not (hf / "config.json").is_file():
            built = build_model(hf, args.layers)
            print(f"built a {built['parameters'] / 1e9:.2f}B-parameter Llama (bf16) in {built['seconds']:.0f} s", flush=True)
        rows = [("import", _run_phase("import", hf, ckpt)), ("export", _run_phase("export", ckpt, out))]
        if not args.no_reference:
            rows.append(("reference: all HF tensors in memory", _run_phase("reference", hf, out)))
        largest = rows[0][1]["largest_group"]
        print(f"\n{'phase':<38} {'seconds':>8} {'(streaming)':>11} {'GB':>6} {'MB/s':>6} {'peak RSS over baseline':>23} "
              f"{'/ largest group':>16}")
        for name, r in rows:
            rate = r["bytes"] / max(r["seconds"], 1e-9) / 1e6
            ratio = r["peak_over_baseline"] / largest
            print(f"{name:<38} {r['seconds']:>8.1f} {r['streaming_seconds']:>11.1f} {r['bytes'] / 1e9:>6.2f} {rate:>6.0f} "
                  f"{r['peak_over_baseline'] / 2**20:>19.0f} MiB {ratio:>16.2f}")
        print(f"\nlargest tensor group: {largest / 2**20:.0f} MiB (goal: peak over baseline <= 1.25x that)")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
