"""A saved run's relative input paths, made absolute against the folder the run was started from.

Why: a run's config.yaml keeps its paths as typed (``checkpoint.pretrained=runs/tiny_llama_cpu/checkpoints``
is relative to the folder ``train`` ran in), so ``generate``, ``eval``, ``serve`` or ``convert export`` of a
fine-tuning run worked only from that folder; elsewhere its base "did not exist". That folder is the
checkpoint's ``meta.json`` ``launch_dir`` (recorded at save), or, for older checkpoints, known from the
checkpoint's own place: ``<root>/<run.dir>/checkpoints/iter_N`` with a relative ``run.dir``. A path is
rebased only where it exists under that folder (a hub name or a sentinel such as ``builtin`` never does),
so a run read from its own folder is read exactly as before.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

from megatron_recipes.config.schema import RunConfig

# (section, field) of the inputs a reader of a saved run may open
INPUT_FIELDS = (("checkpoint", "pretrained"), ("checkpoint", "load"), ("data", "sft_path"), ("data", "sft_valid_path"),
                ("data", "tokenizer"), ("data", "cache_dir"))


def launch_root(resolved: Path, cfg: RunConfig, checkpoints: str) -> Optional[Path]:
    """The folder ``train`` ran in: the checkpoint's run dir less its relative ``run.dir``; None if unknown."""
    rel = Path(os.path.normpath(cfg.run.dir))
    if rel.is_absolute() or ".." in rel.parts or resolved.parent.name != checkpoints:
        return None
    run_dir = resolved.resolve().parent.parent
    n = len(rel.parts)
    if run_dir.parts[-n:] != rel.parts:
        return None
    return Path(*run_dir.parts[:-n])


def rebase_inputs(cfg: RunConfig, resolved: Path, checkpoints: str, launch_dir: Optional[str]) -> RunConfig:
    roots = [Path(launch_dir)] if launch_dir and Path(launch_dir).is_dir() else []
    inferred = launch_root(resolved, cfg, checkpoints)
    roots += [inferred] if inferred is not None and inferred not in roots else []
    sections = {}
    for section, name in INPUT_FIELDS:
        value = getattr(getattr(cfg, section), name)
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        found = next((root / value for root in roots if (root / value).exists()), None)
        if found is not None:
            sections.setdefault(section, {})[name] = str(found)
    for section, changes in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
    return cfg
