"""The third-party warnings every start prints and no user can act on, listed in one place, hidden and counted.

Why: Transformer Engine and Apex being absent (the CPU lane, any machine without them) and megatron-core's
own deprecated calls print dozens of warnings per process, which buried the few lines a user needs in
``train``, ``convert``, ``check`` and the data commands. Each hidden one is counted: the processes of one
command add to one tally (a folder the command names), and the command closes with one line saying how
many were hidden. ``MEGATRON_RECIPES_VERBOSE=1`` shows them all. Any warning not listed here still shows.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

PATTERNS = (  # regular expressions searched in the warning's text
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"`torch\.distributed\.\w+` is deprecated",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (load|save) in a single process",
    r"MimoModelConfig is experimental",  # megatron-core 0.19's optimizer builder imports its MIMO model on every build
)
VERBOSE_ENV = "MEGATRON_RECIPES_VERBOSE"
TALLY_ENV = "MEGATRON_RECIPES_WARNING_TALLY"  # the folder the processes of one command count in
_KNOWN = re.compile("|".join(PATTERNS))
_hidden = 0


def known(text: str) -> bool:
    return bool(_KNOWN.search(text))


def _count() -> None:
    global _hidden
    _hidden += 1
    folder = os.environ.get(TALLY_ENV)
    if folder:
        try:
            (Path(folder) / str(os.getpid())).write_text(str(_hidden))
        except OSError:
            pass


def quiet() -> None:
    """Hide (and count) the listed warnings in this process, unless MEGATRON_RECIPES_VERBOSE is set."""
    if os.environ.get(VERBOSE_ENV) or getattr(warnings.showwarning, "_megatron_recipes", False):
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if known(str(message)):
            _count()
            return
        shown(message, category, filename, lineno, file, line)

    show._megatron_recipes = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def start_tally() -> Optional[Path]:
    """A tally for this command and the processes it starts (None when one is already running: a child)."""
    if os.environ.get(TALLY_ENV) or os.environ.get(VERBOSE_ENV):
        return None
    folder = Path(tempfile.mkdtemp(prefix="megatron-recipes-warnings-"))
    os.environ[TALLY_ENV] = str(folder)
    return folder


def close_tally(folder: Optional[Path]) -> None:
    """One line for everything hidden by this command's processes; the tally removed."""
    if folder is None:
        return
    total = 0
    for path in folder.iterdir():
        try:
            total += int(path.read_text() or 0)
        except (OSError, ValueError):
            continue
    os.environ.pop(TALLY_ENV, None)
    shutil.rmtree(folder, ignore_errors=True)
    if total:
        print(f"note: {total} known third-party warnings hidden (Transformer Engine/Apex absent, megatron-core "
              f"deprecations; {VERBOSE_ENV}=1 shows them)", file=sys.stderr)
