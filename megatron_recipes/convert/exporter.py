"""``convert export``: a megatron-recipes checkpoint (any layout) -> a HF folder transformers loads.

The checkpoint's config.yaml names the model; megatron-core's key list for it is rebuilt the same way
the importer builds it and checked against the stored tensor index before anything is written (another
model's checkpoint is refused, naming the tensor). Tensors are then read one (key, layer, expert) region
at a time through DCP, whatever TP/PP/EP wrote them, split into HF tensors and written at their final
offsets in pre-laid-out safetensors shards. config.json keeps every field of the original HF config
(when the import's ``hf/`` folder or ``hf_assets=`` provides it) with the architecture fields
re-derived from the checkpoint; tokenizer and generation files are copied from the same place.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ParallelConfig, RunConfig
from megatron_recipes import families
from megatron_recipes.convert import staging
from megatron_recipes.convert.dcp_io import CheckpointReader
from megatron_recipes.families.hf_config import ROPE_KEYS, transformers_major
from megatron_recipes.convert.importer import WEIGHT_FILES
from megatron_recipes.convert.memory import PeakRss, gib
from megatron_recipes.convert.run_assets import RunAssets, RunTokenizer
from megatron_recipes.convert.safetensors_io import ShardedSafetensorsWriter
from megatron_recipes.convert.target import Item, checkpoint_layout
from megatron_recipes.families.transforms import Ctx

DEFAULT_MAX_SHARD = 5 * (1 << 30)
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class ExportReport:
    hf_dir: Path
    seconds: float  # streaming the tensors
    total_seconds: float  # everything, config and assets included
    bytes_written: int
    peak_rss: int
    baseline_rss: int
    largest_item: int
    assets_from: Optional[Path]
    run_assets: Optional["RunAssets"] = None

    def summary(self) -> str:
        rate = self.bytes_written / max(self.seconds, 1e-9) / (1 << 20)
        over = self.peak_rss - self.baseline_rss
        where = f"config/tokenizer files from {self.assets_from}" if self.assets_from else "config derived from the checkpoint"
        tokenizer = f"\n{self.run_assets.summary()}" if self.run_assets is not None else ""
        return (
            f"wrote {gib(self.bytes_written)} in {self.seconds:.1f} s ({rate:.0f} MB/s; {self.total_seconds:.1f} s in all) "
            f"to {self.hf_dir}; {where}{tokenizer}\n"
            f"peak RSS {gib(self.peak_rss)} ({gib(over)} over the {gib(self.baseline_rss)} before writing; "
            f"largest tensor group {gib(self.largest_item)}, ratio {over / max(self.largest_item, 1):.2f})"
        )


def find_assets(resolved: Path, cfg: RunConfig, explicit: Optional[Path]) -> Optional[Path]:
    """Where config.json/tokenizer files come from: ``hf_assets=`` (a HF model folder, or a tokenizer-only
    one: the config is then derived from the checkpoint), the import's ``hf/``, or the run's pretrained one."""
    if explicit is not None:
        from megatron_recipes.convert.run_assets import has_tokenizer

        folder = Path(explicit).expanduser()
        if not (folder / "config.json").is_file() and not has_tokenizer(folder):
            raise RecipeError(
                f"hf_assets={explicit} holds neither a config.json nor tokenizer files",
                fix="point at the original HF model folder, or at a tokenizer folder (tokenizer.json / tokenizer_config.json)",
            )
        return folder
    return checkpoint.hf_assets_beside(resolved, cfg)


def hf_config_for(cfg: RunConfig, family: families.Family, assets: Optional[Path], dtype: torch.dtype):
    """The HF config object: the original fields kept, the architecture re-derived from the checkpoint."""
    from transformers import AutoConfig

    config_file = assets / "config.json" if assets else None
    base: Dict[str, Any] = json.loads(config_file.read_text()) if config_file and config_file.is_file() else {}
    if base and base.get("model_type") not in (None, family.model_type):
        raise RecipeError(
            f"{assets}/config.json is a {base.get('model_type')} model, the checkpoint a {family.model_type} one",
            fix="pass hf_assets= pointing at this model's HF folder",
        )
    for key in ("transformers_version", "model_type", "_name_or_path", "torch_dtype", "dtype") + ROPE_KEYS:
        base.pop(key, None)
    kwargs = {**base, **family.config_to_hf(cfg.model)}
    kwargs["architectures"] = [family.architectures[0]]
    config = AutoConfig.for_model(family.model_type, **kwargs)
    setattr(config, "dtype" if transformers_major() >= 5 else "torch_dtype", _TORCH_DTYPE_NAMES.get(dtype, "float32"))
    return config


def _check_format(resolved: Path, meta: Dict[str, Any]) -> None:
    """Export streams megatron-core's layout-free tensors of a torch_dist checkpoint (layers stacked under one
    name); a Megatron-FSDP run's fsdp_dtensor checkpoint holds its modules' own tensors, one per layer."""
    backend = meta.get("backend", "torch_dist")
    if backend != "torch_dist":
        raise RecipeError(
            f"checkpoint '{resolved}' was saved under Megatron-FSDP (format {backend}); export reads torch_dist "
            "checkpoints only, whose tensors carry megatron-core's layout-free names",
            fix=f"continue from its weights without Megatron-FSDP (parallel.fsdp=false checkpoint.pretrained={resolved} "
            "checkpoint.load=none run.dir=<a new run dir>) and export a checkpoint that run saves",
        )


def _check_contents(reader: CheckpointReader, items: List[Item], resolved: Path) -> None:
    stored = reader.tensors()
    problems = []
    for item in items:
        md = stored.get(item.key)
        if md is None:
            problems.append(f"{item.key}: not in the checkpoint")
        elif tuple(md.size) != item.global_shape:
            problems.append(f"{item.key}: checkpoint shape {tuple(md.size)}, config.yaml implies {item.global_shape}")
    if problems:
        unique = sorted(set(problems))
        raise RecipeError(
            f"checkpoint '{resolved}' does not hold the model its config.yaml describes:\n    " + "\n    ".join(unique[:12]),
            fix="export a complete checkpoint written by megatron-recipes for this model",
        )


def run_export(
    ckpt: Path,
    hf_dir: Path,
    overwrite: bool = False,
    hf_assets: Optional[Path] = None,
    dtype: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    progress: bool = True,
    run_tokenizer: Optional[RunTokenizer] = None,
) -> ExportReport:
    """``run_tokenizer``: the tokenizer (and chat template) the export carries, when not the checkpoint's
    own run's (a merged PEFT export writes a temporary checkpoint of the fine-tuning run first)."""
    from megatron_recipes.progress import Progress

    began = time.perf_counter()
    hf_dir = Path(hf_dir).expanduser()
    staging.check_target(hf_dir, overwrite, "hf_dir", staging.HF_EXPORT, {"ckpt_dir": ckpt, "hf_assets": hf_assets})
    resolved, cfg, meta = checkpoint.read_run(ckpt)
    _check_format(resolved, meta)
    checkpoint.check_same_model(meta, cfg, resolved)
    checkpoint.verify_files(resolved)  # a damaged file is named before a tensor is read
    if getattr(cfg, "peft", None) is not None and cfg.peft.method != "none":
        raise RecipeError(
            f"checkpoint '{resolved}' is a peft.method={cfg.peft.method} run: it holds adapters, not a whole model",
            fix="merge the adapters into the base model first; export does not merge adapters",
        )
    family = families.by_name(cfg.model.family)
    rows = (meta.get("layout") or {}).get("padded_vocab_size")
    model = dataclasses.replace(cfg.model, make_vocab_size_divisible_by=int(rows)) if rows else cfg.model
    shape_cfg = dataclasses.replace(cfg, model=model, parallel=ParallelConfig())
    items = checkpoint_layout(shape_cfg).items
    reader = CheckpointReader(resolved)
    _check_contents(reader, items, resolved)
    stored = reader.tensors()

    out_dtypes = {it.key: _DTYPES[dtype] if dtype else stored[it.key].properties.dtype for it in items}
    assets = find_assets(resolved, cfg, hf_assets)
    main_dtype = max(set(out_dtypes.values()), key=lambda d: sum(i.nbytes for i in items if out_dtypes[i.key] == d))
    hf_config = hf_config_for(cfg, family, assets, main_dtype)
    run_tokenizer = run_tokenizer or RunTokenizer(cfg, resolved, meta, hf_assets)  # checked before writing
    flags = dict(family.flags_from_hf(hf_config))
    plan: List[Tuple[Item, Ctx]] = [(it, Ctx(cfg.model, it.layer, it.expert, flags)) for it in items]
    entries = []
    for item, ctx in plan:
        transform = family.transform(item.canonical)
        for name, shape in transform.hf_shapes(item.shape, ctx).items():
            entries.append((name, out_dtypes[item.key], shape))
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in entries)
    largest = max(it.nbytes for it in items)

    start = time.perf_counter()
    with staging.atomic_dir(hf_dir, staging.HF_EXPORT) as tmp, Progress(
        "export", total=total, unit="B", items_total=len(plan), items_unit="tensors", enabled=progress
    ) as bar:
        writer = ShardedSafetensorsWriter(tmp, entries, max_shard_bytes)
        try:
            with PeakRss() as peak:
                for item, ctx in plan:
                    tensor = reader.read(item)
                    for name, pieces in family.transform(item.canonical).pieces(tensor, ctx).items():
                        row = 0
                        for piece in pieces:
                            writer.write_rows(name, piece.contiguous(), row)
                            row += piece.shape[0] if piece.dim() else 1
                            bar.update(piece.numel() * torch.empty((), dtype=out_dtypes[item.key]).element_size())
                    bar.update(items=1)
                    del tensor
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        hf_config.save_pretrained(str(tmp))
        if assets:
            for path in sorted(assets.iterdir()):
                if path.is_file() and path.name != "config.json" and not WEIGHT_FILES.fullmatch(path.name):
                    shutil.copy2(path, tmp / path.name)
        extra = run_tokenizer.write(tmp, assets)
    return ExportReport(
        hf_dir, time.perf_counter() - start, time.perf_counter() - began, total, peak.result.peak, peak.result.baseline,
        largest, assets, extra,
    )
