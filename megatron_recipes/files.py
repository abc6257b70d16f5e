"""Files a reader sees whole or not at all: every file the project writes for others to read goes here.

A run directory is read while it is written (``report``, a tracker, a requeued job, a second node), and a
process can be killed at any byte. So a file is written under a temporary name beside its target
(same folder, so the rename stays on one filesystem), flushed to disk, and renamed over the target:
readers see the old content or the new, never a mix, and a crash leaves at most a hidden temporary.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path
from typing import Iterator, Union


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
