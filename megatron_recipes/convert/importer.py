"""``convert import``: a HF folder -> a weights-only megatron-recipes checkpoint for a target layout.

Order of work, so bad input loses nothing: derive the model from config.json, check the layout, list
every megatron tensor, check every HF tensor against it (missing, extra, wrong shape: all reported
together, before a byte is written), then stream tensor by tensor into a hidden folder that is renamed
into place only when complete. The output is a checkpoint root (``checkpoint.pretrained=<out_dir>``)::

    iter_0000000/                       torch_dist files + meta.json + config.yaml
    latest_checkpointed_iteration.txt
    model/<name>.yaml                   the recipe model for this model, as a Hydra group option
    hf/                                 config.json, generation/tokenizer files (used by export)

Train from it with ``megatron-recipes train <recipe> hydra.searchpath=[file://<out_dir>] model=<name>
checkpoint.pretrained=<out_dir>`` (``train_command`` prints exactly that).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ModelConfig, ParallelConfig, RunConfig, RunDirConfig
from megatron_recipes import families
from megatron_recipes.convert import dcp_io, layout as layouts, staging
from megatron_recipes.families.hf_config import load_hf_config
from megatron_recipes.convert.memory import PeakRss, gib
from megatron_recipes.convert.safetensors_io import SafetensorsReader
from megatron_recipes.convert.target import Item, Layout, checkpoint_layout
from megatron_recipes.families.transforms import Ctx, Transform

HF_ASSETS = checkpoint.HF_ASSETS  # config/tokenizer/generation files of the HF model, beside the checkpoint
MODEL_GROUP = "model"
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SourceModel:
    """A HF folder understood: its family, config object, the recipe model and the family's flags."""

    hf_dir: Path
    family: families.Family
    hf: Any
    model: ModelConfig
    flags: Dict[str, Any]


@dataclass
class Step:
    item: Item
    transform: Transform
    ctx: Ctx


@dataclass
class ImportReport:
    out_dir: Path
    checkpoint: Path
    cfg: RunConfig
    seconds: float  # streaming the tensors
    total_seconds: float  # everything: config, checks, planning, writing, renaming
    bytes_written: int
    largest_item: int
    peak_rss: int
    baseline_rss: int
    notes: List[str]

    def summary(self) -> str:
        rate = self.bytes_written / max(self.seconds, 1e-9) / (1 << 20)
        over = self.peak_rss - self.baseline_rss
        return (
            f"wrote {gib(self.bytes_written)} in {self.seconds:.1f} s ({rate:.0f} MB/s; {self.total_seconds:.1f} s in all) "
            f"to {self.checkpoint}\n"
            f"peak RSS {gib(self.peak_rss)} ({gib(over)} over the {gib(self.baseline_rss)} before writing; "
            f"largest tensor group {gib(self.largest_item)}, ratio {over / max(self.largest_item, 1):.2f})"
        )


def _model_name(hf_dir: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", hf_dir.resolve().name) or "converted"


def read_source(hf_dir: Path) -> SourceModel:
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise RecipeError(f"hf_dir={hf_dir} is not a folder", fix="point at a local Hugging Face model folder")
    hf = load_hf_config(hf_dir)
    family = families.by_architecture(getattr(hf, "architectures", None), getattr(hf, "model_type", None))
    model = layouts.model_from_fields(family.config_from_hf(hf), _model_name(hf_dir))
    return SourceModel(hf_dir, family, hf, model, dict(family.flags_from_hf(hf)))


def default_dtype(reader: SafetensorsReader) -> str:
    """The weights' own precision: bf16 stays bf16, fp32 stays fp32, fp16 widens to fp32 (lossless)."""
    by_dtype: Dict[torch.dtype, int] = {}
    for info in reader.tensors.values():
        by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
    main = max(by_dtype, key=by_dtype.get) if by_dtype else torch.bfloat16
    return "bf16" if main == torch.bfloat16 else "fp32"


def plan_steps(source: SourceModel, lay: Layout) -> List[Step]:
    return [
        Step(item, source.family.transform(item.canonical), Ctx(source.model, item.layer, item.expert, source.flags))
        for item in lay.items
    ]


def check_sources(source: SourceModel, steps: List[Step], reader: SafetensorsReader) -> None:
    """Every HF tensor the model needs is present with the shape config.json implies, with the values its
    transform requires; nothing is left over."""
    needed: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    optional = set()
    for step in steps:
        for name, shape in step.transform.hf_shapes(step.item.shape, step.ctx).items():
            needed[name] = (tuple(shape), step.item.label)
        optional.update(step.transform.optional_on_import(step.ctx))
    problems: List[str] = []
    for name, (shape, label) in needed.items():
        if name not in reader:
            if name not in optional:
                problems.append(f"missing tensor {name} (megatron {label})")
            continue
        info = reader.info(name)
        if info.shape != shape:
            problems.append(f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)} (megatron {label})")
        elif info.dtype not in _FLOAT:
            problems.append(f"tensor {name} is stored as {info.dtype} (quantised weights must be dequantised first)")
    ignored = list(source.family.ignored(source.hf))
    if source.model.tie_embeddings:
        problems += _separate_tied_head(source, reader)
        ignored.append(re.escape("lm_head.weight"))  # tied: megatron's output layer is the embedding
    extra = sorted(n for n in reader.tensors if n not in needed and not any(re.fullmatch(p, n) for p in ignored))
    if extra:
        problems.append(f"{len(extra)} tensor(s) have no place in the {source.family.name} model, e.g. {', '.join(extra[:5])}")
    if not problems:  # names and shapes hold: what the transforms require of the values (e.g. shared copies)
        for step in steps:
            problems += step.transform.check(reader, step.ctx)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise RecipeError(
            f"{source.hf_dir}: config.json and the weights do not match ({len(problems)} problem(s)):\n  - " + "\n  - ".join(shown),
            fix="use a complete, unmodified model folder (config.json and every shard of the same model)",
        )


def _separate_tied_head(source: SourceModel, reader: SafetensorsReader, rows: int = 4096) -> List[str]:
    """A tied model whose file also holds an ``lm_head.weight`` that is not the embedding: which one the
    model uses is ambiguous (transformers' tying rules changed between releases), and importing the tied
    one gave a checkpoint whose logits agreed with transformers' on 0% of tokens. Compared row block by row
    block, so the check holds two blocks in memory, not two vocabularies."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in reader or embed not in reader:
        return []
    a, b = reader.info(head), reader.info(embed)
    if a.shape != b.shape:
        return [f"config.json ties the embeddings (tie_word_embeddings=true) but the weights hold an {head} of shape "
                f"{list(a.shape)} beside {embed} {list(b.shape)}"]
    for start in range(0, a.shape[0], rows):
        n = min(rows, a.shape[0] - start)
        x, y = torch.empty((n, *a.shape[1:]), dtype=torch.float32), torch.empty((n, *b.shape[1:]), dtype=torch.float32)
        reader.read_rows(head, x, start), reader.read_rows(embed, y, start)
        if not torch.equal(x, y):
            return [f"config.json ties the embeddings (tie_word_embeddings=true) but the weights hold a separate {head} "
                    f"that differs from {embed} (first at row {start + int((x != y).any(dim=-1).nonzero()[0])}): which "
                    "one the model uses is ambiguous; set tie_word_embeddings=false in config.json if it was trained "
                    f"with its own head, or remove {head} if not"]
    return []


def copy_assets(hf_dir: Path, dest: Path) -> List[str]:
    """config.json, generation_config.json, tokenizer and other small non-weight files, for export later."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(Path(hf_dir).iterdir()):
        if path.is_file() and not WEIGHT_FILES.fullmatch(path.name):
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    return copied


def write_model_yaml(model: ModelConfig, root: Path) -> Path:
    """``root/model/<name>.yaml``: a model group option Hydra finds with ``hydra.searchpath=[file://root]``."""
    from omegaconf import OmegaConf

    path = root / MODEL_GROUP / f"{model.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# {model.name}: derived from its HF config.json by `megatron-recipes convert import`.\n"
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.structured(model)))
    return path


def train_command(out_dir: Path, model_name: str, recipe: str = "<recipe>") -> str:
    import shlex

    root = Path(out_dir).resolve()  # quoted: [ ] are globs to zsh, and a path may hold spaces
    search = shlex.quote(f"hydra.searchpath=[file://{root}]")
    return f"megatron-recipes train {recipe} {search} model={model_name} {shlex.quote(f'checkpoint.pretrained={root}')}"


def run_import(
    hf_dir: Path,
    out_dir: Path,
    parallel: ParallelConfig,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ImportReport:
    """Convert ``hf_dir`` into a checkpoint root at ``out_dir`` for ``parallel``; see the module docstring."""
    from megatron_recipes.progress import Progress

    began = time.perf_counter()
    out_dir = Path(out_dir).expanduser()
    staging.check_target(out_dir, overwrite, "out_dir", staging.MEGATRON_IMPORT, {"hf_dir": hf_dir})
    source = read_source(hf_dir)
    with SafetensorsReader(source.hf_dir) as reader:
        dtype = dtype or default_dtype(reader)
        if dtype not in layouts.DTYPES:
            raise RecipeError(f"dtype={dtype} is not supported", fix=f"use one of {', '.join(layouts.DTYPES)}")
        cfg = layouts.run_config(source.model, parallel, dtype)
        cfg = dataclasses.replace(cfg, run=RunDirConfig(dir=str(out_dir), name=f"import-{source.model.name}"))
        layouts.check_layout(cfg)
        lay = checkpoint_layout(cfg, state={"step": 0})
        steps = plan_steps(source, lay)
        check_sources(source, steps, reader)
        by_key = {(s.item.key, s.item.offset): s for s in steps}
        total = sum(s.item.nbytes for s in steps)
        largest = max(s.item.nbytes for s in steps)

        def produce(item: Item) -> torch.Tensor:
            step = by_key[(item.key, item.offset)]
            out = torch.empty(item.shape, dtype=item.dtype)
            step.transform.fill(out, reader, step.ctx)
            return out

        start = time.perf_counter()
        with staging.atomic_dir(out_dir, staging.MEGATRON_IMPORT) as tmp, Progress(
            "import", total=total, unit="B", items_total=len(steps), items_unit="tensors", enabled=progress
        ) as bar:
            ckpt_staging = checkpoint.prepare_staging(tmp, 0)
            with PeakRss() as peak:
                dcp_io.write_items(ckpt_staging, lay.items, produce, lay.objects, on_item=lambda it: bar.update(it.nbytes, items=1))
            dcp_io.write_megatron_files(ckpt_staging, lay.common)
            checkpoint.finish_weights_only(tmp, 0, cfg)
            write_model_yaml(source.model, tmp)
            copy_assets(source.hf_dir, tmp / HF_ASSETS)
        seconds = time.perf_counter() - start
    notes = [source.family.notes] if source.family.notes else []
    return ImportReport(
        out_dir=out_dir,
        checkpoint=checkpoint.iter_dir(out_dir, 0),
        cfg=cfg,
        seconds=seconds,
        total_seconds=time.perf_counter() - began,
        bytes_written=total,
        largest_item=largest,
        peak_rss=peak.result.peak,
        baseline_rss=peak.result.baseline,
        notes=notes,
    )
