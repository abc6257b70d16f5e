"""A built-in chat data set with checkable answers: fine-tuning with no file to write and no download.

``data.sft_path=builtin`` selects it. Each record is one user question and a one-word assistant answer
that depends on the one content word of the question (one attention step finds it, the head names the
answer; the tiny base after the main job does not learn that step in 100 steps yet, see README's
fine-tuning section). Two families, each worded three ways:
repeat a word (``Repeat the word: node`` -> ``node``) and name a word's opposite from a fixed table
(``Opposite of open?`` -> ``close``). Every content word and answer is a single token of the built-in
tokenizer alone and after a space, and no word of a wording is a content word, so the answer's word is
the only one of its kind in the prompt. Each family has ~34 equally likely answers (a constant guess
scores ~3%, no class prior). The split is honest: for every word one wording is held out, so no
validation prompt occurs in training (its word and its wording do, in other combinations). The trainer
measures task accuracy on the validation split (an answer counts as right when greedy decoding would
produce it: every answer token is the model's most likely one, checked as probability > 1/2).
Deterministic: same seed, same files; cached under a key of the generated content, so a changed
generator never reuses stale files.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_recipes.data import artifact_cache as cache

BUILTIN = "builtin"
TRAIN_SAMPLES, VALID_SAMPLES = 4000, 512
# single tokens of the built-in tokenizer both alone and after a space (checked when the sets were made)
WORDS = ("self", "name", "data", "list", "dict", "type", "item", "text", "file", "args", "result", "index",
         "count", "size", "node", "code", "mode", "base", "module", "class", "object", "string", "number",
         "error", "test", "info", "stream", "buffer", "format", "config", "label", "token", "state", "source")
PAIRS = (("open", "close"), ("start", "stop"), ("read", "write"), ("get", "set"), ("first", "last"),
         ("min", "max"), ("left", "right"), ("input", "output"), ("push", "pop"), ("before", "after"),
         ("add", "remove"), ("encode", "decode"), ("old", "new"), ("parent", "child"), ("src", "dst"),
         ("row", "col"), ("key", "value"))
OPPOSITE = {**dict(PAIRS), **{b: a for a, b in PAIRS}}
# each family: (its content words, the answer for a word, its wordings with {} for the word)
FAMILIES = {
    "repeat": (WORDS, lambda w: w, ("Repeat the word: {}", "Say {} again.", "Echo this word:\n{}")),
    "opposite": (tuple(OPPOSITE), OPPOSITE.__getitem__, ("Opposite of {}?", "What is the opposite of {}?",
                                                         "{} is the opposite of what?")),
}


def held_out(words: Sequence[str], word: str, wording: int) -> bool:
    """Whether (word, wording) belongs to the validation split: one wording per word, rotating."""
    return words.index(word) % 3 == wording


def _task(rng: random.Random, valid: bool) -> Tuple[str, str]:
    """(question, answer) of a random family; drawn from the validation or the training combinations."""
    words, answer, wordings = FAMILIES[rng.choice(sorted(FAMILIES))]
    word = rng.choice(words)
    choices = [i for i in range(len(wordings)) if held_out(words, word, i) == valid]
    return wordings[rng.choice(choices)].format(word), answer(word)


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
