"""Export a PEFT run: merged HF weights, or an HF PEFT LoRA adapter directory.

A PEFT checkpoint holds adapters only, so both exports rebuild the model the run trained: the base from
the run's ``checkpoint.pretrained`` (QLoRA: quantised again, deterministically), the adapters from the
checkpoint, on one process at TP=PP=1 (megatron-core's dist-checkpointing reshards whatever layout the
run used). Then:

* merged: adapters folded into the base (``peft.lora.merge_and_unload``), written as a weights-only checkpoint to a
  private temporary folder and handed to the conversion engine's HF export (name tables, QKV/gated
  splits, config and tokenizer files); the temporary checkpoint is removed afterwards;
* adapter only: ``adapter_config.json`` + ``adapter_model.safetensors`` with HF PEFT's key names on the
  HF model. Fused adapters are split with the family's own transforms: the fused QKV ``B`` (rows in
  megatron's per-query-group order) into q/k/v ``lora_B``, gated FC1's ``B`` into gate/up, each with the
  shared ``A`` as its ``lora_A``; DoRA magnitudes split like ``B``. On MoE models, routed experts (and MLP
  linears named like them) go where ``peft_experts`` says: HF PEFT's exact per-expert LoRA on transformers 5's
  fused expert parameters (``target_parameters``).

Memory: one copy of the model in this process (like training it at TP=1), plus one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config import peft_methods as methods
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ParallelConfig, PeftConfig, RunConfig
from megatron_recipes import families
from megatron_recipes.convert import peft_experts, staging
from megatron_recipes.convert.exporter import DEFAULT_MAX_SHARD, find_assets, hf_config_for, run_export
from megatron_recipes.convert.layout import with_parallel
from megatron_recipes.convert.run_assets import RunAssets, RunTokenizer
from megatron_recipes.families.transforms import Ctx
from megatron_recipes.convert.verify import (
    SMALL_MODEL_PARAMS,
    TOLERANCE,
    compare,
    forward_logits,
    hf_logits,
    prompt_tokens,
    stored_vocab_rows,
    table,
)
from megatron_recipes.models.builder import build_model_chunks
from megatron_recipes.peft.lora import LoRALinear, merge_and_unload
from megatron_recipes.peft.state import peft_active, prepare_for_training
from megatron_recipes.estimate.params import model_params
from megatron_recipes.runtime.distributed import init_model_parallel, shutdown

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class PeftExportReport:
    out_dir: Path
    kind: str  # "adapter" | "merged"
    tensors: int
    target_modules: List[str]
    run_assets: Optional[RunAssets] = None
    notes: List[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        what = "HF PEFT LoRA adapter" if self.kind == "adapter" else "merged HF model"
        line = f"wrote a {what} to {self.out_dir} ({self.tensors} tensors; modules: {', '.join(self.target_modules)})"
        line += "".join(f"\nnote: {note}" for note in self.notes)
        return line + (f"\n{self.run_assets.summary()}" if self.run_assets is not None else "")


def config_saved(config: Dict) -> List[str]:
    return [f"{name} (whole)" for name in config.get("modules_to_save") or []]


def is_peft_checkpoint(ckpt: Path) -> bool:
    _, cfg, _ = checkpoint.read_run(ckpt)
    return peft_active(cfg)


def _single_rank(cfg: RunConfig, meta: Optional[Dict] = None) -> RunConfig:
    """One rank, TP=PP=1, the checkpoint's vocabulary rows; float32 for models small enough to verify
    (exact merge and logits check)."""
    single = with_parallel(cfg, ParallelConfig(), world=1)
    if meta is not None:
        single = dataclasses.replace(single, model=stored_vocab_rows(single.model, meta, 1))
    if model_params(single).total <= SMALL_MODEL_PARAMS:
        precision = dataclasses.replace(single.precision, name="fp32", params_dtype="fp32", fp8=None, fp4=None)
        single = dataclasses.replace(single, precision=precision)
    return single


def load_trained(ckpt: Path):
    """``(cfg, chunks, meta)``: the run's model on this one process, base + adapters, ready to use."""
    resolved, run_cfg, meta = checkpoint.read_run(ckpt)
    if not peft_active(run_cfg):
        raise RecipeError(
            f"checkpoint '{resolved}' is not from a PEFT run (its config.yaml has peft.method={run_cfg.peft.method})",
            fix="export it with `megatron-recipes convert export` without adapter_only",
        )
    cfg = _single_rank(run_cfg, meta)
    init_model_parallel(cfg)
    chunks = build_model_chunks(cfg)
    this_checkpoint = dataclasses.replace(cfg.checkpoint, load=str(resolved))
    start = checkpoint.start_of(dataclasses.replace(cfg, checkpoint=this_checkpoint), adapters_only=True)
    start.load_weights(chunks)  # the run's base, decided as the run decided it
    prepare_for_training(cfg, chunks)
    checkpoint.load(start.resume_from, chunks, None, None, cfg=cfg)  # its adapters
    for chunk in chunks:
        chunk.eval()
    return cfg, chunks, meta


def _family_key(path: str) -> Tuple[str, int, Optional[int]]:
    """Module path -> (the conversion table's canonical weight key, local layer index, routed expert or None)."""
    match = _LAYER.match(path)
    if not match:
        raise RecipeError(f"adapter on {path} is outside the transformer layers", fix="this is a bug: report it")
    rest, expert = match.group(2), _EXPERT.search(match.group(2))
    if expert:  # one process at EP=1 (load_trained): the local index is the global one
        rest = _EXPERT.sub("experts.experts.", rest, count=1)
    return f"decoder.layers.{rest}.weight", int(match.group(1)), int(expert.group(1)) if expert else None


def adapter_tensors(cfg: RunConfig, chunk: torch.nn.Module, flags: Dict, dtype: Optional[torch.dtype], hf_config=None):
    """HF PEFT state dict (name -> tensor) and its targets (``peft_experts.Placement``), from a TP=EP=1 chunk."""
    family = families.by_name(cfg.model.family)
    linears: Dict[str, Dict[str, torch.Tensor]] = {}  # HF checkpoint module name -> its adapter tensors
    routed: Dict[str, Dict[int, peft_experts.ExpertLoRA]] = {}  # layer's expert linear -> expert -> adapter
    for path, module in chunk.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        key, local, expert = _family_key(path)
        layer = int(chunk.decoder.layers[local].layer_number) - 1
        ctx = Ctx(cfg.model, layer, expert, flags)
        transform = family.transform(key)
        a = module.lora_a.detach()
        if expert is not None:
            rows = {name: torch.cat(list(p), dim=0) for name, p in transform.pieces(module.lora_b.detach(), ctx).items()}
            routed.setdefault(f"{key} (layer {layer})", {})[expert] = peft_experts.ExpertLoRA(rows, a)
            continue
        parts = {"lora_B.weight": module.lora_b.detach()}
        if module.dora:
            parts["lora_magnitude_vector"] = module.magnitude.detach()
        split = {suffix: transform.pieces(t, ctx) for suffix, t in parts.items()}
        for hf_name in split["lora_B.weight"]:
            if not hf_name.endswith(".weight"):
                raise RecipeError(f"conversion table maps {key} to {hf_name}, not a linear weight", fix="report this mapping")
            entry = linears.setdefault(hf_name[: -len(".weight")], {"lora_A.weight": a})
            for suffix, pieces in split.items():
                entry[suffix] = torch.cat(list(pieces[hf_name]), dim=0)
    placement = peft_experts.place(cfg, hf_config, flags, linears, routed)
    tensors = {f"{PEFT_PREFIX}{name}": t for name, t in placement.tensors.items()}
    saved = saved_modules(cfg, chunk, flags)
    tensors.update({f"{PEFT_PREFIX}{name}": t for name, t in saved.items()})
    out = {}
    for name, t in tensors.items():
        t = t.to(dtype) if dtype is not None else t
        out[name] = t.contiguous().clone()
    return out, placement


def saved_modules(cfg: RunConfig, chunk: torch.nn.Module, flags: Dict) -> Dict[str, torch.Tensor]:
    """``peft.modules_to_save`` weights under their HF names (padding rows cut, as a whole-model export cuts
    them); HF PEFT stores a ``modules_to_save`` module's weight under its own name in the adapter file."""
    family = families.by_name(cfg.model.family)
    out: Dict[str, torch.Tensor] = {}
    for module_name in cfg.peft.modules_to_save:
        key = f"{module_name}.weight"
        weight = dict(chunk.named_parameters()).get(key)
        if weight is None:
            raise RecipeError(f"peft.modules_to_save names {module_name}, which this model chunk does not hold", fix="this is a bug: report it")
        ctx = Ctx(cfg.model, None, None, flags)
        for hf_name, pieces in family.transform(key).pieces(weight.detach(), ctx).items():
            out[hf_name] = torch.cat(list(pieces), dim=0)
    return out


def hf_module_names(cfg: RunConfig, flags: Dict) -> List[str]:
    """The HF module names of ``peft.modules_to_save`` (``output_layer`` -> ``lm_head``), for adapter_config.json."""
    family = families.by_name(cfg.model.family)
    ctx = Ctx(cfg.model, None, None, flags)
    names = []
    for module_name in cfg.peft.modules_to_save:
        for hf_name in family.transform(f"{module_name}.weight").hf_shapes((cfg.model.vocab_size, cfg.model.hidden_size), ctx):
            names.append(hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name)
    return names


def adapter_config(p: PeftConfig, targets: List[str], base: Optional[str], dora: bool,
                   saved: Optional[List[str]] = None, parameters: Optional[List[str]] = None) -> Dict:
    """HF PEFT's LoraConfig fields; ``parameters``: ``target_parameters`` (whose LoRA has no dropout)."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": p.rank,
        "lora_alpha": p.alpha,
        "lora_dropout": 0.0 if parameters else p.dropout,
        "target_modules": targets,
        "bias": "none",
        "use_dora": dora,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": list(saved) if saved else None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    if parameters:  # only then: HF PEFT before target_parameters existed reads the rest as before
        config["target_parameters"] = list(parameters)
    return config


def _hf_side(cfg: RunConfig, resolved: Path, hf_assets: Optional[Path]):
    """``(family flags, assets folder, HF config)`` of the export."""
    family = families.by_name(cfg.model.family)
    assets = find_assets(resolved, cfg, hf_assets)
    hf_config = hf_config_for(cfg, family, assets, torch.float32)
    return dict(family.flags_from_hf(hf_config)), assets, hf_config


def export_adapter(
    ckpt: Path, out_dir: Path, overwrite: bool = False, hf_assets: Optional[Path] = None, dtype: Optional[str] = None
) -> PeftExportReport:
    """An HF PEFT LoRA/DoRA adapter directory for the HF export of the run's base model."""
    from safetensors.torch import save_file  # on use: the module imports without it

    out_dir = Path(out_dir).expanduser()
    staging.check_target(out_dir, overwrite, "adapter folder", staging.ADAPTER, {"ckpt_dir": ckpt, "hf_assets": hf_assets})
    resolved, run_cfg, meta = checkpoint.read_run(ckpt)
    method = methods.parse(run_cfg.peft.method) if not methods.why_not(run_cfg.peft.method) else None
    if method is not None and method.prefix:
        raise RecipeError(
            "P-Tuning v2 prefixes have no HF PEFT LoRA form", fix="adapter_only export covers lora, dora and qlora runs"
        )
    flags, assets, hf_config = _hf_side(run_cfg, resolved, hf_assets)
    notes = peft_experts.check_expressible(run_cfg, flags)  # what HF PEFT cannot hold is refused before loading
    run_tokenizer = RunTokenizer(run_cfg, resolved, meta, hf_assets)  # checked before anything is loaded
    try:
        cfg, chunks, _ = load_trained(resolved)
        if len(chunks) != 1:
            raise RecipeError("adapter export expects one model chunk", fix="this is a bug: report it")
        tensors, placement = adapter_tensors(cfg, chunks[0], flags, _DTYPES.get(dtype) if dtype else None, hf_config)
    finally:
        shutdown()
    base = str(assets) if assets is not None else run_cfg.checkpoint.pretrained
    dora = methods.parse(cfg.peft.method).dora
    config = adapter_config(cfg.peft, placement.modules, base, dora, hf_module_names(cfg, flags), placement.parameters)
    with staging.atomic_dir(out_dir, staging.ADAPTER) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        extra = run_tokenizer.write(tmp, None)  # tokenizer + chat template, stops
    targets = placement.described() + config_saved(config)
    return PeftExportReport(out_dir, "adapter", len(tensors), targets, extra, notes)


def export_merged(
    ckpt: Path,
    hf_dir: Path,
    overwrite: bool = False,
    hf_assets: Optional[Path] = None,
    dtype: Optional[str] = None,
    max_shard_bytes: Optional[int] = None,
    progress: bool = True,
):
    """Merged HF weights through the conversion engine's export; returns its ``ExportReport``."""
    hf_dir = Path(hf_dir).expanduser()
    staging.check_target(hf_dir, overwrite, "hf_dir", staging.HF_EXPORT, {"ckpt_dir": ckpt, "hf_assets": hf_assets})
    resolved, run_cfg, original_meta = checkpoint.read_run(ckpt)
    if hf_assets is None:
        _, hf_assets, _ = _hf_side(run_cfg, resolved, None)
    run_tokenizer = RunTokenizer(run_cfg, resolved, original_meta, hf_assets)  # a wrong one is refused before the merge
    work = Path(tempfile.mkdtemp(prefix=".merged-", dir=str(hf_dir.parent if hf_dir.parent.exists() else Path.cwd())))
    try:
        try:
            cfg, chunks, meta = load_trained(resolved)
            merge_and_unload(chunks)
            plain = dataclasses.replace(cfg, peft=PeftConfig())
            step = int(meta.get("step") or 0)
            checkpoint.save(work, step, chunks, None, None, {"step": step}, plain, keep_last=0)
        finally:
            shutdown()
        return run_export(
            work,
            hf_dir,
            overwrite=overwrite,
            hf_assets=hf_assets,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD,
            progress=progress,
            run_tokenizer=run_tokenizer,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the command (``megatron-recipes convert export ... adapter_only=true``, or any PEFT checkpoint) ---


def our_logits(cfg: RunConfig, chunks, tokens: torch.Tensor) -> torch.Tensor:
    return forward_logits(cfg, chunks, tokens)


def _verify_against(reference: torch.Tensor, ours: torch.Tensor, label: str, exact: bool) -> None:
    """Fails beyond the float32 tolerance when the comparison is exact; otherwise only reports.

    Not exact: bf16 models, and a QLoRA adapter on the dense HF base (training saw the NF4 base, so the
    difference is the quantisation error; a merged QLoRA export folds the dequantised base in and is exact)."""

    metrics = compare(reference, ours)
    print(table([(label, metrics)], TOLERANCE if exact else float("inf")), flush=True)
    if not exact:
        print("note: reported, not checked (not a float32 like-for-like comparison)", flush=True)
    elif not metrics.ok(TOLERANCE):
        raise RecipeError(
            f"{label}: logits differ by up to {metrics.max_abs:.3e} (tolerance {TOLERANCE:g})",
            fix="the export is wrong for this model; do not use it (please report it with the table)",
        )


def cli_export(opts: Dict[str, str], flags: Dict[str, object], adapter_only: bool, max_shard_bytes: Optional[int]) -> int:
    """Export a PEFT checkpoint; with verification, compare HF logits with the trained model's."""
    ckpt, out = Path(opts["ckpt_dir"]), Path(opts["hf_dir"])
    assets = Path(opts["hf_assets"]) if opts.get("hf_assets") else None
    dtype = opts.get("dtype") or None
    verify = _should_verify(ckpt, flags)
    reference = None
    if verify:  # the trained model's own logits, before anything is merged or split
        try:
            cfg, chunks, _ = load_trained(ckpt)
            tokens = prompt_tokens(cfg.model.vocab_size)
            reference = our_logits(cfg, chunks, tokens)
            fp32 = cfg.precision.params_dtype == "fp32"
        finally:
            shutdown()
    if adapter_only:
        report = export_adapter(ckpt, out, overwrite=bool(flags.get("overwrite")), hf_assets=assets, dtype=dtype)
        print(report.summary())
        if reference is not None:
            exact = fp32 and not methods_of(cfg).quantize
            _verify_against(peft_logits(ckpt, out, tokens, assets), reference, "HF base + PEFT adapter vs trained model", exact)
        return 0
    report = export_merged(ckpt, out, bool(flags.get("overwrite")), assets, dtype, max_shard_bytes, not flags.get("quiet"))
    print(report.summary())
    if reference is not None:
        _verify_against(hf_logits(out, tokens), reference, "merged HF model vs trained model", fp32)
    return 0


def methods_of(cfg: RunConfig) -> methods.Method:
    return methods.parse(cfg.peft.method)


def peft_logits(ckpt: Path, adapter_dir: Path, tokens: torch.Tensor, assets: Optional[Path]) -> torch.Tensor:
    """Logits of the HF base (exported from the run's pretrained checkpoint) with the adapter loaded by peft."""
    from transformers import AutoModelForCausalLM

    try:
        from peft import PeftModel
    except ImportError:
        raise RecipeError("checking an adapter export needs the peft package", fix="pip install peft, or pass --no-verify") from None

    _, run_cfg, _ = checkpoint.read_run(ckpt)
    with tempfile.TemporaryDirectory(prefix=".peft-base-", dir=str(Path(adapter_dir).parent)) as tmp:
        base_dir = Path(tmp) / "base"
        run_export(Path(run_cfg.checkpoint.pretrained), base_dir, hf_assets=assets, dtype="fp32", progress=False)
        base = AutoModelForCausalLM.from_pretrained(
            str(base_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True, trust_remote_code=False
        )
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        model.eval()
        with torch.no_grad():
            return model(tokens).logits.float()


def _should_verify(ckpt: Path, flags: Dict[str, object]) -> bool:
    """As the conversion engine decides: on request, else for models up to its small-model size."""
    if flags.get("verify") and flags.get("no-verify"):
        raise RecipeError("--verify and --no-verify contradict each other", fix="pass one of them")
    if flags.get("verify") or flags.get("no-verify"):
        return bool(flags.get("verify"))
    _, cfg, _ = checkpoint.read_run(ckpt)
    return model_params(_single_rank(cfg)).total <= SMALL_MODEL_PARAMS
