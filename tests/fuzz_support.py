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


# Deletion targets: what a user's path may name when the tool is about to replace or delete it. Each entry:
# (name, path, may_go) where may_go says whether the tool may replace it (empty, or its own output of `kind`).
UPWARD_NAMES = ["..", "../..", "x/../..", "./..", "a/b/../../..", "../runs", "..\\..", "...", "a..b"]


def deletion_targets(root, kind: str):
    """A zoo of folders, files and links under ``root`` for the deletion rule (files.check_removable)."""
    import json
    import os

    from megatron_recipes import files

    root.mkdir(parents=True, exist_ok=True)
    user = root / "user"
    (user / "checkpoints").mkdir(parents=True)
    (user / "thesis.tex").write_text("years of work")
    empty = root / "empty"
    empty.mkdir()
    ours = root / "ours"
    ours.mkdir()
    files.mark_own(ours, kind)
    (ours / "old.log").write_text("an old output")
    other_kind = root / "other_kind"
    other_kind.mkdir()
    files.mark_own(other_kind, kind + " (another command)")
    forged = root / "forged"
    forged.mkdir()
    (forged / files.OWN_MARKER).write_text(json.dumps({"what": kind}))  # no written_by
    linked_marker = root / "linked_marker"
    linked_marker.mkdir()
    (linked_marker / files.OWN_MARKER).symlink_to(ours / files.OWN_MARKER)
    (linked_marker / "data.bin").write_bytes(b"\0" * 8)
    link_to_user = root / "link_to_user"
    link_to_user.symlink_to(user)
    link_to_ours = root / "link_to_ours"
    link_to_ours.symlink_to(ours)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    a_file = root / "a_file"
    a_file.write_text("x")
    dangling = root / "dangling"
    dangling.symlink_to(root / "nowhere")
    return [
        ("user folder", user, False), ("empty folder", empty, True), ("own output", ours, True),
        ("another command's output", other_kind, False), ("forged marker", forged, False),
        ("marker that is a symlink", linked_marker, False), ("symlink to a user folder", link_to_user, False),
        ("symlink to an own output", link_to_ours, False), ("fifo", fifo, False), ("regular file", a_file, False),
        ("dangling symlink", dangling, False), ("upward to the user folder", ours / ".." / "user", False),
        ("absent", root / "absent", True),
    ]


def snapshot(path) -> dict:
    """Everything under ``path`` (not following links): relative name -> (kind, content or link target)."""
    import os
    import stat

    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                out[os.path.relpath(full, path)] = ("link", os.readlink(full))
            elif stat.S_ISREG(mode):
                out[os.path.relpath(full, path)] = ("file", open(full, "rb").read())
            else:
                out[os.path.relpath(full, path)] = ("other", stat.S_IFMT(mode))
    return out
