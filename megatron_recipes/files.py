"""Files a reader sees whole or not at all: every file the project writes for others to read goes here.

A run directory is read while it is written (``report``, a tracker, a requeued job, a second node), and a
process can be killed at any byte. So a file is written under a temporary name beside its target
(same folder, so the rename stays on one filesystem), flushed to disk, and renamed over the target:
readers see the old content or the new, never a mix, and a crash leaves at most a hidden temporary.

It also holds the one rule for what the tool may delete or overwrite (below): every command that replaces
a user-named path asks it first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import threading
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems cannot fsync a folder)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Union[str, Path]) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; on success it replaces ``path``, on error it is
    removed. The name is unique per host, process and thread (writers on a shared filesystem)."""
    path = Path(path)
    require_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text(path: Union[str, Path], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


# --- the one rule for deleting and overwriting -------------------------------------------------------
# A user's path can name anything: their home, another run, a device node, a symlink into someone else's
# folder. So the tool replaces only a regular file (or nothing), and deletes a folder only when it holds
# this marker (written by the tool into every folder it may later replace), never a folder reached by '..',
# and never one that holds the inputs of the command that would replace it.
OWN_MARKER = ".megatron-recipes-output.json"


def _refuse(message: str, fix: str) -> Exception:
    from megatron_recipes.config.errors import RecipeError  # config's package imports Hydra: only on refusal

    return RecipeError(message, fix=fix)


def _kind(mode: int) -> Optional[str]:
    """What a non-regular path is, in words (None for a regular file)."""
    for test, name in ((stat.S_ISREG, None), (stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"),
                       (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "device node"),
                       (stat.S_ISBLK, "device node"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def cannot_write_in(folder: Union[str, Path]) -> Optional[str]:
    """Why a file cannot be created in ``folder`` (an existing folder), or None: a probe file made and
    removed, since permission bits say nothing on a read-only mount (and nothing at all to root)."""
    probe = Path(folder) / f".megatron-recipes-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or folder})"
    return None


def require_replaceable(path: Union[str, Path]) -> None:
    """Refuse to write over anything but a regular file: a rename would turn a symlink, a FIFO or a device
    node into a plain file (and, as root, destroy ``/dev/...``)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    kind = _kind(mode)
    if kind is not None:
        raise _refuse(f"'{path}' is a {kind}: megatron-recipes replaces only regular files",
                      fix=f"write to a new file path{' (a file inside the folder)' if kind == 'folder' else ''}, "
                          "or remove it yourself if it really should be replaced")


def refuse_upward(path: Union[str, Path], field: str) -> None:
    """A path the tool may delete must not climb out of where it was given ('..')."""
    if ".." in Path(path).parts:
        raise _refuse(f"{field}: '{path}' goes upward ('..'); megatron-recipes never deletes or replaces a folder "
                      "reached that way", fix=f"give {field} without '..' (an absolute path, or a plain name)")


def mark_own(folder: Union[str, Path], what: str) -> None:
    """Record in ``folder`` that the tool wrote it (as ``what``), so a later run may replace it."""
    write_text(Path(folder) / OWN_MARKER, json.dumps({"written_by": "megatron-recipes", "what": what}) + "\n")


def own_kind(folder: Union[str, Path]) -> Optional[str]:
    """What the tool wrote ``folder`` as (its marker's ``what``), or None when it is not the tool's."""
    marker = Path(folder) / OWN_MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        body = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body.get("what") if isinstance(body, dict) and body.get("written_by") == "megatron-recipes" else None


def check_removable(folder: Union[str, Path], what: str, field: str) -> None:
    """Refuse unless the existing ``folder`` may be deleted: an empty folder, or one the tool wrote as ``what``."""
    folder = Path(folder)
    refuse_upward(folder, field)
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise _refuse(f"{field}: '{folder}' is a {_kind(mode)}, not a folder megatron-recipes wrote",
                      fix=f"choose a new folder for {field}")
    if not any(folder.iterdir()) or own_kind(folder) == what:
        return
    raise _refuse(f"{field}: '{folder}' already exists and is not a {what} output megatron-recipes wrote (it has no "
                  f"{OWN_MARKER} saying so); it is left as it is",
                  fix=f"choose a new folder for {field}, or remove this one yourself if it really should go")


def fresh_own_dir(folder: Union[str, Path], what: str, field: str) -> Path:
    """An empty ``folder`` marked as the tool's ``what``; what was there goes only if ``check_removable`` allows."""
    folder = Path(folder)
    check_removable(folder, what, field)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    mark_own(folder, what)
    return folder


def require_outside(out: Union[str, Path], inputs: Mapping[str, Union[str, Path, None]], field: str) -> None:
    """Refuse an output folder that is, or holds, one of the command's inputs: replacing it would delete them."""
    target = Path(out).expanduser().resolve()
    for name, given in inputs.items():
        if given is None:
            continue
        source = Path(given).expanduser().resolve()
        if source == target or target in source.parents:
            raise _refuse(f"{field} '{out}' holds the input {name} '{given}': writing {field} would replace it, "
                          "and the input with it",
                          fix=f"choose a {field} outside {name} (e.g. a sibling folder)")
