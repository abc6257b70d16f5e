"""On-disk layout of a run's checkpoints: iteration folders, the completion marker, the tracker, retention,
and the run description each checkpoint carries (``meta.json``, ``config.yaml``).

Why a layout of its own: a save can be killed at any byte (SIGKILL, preemption, a node dying), so a reader
must never mistake a half-written folder for a checkpoint. Every save is written under a staging name
(``iter_0000200.incomplete``), gets its ``meta.json`` last, and only then is renamed to ``iter_0000200``;
the tracker ``latest_checkpointed_iteration.txt`` (Megatron-LM's name, so its tools read ours) is replaced
atomically after that. Old checkpoints are removed only once a newer one is complete, and are renamed away
before deletion so a half-deleted folder never looks complete either.

Pure filesystem: no process groups. The caller runs the writing functions on one rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

from megatron_recipes import files
from megatron_recipes.checkpoint import _foreign
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.runtime import mcore_compat

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # a run's checkpoints live in run.dir/checkpoints
TRACKER = "latest_checkpointed_iteration.txt"
RESUMED_FROM = "resumed_from_iteration.txt"  # the step a rewind resumed from: retention keeps it
HF_ASSETS = "hf"  # an import keeps the HF model's config, tokenizer and generation files here, beside the checkpoint
META = "meta.json"  # ours; megatron-core writes its own metadata.json next to it
CONFIG = "config.yaml"
FORMAT = "megatron-recipes/dist-checkpoint"
FORMAT_VERSION = 1
STAGING_SUFFIX = ".incomplete"
DELETING_SUFFIX = ".deleting"
# Files megatron-core's torch_dist format writes once the sharded save has finished on every rank; up to
# 0.18 also common.pt (0.19 on keeps the common state inside the .distcp files: runtime/mcore_compat.py).
MCORE_FILES = ("metadata.json", ".metadata")
FSDP_DTENSOR_FILES = (".metadata",)  # Megatron-FSDP checkpoints: torch DCP's index (checkpoint/_fsdp.py)

_ITER = re.compile(r"^iter_(\d{7,})$")


def checkpoints_root(cfg: RunConfig) -> Path:
    """Where a run's checkpoints live: ``run.dir/checkpoints``."""
    return Path(cfg.run.dir).expanduser() / CHECKPOINTS


def iter_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def staging_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}{STAGING_SUFFIX}"


def step_of(path: Path) -> Optional[int]:
    match = _ITER.match(Path(path).name)
    return int(match.group(1)) if match else None


def read_meta(ckpt_dir: Path) -> Dict[str, Any]:
    """The checkpoint's ``meta.json``; a clear error when it is missing, unreadable or not ours."""
    meta_path = Path(ckpt_dir) / META
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if _foreign.kind(ckpt_dir) is not None:  # Megatron-LM / Megatron-Bridge: described from its own record
            if not _foreign.complete(ckpt_dir):
                raise RecipeError(f"'{ckpt_dir}' is an incomplete megatron-core checkpoint (no .metadata: its save "
                                  "did not finish)", fix="point at a complete iter_NNNNNNN folder") from None
            return _foreign.meta(ckpt_dir, FORMAT, FORMAT_VERSION)
        raise RecipeError(
            f"'{ckpt_dir}' is not a complete checkpoint: it has no {META} (a save that was interrupted, "
            "or a folder that is not a megatron-recipes checkpoint)",
            fix="point at a complete iter_NNNNNNN folder, or at the checkpoints folder to use its latest complete one",
        ) from None
    except (OSError, ValueError) as exc:
        raise RecipeError(f"'{meta_path}' cannot be read: {exc}", fix="the checkpoint is damaged; use another one") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RecipeError(
            f"'{meta_path}' is not a megatron-recipes checkpoint description",
            fix="point at a folder written by megatron-recipes (train or convert)",
        )
    version = meta.get("format_version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise RecipeError(f"'{meta_path}' has format_version {version!r}, not a whole number",
                          fix="the checkpoint's meta.json is damaged; use another checkpoint")
    if version > FORMAT_VERSION:
        raise RecipeError(
            f"'{ckpt_dir}' uses checkpoint format version {meta['format_version']}, newer than this "
            f"megatron-recipes understands ({FORMAT_VERSION})",
            fix="upgrade megatron-recipes",
        )
    return meta


def mcore_files(meta: Dict[str, Any]) -> Tuple[str, ...]:
    """The torch_dist files a complete checkpoint has, by the megatron-core that wrote it (``meta.json``
    records it; checkpoints from before that record were written by 0.16, with ``common.pt``)."""
    writer = str(meta.get("megatron_core_version") or "0.16")
    return MCORE_FILES + ((mcore_compat.COMMON_STATE_FILE,) if mcore_compat.writes_common_pt(writer) else ())


def require_readable_here(ckpt_dir: Path, meta: Dict[str, Any]) -> None:
    """A complete torch_dist checkpoint without ``common.pt`` (megatron-core 0.19 on) cannot be loaded by an
    older megatron-core, which fails deep inside its loader: say so, and what to install."""
    if meta.get("backend") == "fsdp_dtensor" or (Path(ckpt_dir) / mcore_compat.COMMON_STATE_FILE).is_file():
        return
    if not mcore_compat.reads_common_state_from_distcp():
        raise RecipeError(
            f"'{ckpt_dir}' was written by megatron-core {meta.get('megatron_core_version')}, which keeps the common "
            f"state inside the .distcp files; megatron-core {mcore_compat.installed()} reads it only from "
            f"{mcore_compat.COMMON_STATE_FILE}",
            fix=f"load it with megatron-core >= {mcore_compat.COMMON_STATE_IN_DISTCP_SINCE} "
            f"(pip install 'megatron-core>={mcore_compat.COMMON_STATE_IN_DISTCP_SINCE},<{mcore_compat.SUPPORTED[1]}', Python 3.12)",
        )


def problems(ckpt_dir: Path) -> List[str]:
    """Why ``ckpt_dir`` is not a complete checkpoint (empty list when it is)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [f"'{ckpt_dir}' does not exist or is not a folder"]
    if ckpt_dir.name.endswith((STAGING_SUFFIX, DELETING_SUFFIX)):
        return [f"'{ckpt_dir.name}' is the folder of a save or deletion that did not finish"]
    found = []
    try:
        meta = read_meta(ckpt_dir)
    except RecipeError as exc:
        return [exc.message]
    if not meta.get("complete"):
        found.append(f"{META} does not mark it complete")
    name_step = step_of(ckpt_dir)
    if name_step is not None and name_step != meta.get("step"):
        found.append(f"its name says step {name_step} but {META} says step {meta.get('step')}")
    required = FSDP_DTENSOR_FILES if meta.get("backend") == "fsdp_dtensor" else mcore_files(meta)  # [FSDP hook]
    missing = [name for name in required if not (ckpt_dir / name).is_file()]
    if missing:
        found.append(f"megatron-core files missing: {', '.join(missing)}")
    return found


def is_complete(ckpt_dir: Path) -> bool:
    return not problems(ckpt_dir)


def read_tracker(root: Path) -> Optional[int]:
    path = Path(root) / TRACKER
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (FileNotFoundError, ValueError):
        return None


def write_tracker(root: Path, step: int) -> None:
    files.write_text(Path(root) / TRACKER, f"{step}\n")


def complete_checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and is_complete(child):
            found.append((step, child))
    return sorted(found)


def require_folder_or_nothing(root: Path) -> None:
    """A checkpoints root is a folder or not there yet; a file, a broken link or a link loop is an error."""
    if root.is_symlink() and not root.exists():
        raise RecipeError(f"checkpoints folder '{root}' is a symbolic link to nothing (broken, or a loop)",
                          fix="remove the link, or point it at a folder")
    if root.exists() and not root.is_dir():
        raise RecipeError(f"checkpoints folder '{root}' is a file, not a folder",
                          fix="move the file away, or set run.dir to another folder")


def require_writable(root: Path) -> None:
    """The checkpoints folder can take a save: refused before training, not at the first save an hour in
    (a read-only mount, a folder of another user, a file in the way). Creates nothing: the probe goes into
    the folder, or the nearest folder above it that exists (where the save would create it)."""
    require_folder_or_nothing(root)
    existing = Path(root)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists() or not existing.is_dir():
        raise RecipeError(f"checkpoints cannot be written to '{root}': '{existing}' is not a folder",
                          fix="set run.dir to a folder you can write to (or checkpoint.save=false to train without saving)")
    why = files.cannot_write_in(existing)
    if why:
        raise RecipeError(f"checkpoints cannot be written to '{root}': {why}",
                          fix="set run.dir to a folder you can write to (or checkpoint.save=false to train without saving)")


def latest(where: Union[RunConfig, Path]) -> Optional[Path]:
    """The checkpoint a run (its ``RunConfig``) or a checkpoints folder continues from, or None: the tracker's.

    The tracker names the run's current checkpoint: the last save, or the one a rewind resumed from
    (``record_resume``), so an abandoned later checkpoint (iter_0000300 after a rewind to 200) is never
    resumed by accident. Only when the tracker names no complete checkpoint (missing, unreadable, or its
    folder gone) is the newest complete one used. A folder counts only with its completion marker
    (``meta.json`` written last, then the rename from the staging name): staging folders left by a killed
    save are never candidates; a save killed between the rename and the tracker update is trained again.
    """
    root = checkpoints_root(where) if isinstance(where, RunConfig) else Path(where).expanduser()
    require_folder_or_nothing(root)
    complete = complete_checkpoints(root)
    tracked = read_tracker(root)
    by_step = dict(complete)
    if tracked in by_step:
        return by_step[tracked]
    if tracked is not None:
        log.warning("%s names step %s, which is not a complete checkpoint; using the newest complete one", TRACKER, tracked)
    return complete[-1][1] if complete else None


def read_resumed(root: Path) -> Optional[int]:
    """The step a rewind resumed from (``record_resume``), or None."""
    try:
        return int((Path(root) / RESUMED_FROM).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def record_resume(root: Path, step: int) -> bool:
    """After resuming this run from its own ``step``: True when that was a rewind (the tracker named another
    step, and a later checkpoint exists). The tracker then names ``step`` (a requeue resumes the new branch)
    and retention keeps ``step`` while the abandoned later checkpoints remain. One rank (rank 0)."""
    root = Path(root)
    if read_tracker(root) == step:
        return False  # the run's own continuation (a requeue of a rewound run included)
    write_tracker(root, step)
    newest = max((s for s, _ in complete_checkpoints(root)), default=step)
    if step < newest:
        files.write_text(root / RESUMED_FROM, f"{step}\n")
        return True
    (root / RESUMED_FROM).unlink(missing_ok=True)
    return False


def resolve_dir(path: Path) -> Path:
    """A checkpoint folder from the folder itself, a checkpoints root holding complete ones (its latest), or
    a run dir (its checkpoints root's latest)."""
    path = Path(path).expanduser()
    if path.is_symlink() and not path.exists():
        raise RecipeError(f"checkpoint path '{path}' is a symbolic link to nothing (broken, or a loop)",
                          fix="point at the checkpoint folder itself")
    if not path.exists():
        raise RecipeError(f"checkpoint path '{path}' does not exist", fix="check the path (nothing was loaded)")
    if not path.is_dir():
        raise RecipeError(f"checkpoint path '{path}' is a file, not a checkpoint folder",
                          fix="point at an iter_NNNNNNN folder, or at a checkpoints folder to use its latest complete one")
    if (path / META).exists() or step_of(path) is not None or path.name.endswith(STAGING_SUFFIX):
        found = problems(path)
        if found:
            raise RecipeError(
                f"'{path}' is not a complete checkpoint: {'; '.join(found)}",
                fix="use a complete iter_NNNNNNN folder, or the checkpoints folder to pick its latest complete one",
            )
        return path
    if (path / CHECKPOINTS).is_dir() and latest(path) is None:  # a run dir: its checkpoints folder
        path = path / CHECKPOINTS
    found = latest(path)
    if found is None:
        raise RecipeError(
            f"'{path}' holds no complete checkpoint (no iter_NNNNNNN folder with {META})",
            fix="point at a run dir, a checkpoints folder or a checkpoint folder written by megatron-recipes train/convert",
        )
    return found


class SavedRun(NamedTuple):
    """A complete checkpoint folder with the resolved recipe and the description saved with it."""

    path: Path
    cfg: RunConfig
    meta: Dict[str, Any]


def read_run(path: Path) -> SavedRun:
    """The checkpoint ``path`` names (a folder, or a checkpoints root's latest) with its recipe and meta.json."""
    from megatron_recipes.config.compose import from_yaml  # Hydra/OmegaConf: only when a run is read

    from megatron_recipes.checkpoint._inputs import rebase_inputs

    resolved = resolve_dir(Path(path))
    meta = read_meta(resolved)
    if meta.get("source"):  # Megatron-LM / Megatron-Bridge: no config.yaml, its own record describes the run
        return SavedRun(resolved, _foreign.run_config(resolved), meta)
    cfg = rebase_inputs(from_yaml(resolved / CONFIG), resolved, CHECKPOINTS, meta.get("launch_dir"))  # from any folder
    return SavedRun(resolved, cfg, meta)


def _remove(path: Path) -> None:
    """Rename out of sight first, so a deletion interrupted halfway never leaves a 'complete' folder."""
    doomed = path.with_name(path.name + DELETING_SUFFIX) if not path.name.endswith(DELETING_SUFFIX) else path
    if doomed != path:
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prepare_staging(root: Path, step: int) -> Path:
    """An empty staging folder for ``step`` (a leftover from a killed save of the same step is discarded)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, step)
    if staging.exists():
        _remove(staging)
    staging.mkdir()
    return staging


def publish(staging: Path, final: Path) -> None:
    """Give a finished staging folder its final name (replacing an older save of the same step)."""
    for name in os.listdir(staging):
        if name.endswith(".distcp") or name in (META, mcore_compat.COMMON_STATE_FILE) + MCORE_FILES:
            _fsync_file(staging / name)
    files.fsync_dir(staging)
    if final.exists():
        _remove(final)
    os.replace(staging, final)
    files.fsync_dir(final.parent)


def _fsync_file(path: Path) -> None:
    try:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    except OSError:
        pass


def prune(root: Path, keep_last: int) -> List[Path]:
    """Keep the newest ``keep_last`` complete checkpoints (0 keeps all); drop leftovers of killed saves.

    Never removed: the tracker's checkpoint (a save writes the tracker before retention, so what a run has
    just written survives it even when older than the rest: a step-0 seed written into a run dir holding
    iter_0000300 was deleted by its own save, then announced as written) and the one a rewind resumed from
    (by step order it was the oldest, and went first, while the abandoned later ones stayed)."""
    root = Path(root)
    removed = []
    complete = complete_checkpoints(root)
    tracked, resumed = read_tracker(root), read_resumed(root)
    if resumed is not None and (not complete or tracked is None or tracked >= complete[-1][0]):
        (root / RESUMED_FROM).unlink(missing_ok=True)  # the branch has overtaken what it abandoned
        resumed = None
    kept = {tracked, resumed}
    if keep_last > 0:
        for step, path in complete[:-keep_last]:
            if step not in kept:
                _remove(path)
                removed.append(path)
    return removed + clean_leftovers(root)


def clean_leftovers(root: Path) -> List[Path]:
    """Remove staging and half-deleted folders of saves that did not finish (killed, disk full).

    Safe only while no save of this run is in progress: the trainer calls it holding the run.dir lock."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for child in root.iterdir():
        if child.is_dir() and child.name.endswith((STAGING_SUFFIX, DELETING_SUFFIX)):
            _remove(child)
            removed.append(child)
    return removed


def hf_assets_beside(resolved: Path, cfg) -> Optional[Path]:
    """The HF files an import kept (config.json, tokenizer, generation config): beside the checkpoint, or
    beside the checkpoint the run started from (``checkpoint.pretrained``); None when neither has them."""
    candidates = [Path(resolved).parent / HF_ASSETS]
    if cfg.checkpoint.pretrained:
        candidates.append(Path(cfg.checkpoint.pretrained).expanduser() / HF_ASSETS)
    return next((c for c in candidates if (c / "config.json").is_file()), None)
