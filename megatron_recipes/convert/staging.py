"""Output folders that appear complete or not at all.

A conversion writes into a hidden sibling (``.<name>.partial-<pid>``) and renames it into place only
after the last byte is on disk, so an interrupted run never leaves a folder that looks usable. An
existing output is replaced only with ``--overwrite`` and only if it looks like a conversion output
(a guard against ``out_dir=$HOME --overwrite``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from megatron_recipes.config.errors import RecipeError


def check_target(out: Path, overwrite: bool, looks_ours: Callable[[Path], bool], what: str) -> None:
    """Refuse an existing ``out`` unless overwriting a previous output of the same kind (before any work)."""
    if not out.exists():
        if not out.parent.exists():
            raise RecipeError(f"the parent folder of {what} '{out}' does not exist", fix=f"create {out.parent} first")
        return
    if not overwrite:
        raise RecipeError(f"{what} '{out}' already exists", fix="choose a new folder, or pass --overwrite to replace it")
    if out.is_dir() and not any(out.iterdir()):
        return
    if not out.is_dir() or not looks_ours(out):
        raise RecipeError(
            f"--overwrite refuses to replace '{out}': it does not look like a previous {what}",
            fix="remove it yourself if it really should go, or choose another folder",
        )


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a private folder; on success it becomes ``out`` (replacing an old one), on failure it is removed."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
