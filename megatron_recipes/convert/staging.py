"""Output folders that appear complete or not at all.

A conversion writes into a hidden sibling (``.<name>.partial-<pid>``) and renames it into place only
after the last byte is on disk, so an interrupted run never leaves a folder that looks usable. An
existing output is replaced only with ``--overwrite``, and only under the project's one deletion rule
(``files.check_removable``): it carries the marker a conversion of the same kind wrote into it (a guard
against ``out_dir=$HOME --overwrite``, or an HF download named as ``hf_dir``), and it holds none of the
command's inputs (``hf_dir=hfx`` with ``ckpt_dir=hfx/megatron`` would delete the source it converts).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError

# What each conversion's marker says its output is (files.OWN_MARKER): one kind never replaces another's.
HF_EXPORT, MEGATRON_IMPORT, ADAPTER = "hf export", "megatron import", "peft adapter"


def check_target(out: Path, overwrite: bool, field: str, kind: str,
                 inputs: Mapping[str, Union[str, Path, None]] = {}) -> None:
    """Refuse an existing ``out`` unless ``--overwrite`` may replace it (before any work): see the module doc."""
    if not os.path.lexists(out):  # missing parents are created (as mkdir -p would) once the work is done
        existing = next(p for p in Path(out).absolute().parents if os.path.lexists(p))
        problem = f"'{existing}' is not a folder" if not existing.is_dir() else files.cannot_write_in(existing)
        if problem:
            raise RecipeError(f"{field} '{out}' cannot be created: {problem}", fix=f"choose {field} in a folder you can write")
        return
    if not overwrite:
        raise RecipeError(f"{field} '{out}' already exists", fix="choose a new folder, or pass --overwrite to replace it")
    files.require_outside(out, inputs, field)
    files.check_removable(out, kind, field)


@contextlib.contextmanager
def atomic_dir(out: Path, kind: Optional[str] = None) -> Iterator[Path]:
    """Yield a private folder; on success it becomes ``out`` (replacing an old one), on failure it is removed.
    ``kind``: the marker the folder gets, so that a later ``--overwrite`` may replace it."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        if kind is not None:
            files.mark_own(tmp, kind)
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
