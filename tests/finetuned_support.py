"""README's order in miniature, shared by the modules that need a fine-tuned run: a short main job, then
``tiny_llama_lora`` with no data or checkpoint argument (its defaults find both). The LoRA run trains its
LM head whole (``peft.modules_to_save``), renders the built-in chat tasks with chatml on the built-in
tokenizer and logs task accuracy: what the export, generate and eval tests read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import train_support as ts

SMALL = ["data.builtin_max_files=80", "data.builtin_vocab_size=600", "model.vocab_size=640"]


@dataclass
class FineTuned:
    root: Path  # the folder the runs were started from (runs/tiny_llama_cpu lies under it)
    cache: Path  # their data cache (the built-in corpus, tokenizer and chat tasks)
    base: ts.Run
    lora: ts.Run


def readme_lora(shared_runs) -> FineTuned:
    def make() -> FineTuned:
        tmp = shared_runs.folder("readme-lora")
        cache, work = tmp / "cache", tmp / "work"
        # ts.train runs each job from its run dir's parent: the LoRA run's folder is tmp/work, where the
        # recipe's default checkpoint.pretrained=runs/tiny_llama_cpu/checkpoints must then be found
        base = ts.train(work / "runs" / "tiny_llama_cpu", cache, "train.train_iters=30", "logging.plot=false",
                        "logging.tensorboard=false", *SMALL, nproc=2).check()
        lora = ts.train(work / "lora", cache, *SMALL, "logging.plot=false", "logging.tensorboard=false",
                        nproc=2, recipe="tiny_llama_lora").check()
        return FineTuned(work, cache, base, lora)

    return shared_runs.get("readme-lora", make)


def _convert(cwd: str, *args: str) -> dict:
    """``convert`` in a child process (it opens its own process group), from the folder the runs were
    started in (the LoRA recipe names its base relative to it); the rendered error, if any."""
    import os

    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.convert.cli import main

    os.chdir(cwd)
    try:
        return {"code": main(list(args)), "error": None}
    except RecipeError as exc:
        return {"code": 2, "error": exc.render()}


def convert(run: FineTuned, *args: str) -> dict:
    import peft_support as ps

    return ps.run_ranks(1, _convert, str(run.root), *args)[0]


def eval_cli(run: FineTuned, target, *args: str) -> dict:
    """``megatron-recipes eval <target> ... --json`` as a user runs it (its own process, forked:
    tests/cli_support.py), from the runs' folder; its record."""
    import json

    from cli_support import run_cli

    done = run_cli(["eval", str(target), *args, "--json"], timeout=600, cwd=str(run.root))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def merged_export(shared_runs) -> Path:
    """The LoRA run exported as a merged HF model (the CLI checks its logits against the trained model)."""
    run = readme_lora(shared_runs)

    def make() -> Path:
        out = shared_runs.folder("readme-lora-merged") / "hf"
        done = convert(run, "export", f"ckpt_dir={run.lora.run_dir}", f"hf_dir={out}", "--quiet", "--verify")
        assert done == {"code": 0, "error": None}, done
        return out

    return shared_runs.get("readme-lora-merged", make)


def hf_answers(folder: Path, questions, max_new_tokens: int = 32):
    """transformers as a user (or lm-eval's hf model) runs the export: its chat template, greedy, the stops of
    its generation_config alone (no tokenizer handed to generate); the new ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(full[0, ids.shape[1]:].tolist())
    return answers
