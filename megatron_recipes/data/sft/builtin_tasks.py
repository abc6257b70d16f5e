"""A built-in chat data set with checkable answers: fine-tuning with no file to write and no download.

``data.sft_path=builtin`` selects it. Each record is one user question and one short assistant answer from
a few generated task families (parity of a number, the larger of two numbers, the letter after a letter,
repeating a word). Answers are exact strings, so the trainer measures task accuracy on the validation
split (an answer counts as right when greedy decoding would produce it: every answer token is the model's
most likely one, here checked as probability > 1/2). Deterministic: same seed, same files; written once
into the data cache like the built-in corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_recipes.data import artifact_cache as cache

BUILTIN = "builtin"
FORMAT_VERSION = 1
TRAIN_SAMPLES, VALID_SAMPLES = 4000, 256
_WORDS = ("apple", "river", "stone", "cloud", "green", "tiger", "music", "light", "paper", "house", "water",
          "table", "dream", "night", "chair", "plant", "bread", "smile", "ocean", "train")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _task(rng: random.Random) -> Tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        n = rng.randrange(10, 10000)
        return f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd"
    if kind == 1:
        a, b = rng.sample(range(10, 100), 2)
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    if kind == 2:
        i = rng.randrange(len(_LETTERS) - 1)
        return f"Which letter comes after {_LETTERS[i]}?", _LETTERS[i + 1]
    word = rng.choice(_WORDS)
    return f"Repeat the word {word}.", word


def records(seed: int, count: int) -> List[Dict]:
    """``count`` chat records ({"messages": [user, assistant]}) from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, answer = _task(rng)
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
