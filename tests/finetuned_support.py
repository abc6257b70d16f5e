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
