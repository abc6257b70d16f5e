"""Generation throughput: ``megatron-recipes generate``'s engine against transformers' ``generate`` on the
same model, side by side in one run (CPU lane: for the record, there is no target on CPU).

    python benchmarks/generate.py [--workdir DIR] [--layers 8] [--hidden 512] [--batch 8] [--new-tokens 64]

Builds a random Llama with transformers (float32), imports it with ``convert import`` (TP=1), then in a
fresh process each: megatron-core's static inference engine on the imported checkpoint
(``generate.engine.generate_ids``: its KV cache, greedy) and transformers' greedy ``generate`` (KV cache,
left-padded batch) on the HF folder. The same random prompts of different lengths, every row generating
exactly ``--new-tokens`` tokens (no stop token). Reports generated tokens per second of the generation
call alone (the model already loaded), the ratio, and whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 32000


def build_model(folder: Path, layers: int, hidden: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def prompts(batch: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (16 + 7 * i,), generator=g).tolist() for i in range(batch)]


def ours(ckpt: str, batch: int, new_tokens: int) -> dict:
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.generate.engine import Job, Sampling, generate_ids, model_for
    from megatron_recipes.runtime import patches
    from megatron_recipes.runtime.distributed import shutdown

    patches.apply("process")
    rows = prompts(batch)
    job = Job(ckpt, ParallelConfig(), "fp32", rows, Sampling(new_tokens, 0.0, 0, 0.0, 1234), -1, batch)
    loaded = model_for(ckpt, ParallelConfig(), "fp32")
    start = time.perf_counter()
    out = generate_ids(job, None, loaded=loaded)
    seconds = time.perf_counter() - start
    shutdown()
    return {"seconds": seconds, "tokens": out}


def theirs(hf: str, batch: int, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, trust_remote_code=False).eval()
    rows = prompts(batch)
    width = max(len(r) for r in rows)
    ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding, as batched decoder-only generation needs
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    start = time.perf_counter()
    with torch.no_grad():
        full = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": full[:, width:].tolist()}


def _phase(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--phase", nargs=4, metavar=("KIND", "PATH", "BATCH", "NEW"))
    args = parser.parse_args()
    if args.phase:
        kind, path, batch, new = args.phase
        print(json.dumps((ours if kind == "ours" else theirs)(path, int(batch), int(new))))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="generate-bench-"))
    hf, ckpt = work / "hf", work / "ckpt"
    try:
        if not (hf / "config.json").is_file():
            params = build_model(hf, args.layers, args.hidden)
            print(f"built a random Llama: {params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}")
        if not ckpt.is_dir():
            from megatron_recipes.config.schema import ParallelConfig
            from megatron_recipes.convert.importer import run_import

            run_import(hf, ckpt, ParallelConfig(), progress=False)
        size = (str(args.batch), str(args.new_tokens))
        mine, other = _phase("ours", str(ckpt), *size), _phase("theirs", str(hf), *size)
        generated = args.batch * args.new_tokens
        print(f"\n{'':<46} {'seconds':>8} {'tokens/s':>9}")
        for name, r in (("megatron-recipes generate (megatron-core engine)", mine), ("transformers generate", other)):
            print(f"{name:<46} {r['seconds']:>8.2f} {generated / r['seconds']:>9.1f}")
        print(f"\nratio (ours / transformers): {other['seconds'] / mine['seconds']:.2f}x tokens/s; "
              f"{args.batch} prompts of 16-{16 + 7 * (args.batch - 1)} tokens, {args.new_tokens} new tokens each, greedy, float32")
        same = sum(a == b for a, b in zip(mine["tokens"], other["tokens"]))
        print(f"same tokens as transformers: {same} of {args.batch} rows")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
