"""A built-in chat data set with checkable answers: fine-tuning with no file to write and no download.

``data.sft_path=builtin`` selects it. Each record is one user question and one short assistant answer from
a few generated copy-style task families over identifiers common in Python source (the built-in corpus),
each one token of the built-in tokenizer alone and after a space: copy a line ``key = <word>`` or
``key = <word> <word>``, and answer which word a variable holds (``x = .. y = .. z = .. What is y?`` ->
``y = <word>``). Every family has ~44 distinct answers and no class prior (unlike parity), so a constant
guess scores ~2%: a rising accuracy means the copy is learned. Answers are exact strings, so the trainer
measures task accuracy on the validation split (an answer counts as right when greedy decoding would
produce it: every answer token is the model's most likely one, here checked as probability > 1/2).
Deterministic: same seed, same files; written once into the data cache like the built-in corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_recipes.data import artifact_cache as cache

BUILTIN = "builtin"
FORMAT_VERSION = 5
TRAIN_SAMPLES, VALID_SAMPLES = 4000, 256
# single tokens of the built-in tokenizer both alone and after a space (checked when the set was made)
WORDS = ("self", "name", "value", "path", "data", "return", "list", "dict", "type", "key", "item", "line", "text",
         "file", "args", "result", "index", "count", "size", "start", "node", "code", "mode", "base", "module",
         "class", "import", "object", "string", "number", "error", "test", "info", "stream", "buffer", "format",
         "config", "label", "token", "state", "parent", "source", "target", "output")


def _task(rng: random.Random) -> Tuple[str, Optional[str]]:
    """(question, answer); answer None means: the question's second line (copy tasks)."""
    kind = rng.randrange(4)
    if kind == 0:
        return f"Copy this line:\nkey = {rng.choice(WORDS)}", None
    if kind == 1:
        a, b = rng.sample(WORDS, 2)
        return f"Copy this line:\nkey = {a} {b}", None
    # kinds 2 and 3: the variable-lookup family, half of all records
    names = ("x", "y", "z")
    words = rng.sample(WORDS, 3)
    asked = rng.randrange(3)
    question = "\n".join(f"{n} = {w}" for n, w in zip(names, words)) + f"\nWhat is {names[asked]}?"
    return question, f"{names[asked]} = {words[asked]}"


def records(seed: int, count: int) -> List[Dict]:
    """``count`` chat records ({"messages": [user, assistant]}) from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, answer = _task(rng)
        answer = answer or question.split("\n", 1)[1]
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def ensure_files(cache_dir: Optional[str]) -> Tuple[Path, Path]:
    """(train.jsonl, valid.jsonl) of the built-in set, written once into the data cache."""
    final = cache.cache_root(cache_dir) / "sft_builtin" / cache.content_key(
        {"format_version": FORMAT_VERSION, "train": TRAIN_SAMPLES, "valid": VALID_SAMPLES}
    )

    def build(tmp: Path) -> dict:
        for name, seed, count in (("train", 1, TRAIN_SAMPLES), ("valid", 2, VALID_SAMPLES)):
            lines = "".join(json.dumps(r) + "\n" for r in records(seed, count))
            (tmp / f"{name}.jsonl").write_text(lines, encoding="utf-8")
        return {"train": TRAIN_SAMPLES, "valid": VALID_SAMPLES}

    cache.build_once(final, build)
    return final / "train.jsonl", final / "valid.jsonl"


def resolve_paths(sft_path: Optional[str], sft_valid_path: Optional[str], cache_dir: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """The JSONL files a recipe names; ``builtin`` becomes the generated set (valid split included)."""
    if sft_path != BUILTIN and sft_valid_path != BUILTIN:
        return sft_path, sft_valid_path
    train, valid = ensure_files(cache_dir)
    train_path = str(train) if sft_path == BUILTIN else sft_path
    # the built-in set brings its own validation split, unless the recipe names another file
    use_valid = sft_valid_path == BUILTIN or (sft_valid_path is None and sft_path == BUILTIN)
    return train_path, str(valid) if use_valid else sft_valid_path
