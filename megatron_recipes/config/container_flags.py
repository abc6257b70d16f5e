"""pyxis/enroot container flags: parse and check mounts and the image before they reach srun.

pyxis splits ``--container-mounts`` on ``,`` and each entry on ``:``, so those two characters cannot
appear inside a path; spaces and quotes can (the whole flag is shell-quoted when rendered). A source
path is checked for existence only when its top-level folder exists on this host (``/lustre`` mounted
here but ``/lustre/data`` missing is a typo; no ``/lustre`` at all means we are not on the cluster).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    flags: Optional[str] = None

    def render(self) -> str:
        return ":".join([self.source, self.target] + ([self.flags] if self.flags else []))


class MountError(ValueError):
    """A mount entry pyxis cannot take; the message names the entry and the rule."""


def parse_mount(entry: str) -> Mount:
    """``SRC[:DST[:FLAGS]]`` -> Mount (DST defaults to SRC)."""
    text = str(entry)
    if not text.strip():
        raise MountError("an empty mount entry")
    if "," in text:
        raise MountError(f"'{text}' contains ',', which pyxis uses to separate mounts (one mount per list item)")
    if "\n" in text:
        raise MountError(f"{text!r} contains a newline")
    parts = text.split(":")
    if len(parts) > 3:
        raise MountError(f"'{text}' has {len(parts) - 1} ':'; pyxis reads SRC:DST[:FLAGS], so paths cannot contain ':'")
    source = parts[0]
    target = parts[1] if len(parts) > 1 and parts[1] else source
    flags = parts[2] if len(parts) > 2 and parts[2] else None
    for role, path in (("source", source), ("target", target)):
        if not path.startswith("/"):
            raise MountError(f"'{text}': the {role} '{path}' is not an absolute path")
    return Mount(source, target, flags)


def parse_mounts(entries: Sequence[str]) -> List[Mount]:
    return [parse_mount(e) for e in entries]


def checkable(path: str) -> bool:
    """Whether this host can judge the path: its top-level folder (e.g. /lustre) exists here."""
    parts = PurePosixPath(path).parts
    return len(parts) >= 2 and os.path.isdir(os.path.join("/", parts[1]))


def missing_on_this_host(path: str) -> bool:
    return checkable(path) and not os.path.exists(path)


def image_is_local_file(image: str) -> bool:
    """A squashfs file (as opposed to a registry reference like ``repo/image:tag``)."""
    return image.startswith(("/", "./", "../")) or image.endswith((".sqsh", ".squashfs"))


def inside_any_mount(path: str, mounts: Sequence[Mount]) -> bool:
    """Whether ``path`` (as seen in the container) lies under one of the mount targets."""
    return _covering_mount(path, mounts) is not None


def _covering_mount(path: str, mounts: Sequence[Mount]) -> Optional[Mount]:
    """The mount whose target holds ``path``, the deepest one when targets nest."""
    p = PurePosixPath(os.path.normpath(path))
    best = None
    for m in mounts:
        t = PurePosixPath(os.path.normpath(m.target))
        if (p == t or t in p.parents) and (best is None or len(t.parts) > len(PurePosixPath(best.target).parts)):
            best = m
    return best


def to_host_path(path: str, mounts: Sequence[Mount]) -> str:
    """The host-side path of a path seen inside the container (unchanged when no mount covers it)."""
    m = _covering_mount(path, mounts)
    if m is None:
        return path
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(m.target))
    return os.path.normpath(m.source) if rel == "." else os.path.join(os.path.normpath(m.source), rel)


NO_CONTAINER = "none"  # cluster.container_image=none: the nodes run this installation's Python, on purpose


def image_of(cluster) -> Optional[str]:
    """The container image a job runs in, or None (unset, or ``none`` said explicitly)."""
    image = cluster.container_image
    return None if not image or str(image).strip().lower() == NO_CONTAINER else str(image)


def container_name(image: str) -> str:
    import hashlib

    return hashlib.sha256(image.encode("utf-8")).hexdigest()[:12]


def pyxis_args(image: str, mounts: Sequence[Mount], workdir: Optional[str]) -> List[str]:
    """The srun flags, unquoted (the renderer quotes each one as a whole)."""
    # Named after the image: pyxis keeps a named container on the node, so a requeued restart (same job
    # id) skips importing the image again; the name changes with the image, so another image is never reused.
    args = [f"--container-image={image}", f"--container-name=megatron-recipes-{container_name(image)}"]
    if mounts:
        args.append("--container-mounts=" + ",".join(m.render() for m in mounts))
    if workdir:
        args.append(f"--container-workdir={workdir}")
    # The home folder of the submitting user is not the training environment: do not mount it.
    args.append("--no-container-mount-home")
    return args
