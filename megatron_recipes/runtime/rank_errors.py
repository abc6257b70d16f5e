"""One error message from a failed local job, not one per rank.

Why: when a problem with the user's input shows only once the ranks run (a file one rank reads, a
checkpoint a stage loads), every rank used to print it, interleaved with torch elastic's own failure lines.
Under the local launcher (``runtime/local_launch.py``) each rank hands its message to a folder the
launcher names; the launcher prints the first failing rank's message once, saying which other ranks
failed the same way. A rank started any other way (torchrun, Slurm) prints its message itself, rank-tagged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

ENV = "MEGATRON_RECIPES_RANK_ERRORS"  # the folder the local launcher reads the ranks' messages from


def report(message: str) -> None:
    """A rank's user-facing error (a ``RecipeError``'s text): to the launcher when it collects them."""
    folder, rank = os.environ.get(ENV), os.environ.get("RANK")
    if folder and rank is not None:
        try:
            (Path(folder) / f"rank{int(rank):06d}.txt").write_text(message, encoding="utf-8")
            return
        except (OSError, ValueError):
            pass  # the launcher's folder is gone: say it here
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    where = f"[rank {rank}] " if rank is not None and world > 1 else ""
    print(f"{where}error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def collected() -> Iterator[Path]:
    """A folder the ranks started inside report to (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix="megatron-recipes-errors-"))
    before = os.environ.get(ENV)
    os.environ[ENV] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        shutil.rmtree(folder, ignore_errors=True)


def summary(folder: Path) -> Optional[str]:
    """The first failing rank's message, and which ranks said the same or something else; None if none wrote."""
    messages: Dict[int, str] = {}
    for path in sorted(folder.glob("rank*.txt")):
        try:
            messages[int(path.stem[4:])] = path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue
    if not messages:
        return None
    first = min(messages)
    same: List[int] = [r for r, m in sorted(messages.items()) if m == messages[first]]
    other = [r for r in sorted(messages) if r not in same]
    text = f"error: {messages[first]}"
    if len(same) > 1:
        text += f"\n  (ranks {', '.join(map(str, same))} all failed with this)"
    elif len(messages) > 1 or first != 0:
        text += f"\n  (rank {first})"
    if other:
        text += f"\n  other ranks failed differently: " + "; ".join(
            f"rank {r}: {messages[r].splitlines()[0]}" for r in other[:3])
    return text
