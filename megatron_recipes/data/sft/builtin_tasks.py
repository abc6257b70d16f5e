"""A built-in chat data set with checkable answers: fine-tuning with no file to write and no download.

``data.sft_path=builtin`` selects it. Each record asks for the type of a Python literal and the assistant
answers with one word (``What type is [3, 'node']?`` -> ``list``): six types (int, float, str, list,
tuple, dict), equally likely, each worded three ways, so a constant guess is right 1/6 of the time and the
strict metric below scores it 0. The answer is Python's own ``type(ast.literal_eval(x)).__name__``
(tested), and the split is honest: validation literals are never training literals (a hash of the
literal picks its split), so a right validation answer means the rule was learned, not the example.
Why this task: the tiny base after README's main job (1.84M parameters, 300 steps of Python source) could
not carry an arbitrary word across the chat template's tokens (measured when the built-in tokenizer spelled
each turn marker in 7 tokens: repeat-a-word and opposite-of-a-word tasks stayed at 0.0% through 300 LoRA
steps), but it does see which kinds of tokens a literal is made of (quotes, brackets, braces, a decimal
point), which is what this task needs.
The trainer measures task accuracy on the validation split (an answer counts as right when greedy
decoding would produce it: every answer token is the model's most likely one, checked as probability
> 1/2). Deterministic: same seed, same files; cached under a key of the generated content, so a changed
generator never reuses stale files.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_recipes.data import artifact_cache as cache

BUILTIN = "builtin"
TRAIN_SAMPLES, VALID_SAMPLES = 4000, 512
TYPES = ("int", "float", "str", "list", "tuple", "dict")
# identifiers common in Python source (the main job's corpus); none is a type name
WORDS = ("name", "value", "path", "data", "key", "item", "line", "text", "file", "node", "mode", "base",
         "state", "label", "token", "size", "count", "index")
WORDINGS = ("What is type({})?", "What type is {}?", "Name the type of {}")


def _atom(rng: random.Random) -> str:
    return str(rng.randrange(100)) if rng.random() < 0.5 else repr(rng.choice(WORDS))


def literal(kind: str, rng: random.Random) -> str:
    """A random Python literal of type ``kind``, written as in source code."""
    if kind == "int":
        return str(rng.randrange(-50, 10000))
    if kind == "float":
        return f"{rng.randrange(1000)}.{rng.randrange(1, 100)}"
    if kind == "str":
        word = rng.choice(WORDS)
        return repr(word) if rng.random() < 0.5 else f'"{word}"'
    if kind == "list":
        return "[" + ", ".join(_atom(rng) for _ in range(rng.randrange(1, 4))) + "]"
    if kind == "tuple":
        items = [_atom(rng) for _ in range(rng.randrange(1, 4))]
        return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    return "{" + ", ".join(f"{rng.choice(WORDS)!r}: {_atom(rng)}" for _ in range(rng.randrange(1, 3))) + "}"


def in_validation(text: str) -> bool:
    """A literal's split, from its text: one in four literals is validation-only."""
    return zlib.crc32(text.encode("utf-8")) % 4 == 0


def _task(rng: random.Random, valid: bool) -> Tuple[str, str]:
    """(question, answer) drawn from the validation or the training literals."""
    kind = rng.choice(TYPES)  # drawn first, so the six answers stay equally likely in both splits
    while True:
        text = literal(kind, rng)
        if in_validation(text) == valid:
            return rng.choice(WORDINGS).format(text), kind


def records(seed: int, count: int, valid: bool = False) -> List[Dict]:
    """``count`` chat records ({"messages": [user, assistant]}) from a generator seeded with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, answer = _task(rng, valid)
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def ensure_files(cache_dir: Optional[str]) -> Tuple[Path, Path]:
    """(train.jsonl, valid.jsonl) of the built-in set, written once into the data cache.

    The generated text is cheap to make, so it is made first and its hash is the cache key: files from an
    older generator are never reused."""
    texts = {
        name: "".join(json.dumps(r) + "\n" for r in records(seed, count, valid=name == "valid"))
        for name, seed, count in (("train", 1, TRAIN_SAMPLES), ("valid", 2, VALID_SAMPLES))
    }
    digest = {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in texts.items()}
    final = cache.cache_root(cache_dir) / "sft_builtin" / cache.content_key(digest)

    def build(tmp: Path) -> dict:
        for name, text in texts.items():
            (tmp / f"{name}.jsonl").write_text(text, encoding="utf-8")
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
