"""Every file of a checkpoint with its size and a fast hash, recorded at save and verified at load.

Why: megatron-core's torch_dist reader checks neither. A ``.distcp`` with 4 KB overwritten (a bad disk, a
copy cut short and patched up) loaded without complaint; the run went NaN at its second step and the
divergence message then called that checkpoint "the last good one". With the record, a load names the
damaged file before a tensor is read, and the trainer can say a checkpoint was verified.

The work is spread over the job: rank r hashes every world-th file (shared filesystem, as checkpoints
already need), so no rank reads the whole checkpoint; the records are gathered and rank 0 writes them into
``meta.json``. xxh3 (``xxhash``, there with ``datasets``) reads at disk speed; blake2b when it is missing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List

from megatron_recipes.checkpoint import _files as store
from megatron_recipes.config.errors import RecipeError

KEY = "files"  # in meta.json: {relative path: {"size": bytes, "<algorithm>": hex digest}}
_BLOCK = 1 << 23


def _algorithm() -> str:
    try:
        import xxhash  # noqa: F401

        return "xxh3_64"
    except ImportError:
        return "blake2b"


def file_hash(path: Path, algorithm: str) -> str:
    if algorithm == "xxh3_64":
        import xxhash

        digest = xxhash.xxh3_64()
    elif algorithm == "blake2b":
        digest = hashlib.blake2b(digest_size=16)
    else:
        raise RecipeError(f"{path}: checksum algorithm {algorithm!r} is unknown here", fix="upgrade megatron-recipes")
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _listing(folder: Path) -> List[str]:
    """The files a checkpoint holds, except the records written after the hashes (meta.json, config.yaml)."""
    skip = {store.META, store.CONFIG}
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name not in skip)


def _share(names: List[str], rank: int, world: int) -> List[str]:
    return names[rank::world]


def _records(folder: Path, names: List[str]) -> Dict[str, Dict[str, object]]:
    algorithm = _algorithm()
    return {name: {"size": (folder / name).stat().st_size, algorithm: file_hash(folder / name, algorithm)} for name in names}


def record(folder: Path) -> Dict[str, Dict[str, object]]:
    """The size and hash of every file in ``folder``: collective under a process group (each rank hashes its
    share, every rank gets the whole record), else this process hashes all (the HF importer's writer)."""
    import torch

    from megatron_recipes.runtime import collectives

    if not torch.distributed.is_initialized():
        return _records(folder, _listing(folder))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    names = collectives.broadcast_objects([_listing(folder) if rank == 0 else None])[0]  # one listing for all
    mine = _records(folder, _share(names, rank, world))
    out: Dict[str, Dict[str, object]] = {}
    for part in collectives.all_gather_object(mine):
        out.update(part)
    return dict(sorted(out.items()))


def damaged(folder: Path, recorded: Dict[str, Dict[str, object]], names: List[str]) -> List[str]:
    """``file: what is wrong`` for each of ``names`` whose size or hash is not the recorded one."""
    found = []
    for name in names:
        want, path = recorded[name], folder / name
        if not path.is_file():
            found.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != want.get("size"):
            found.append(f"{name}: {size} bytes, {want.get('size')} when saved")
            continue
        for algorithm in ("xxh3_64", "blake2b"):
            if algorithm in want and file_hash(path, algorithm) != want[algorithm]:
                found.append(f"{name}: its content changed since the save ({algorithm} differs)")
                break
    return found


def verify(folder: Path, meta: Dict[str, object]) -> bool:
    """Collective under a process group (each rank checks its share): raise naming every damaged file of ``folder``; False when the checkpoint holds no record
    (saved before checkpoints recorded one), True when every file is as saved."""
    import torch

    from megatron_recipes.runtime import collectives

    recorded = meta.get(KEY)
    if not isinstance(recorded, dict):
        return False
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        problems = damaged(folder, recorded, _share(sorted(recorded), rank, world))
        everything = [p for part in collectives.all_gather_object(problems) for p in part]
    else:  # one process (convert export): it checks every file
        everything = damaged(folder, recorded, sorted(recorded))
    if everything:
        raise RecipeError(
            f"checkpoint '{folder}' is damaged: {len(everything)} file(s) differ from what was saved:\n    "
            + "\n    ".join(sorted(everything)[:12]),
            fix="resume from an earlier checkpoint (checkpoint.load=<an earlier iter_* folder>) or restore this one "
            "from a copy; nothing was loaded",
        )
    return True
