"""What a run's training data *is*, by content: the part of a checkpoint's record a resume must match.

Why: ``consumed_samples`` is the whole data position of a run; resumed over another corpus, another split
or another chat template, it indexes other samples and the run silently becomes a different run. Paths
alone would refuse a dataset merely moved to another filesystem, so indexed prefixes count by their
``.idx`` hash (the one the index cache keys on) and JSONL files by a hash of their bytes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional

from megatron_recipes.config.schema import RunConfig

_FILE_HASHES: Dict[tuple, str] = {}


def _file_hash(path: str) -> str:
    """blake2b of a file's bytes, memoised per (path, size, mtime) within a process."""
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if stamp not in _FILE_HASHES:
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        _FILE_HASHES[stamp] = digest.hexdigest()
    return _FILE_HASHES[stamp]


def _blend(blend) -> Optional[List[Any]]:
    """``[[weight, idx hash], ...]`` of one megatron-core blend ``(prefixes, weights)``."""
    from megatron_recipes.data.indexed import content_fingerprint

    if not blend:
        return None
    prefixes, weights = blend
    weights = weights or [1.0] * len(prefixes)
    return [[float(w), content_fingerprint(p)["idx_sha256"][:32]] for p, w in zip(prefixes, weights)]


def data_identity(cfg: RunConfig) -> Dict[str, Any]:
    """The data fields that decide which sample each ``consumed_samples`` position is."""
    data = cfg.data
    out: Dict[str, Any] = {"kind": data.kind}
    if data.kind in ("builtin", "indexed"):
        from megatron_recipes.data.pretrain import resolve_blends

        blend, per_split = resolve_blends(cfg)
        out["split"] = data.split if per_split is None else None
        out["blend"] = _blend(blend)
        out["blend_per_split"] = [_blend(b) for b in per_split] if per_split else None
    elif data.kind == "sft":
        from megatron_recipes.data.sft.builtin_tasks import resolve_paths

        train, _ = resolve_paths(data.sft_path, data.sft_valid_path, data.cache_dir)
        out["sft"] = _file_hash(train) if train and os.path.isfile(train) else data.sft_path
        out.update(chat_template=data.chat_template, answer_only_loss=data.answer_only_loss, packing=data.packing,
                   overlong_policy=data.overlong_policy)
    out["seq_length"] = cfg.train.seq_length  # a sample is seq_length tokens: another length, other samples
    return out
