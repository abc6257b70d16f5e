"""Hostile values for the fuzz tests: shell metacharacters, quotes, control characters, extremes.

Every payload that could run something calls ``pwned``, a stand-in command the slurm fuzz puts on PATH
(it creates a sentinel file), so a value that escapes its quoting shows up as that file.
"""

from __future__ import annotations

import random
from typing import List

SHELL = [
    "$(pwned)", "`pwned`", ";pwned", "; pwned #", "&& pwned", "|| pwned", "| pwned", "& pwned", "$(pwned)x",
    "'; pwned; '", '"; pwned; "', "\\'$(pwned)\\'", '\\"`pwned`\\"', "${IFS}pwned", "$((1))", "$HOME", "~",
    "*", "?", "[a]", "{a,b}", "!!", "#", "# x", "%j", "%%", "<(pwned)", ">x", "2>&1", "--wrap=pwned", "-x",
    "=", ":", "::", ",", "\\", "\\\\", "'", '"', "''", '""', " ", "  two  spaces ", "é", "日本", "\u202e",
    "EOF", "MEGATRON_RECIPES_CONFIG_EOF", "pwned",
]
CONTROL = ["\n", "\r", "\t", "\x00", "\x1b[31m", "\npwned\n", "\rpwned", "\x7f", "\v", "\f"]
PLAIN = ["a", "run", "x-1", "job.2", "/abs/path", "rel/path", "A_B"]


def hostile_text(rng: random.Random, control: bool = True) -> str:
    """A short string built from 1-3 hostile pieces and plain text (a control character sometimes)."""
    pool = SHELL + (CONTROL if control else [])
    pieces = [rng.choice(PLAIN)] + [rng.choice(pool) for _ in range(rng.randint(1, 3))]
    rng.shuffle(pieces)
    return "".join(pieces)


def hostile_texts(rng: random.Random, n: int, control: bool = True) -> List[str]:
    return [hostile_text(rng, control) for _ in range(n)]
