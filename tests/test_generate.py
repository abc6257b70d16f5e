"""``megatron-recipes generate`` against transformers' ``generate`` on the exported HF model, token for token.

A tiny random HF model (tests/convert_support.py) with the small built-in tokenizer is imported, exported
again (the HF model a user would run), and generated from through the real command (its own torchrun
ranks, gloo on the CPU lane) at several layouts: greedy, 64 new tokens, prompts of different lengths in
one batch. Both sides run in float32; the reference stops at the same end tokens.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from convert_support import make_hf_model
from data_support import small_builtin, write_jsonl

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Parser:\n    def __init__(self, path):", "x ="]
NEW_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _hf_with_tokenizer(folder: Path, family: str, tokenizer_dir: Path) -> Path:
    make_hf_model(family, folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def llama_models(shared_runs, data_cache) -> Dict[str, Path]:
    """Imported checkpoint (``ckpt``) and its export (``hf``) of one tiny Llama with a real tokenizer."""

    def make():
        from megatron_recipes.config.schema import ParallelConfig
        from megatron_recipes.convert.exporter import run_export
        from megatron_recipes.convert.importer import run_import

        root = shared_runs.folder("generate-llama")
        source = _hf_with_tokenizer(root / "source", "llama", Path(small_builtin(data_cache).tokenizer_dir))
        run_import(source, root / "ckpt", ParallelConfig(), dtype="fp32", progress=False)
        run_export(root / "ckpt", root / "hf", progress=False)
        return {"ckpt": root / "ckpt", "hf": root / "hf", "root": root}

    return shared_runs.get("generate-llama", make)


def generate_cli(ckpt: Path, *args: str, timeout: float = 900) -> List[dict]:
    """The command as a user runs it; its --json records."""
    command = [sys.executable, "-m", "megatron_recipes.cli", "generate", str(ckpt), *args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def hf_greedy(hf_dir: Path, prompts: List[str], new_tokens: int) -> List[List[int]]:
    """transformers' greedy generate, one prompt at a time, cut before its first end token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    stops = sorted({tokenizer.eos_token_id, model.generation_config.eos_token_id} - {None})
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        generated = full[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(generated) if t in stops), len(generated))
        out.append(generated[:cut])
    return out


@pytest.fixture(scope="session")
def llama_reference(llama_models) -> List[List[int]]:
    return hf_greedy(llama_models["hf"], PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("layout", [["parallel.tp=1"], ["parallel.tp=2"]], ids=["tp1", "tp2"])
def test_greedy_generate_is_token_identical_to_transformers(llama_models, llama_reference, layout, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    records = generate_cli(llama_models["ckpt"], f"prompts={prompts}", f"max_new_tokens={NEW_TOKENS}", *layout)
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == llama_reference
    assert all(len(r["tokens"]) == NEW_TOKENS or r["finish_reason"] == "stop" for r in records)
