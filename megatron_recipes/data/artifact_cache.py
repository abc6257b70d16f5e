"""Where data artefacts are cached, and how they are published so that no reader sees half of one.

Several ranks (or jobs) may ask for the same artefact at once. Exactly one builds it, under an
exclusive ``fcntl`` lock, into a temporary sibling folder; a single ``rename`` makes it visible. A
folder counts as complete only when its marker file exists, and the marker is written last, so a build
killed half-way leaves only a ``.tmp-*`` folder that the next builder removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_recipes.config.errors import RecipeError

ENV_CACHE = "MEGATRON_RECIPES_CACHE"
MARKER = "manifest.json"


def cache_root(cache_dir: Optional[str]) -> Path:
    """``data.cache_dir``, else ``$MEGATRON_RECIPES_CACHE``, else ``~/.cache/megatron-recipes``."""
    chosen = cache_dir or os.environ.get(ENV_CACHE) or str(Path.home() / ".cache" / "megatron-recipes")
    return Path(chosen).expanduser().resolve()


def index_cache_dir(cache_dir: Optional[str]) -> Path:
    """Where megatron-core's GPTDataset/BlendedDataset index caches (``path_to_cache``) go."""
    return cache_root(cache_dir) / "index"


def content_key(payload: Any) -> str:
    """A short, stable hash of a JSON-serialisable description of an artefact's inputs."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Block until this process holds the lock file; released on exit (also if the process dies)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_marker(folder: Path) -> Optional[dict]:
    """The marker's content when ``folder`` is a complete artefact, else None."""
    try:
        return json.loads((folder / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def write_marker(folder: Path, content: dict) -> None:
    """Write the marker last, flushed to disk, so that it only ever describes a finished folder."""
    path = folder / MARKER
    with open(path, "w") as handle:
        json.dump(content, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def build_once(final: Path, build: Callable[[Path], dict]) -> dict:
    """Return the marker of ``final``, building it first if needed (one builder across processes).

    ``build(tmp_dir)`` fills ``tmp_dir`` and returns the marker content; it is renamed to ``final``.
    """
    done = read_marker(final)
    if done is not None:
        return done
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(
            f"cannot create the data cache folder {final.parent}: {exc.strerror}",
            fix="set data.cache_dir (or $MEGATRON_RECIPES_CACHE) to a writable folder",
        ) from None
    with exclusive_lock(final.parent / f".{final.name}.lock"):
        done = read_marker(final)  # another process may have finished while we waited
        if done is not None:
            return done
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a killed builder
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a folder without its marker is not ours to trust
            shutil.rmtree(final)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            content = build(tmp)
            write_marker(tmp, content)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return content
