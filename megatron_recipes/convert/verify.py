"""A conversion proves itself: logits of the HF model and of our checkpoint on the same prompt batch.

The megatron side runs exactly as training would: the recipe's model built by ``models.builder`` at a
real layout (TP/PP/EP ranks as processes), weights loaded through ``checkpoint.load_weights``,
a forward pass through megatron-core's pipeline schedule, TP-sharded logits gathered, padded vocabulary
cut. Both sides run in float32. The comparison reports max/mean absolute difference, the lowest cosine
similarity over positions and top-1 agreement; it fails when max-abs exceeds the tolerance
(``TOLERANCE`` = 1e-4 by default, the float32 bar; the same weights agree to ~1e-6 on CPU).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ParallelConfig, RunConfig
from megatron_recipes.convert import layout as layouts

TOLERANCE = 1e-4
SMALL_MODEL_PARAMS = 500_000_000  # import/export verify automatically up to this size
BATCH, SEQ = 2, 16


def prompt_tokens(vocab_size: int, batch: int = BATCH, seq: int = SEQ, seed: int = 1234) -> torch.Tensor:
    """The fixed prompt batch: reproducible token ids over the whole vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True, trust_remote_code=False
    )
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


@dataclass
class Metrics:
    max_abs: float
    mean_abs: float
    min_cosine: float
    argmax_agreement: float

    def ok(self, tolerance: float) -> bool:
        return math.isfinite(self.max_abs) and self.max_abs <= tolerance

    def looks_unrelated(self) -> bool:
        """Far beyond any rounding: a conversion's errors (a wrong split, a missed transpose) are bugs to
        report, but logits whose argmax mostly disagrees come from other weights, not from a conversion."""
        return math.isfinite(self.max_abs) and self.argmax_agreement < 0.5 and self.min_cosine < 0.9


def compare(reference: torch.Tensor, ours: torch.Tensor) -> Metrics:
    if reference.shape != ours.shape:
        raise RecipeError(
            f"logits shapes differ: HF {tuple(reference.shape)}, checkpoint {tuple(ours.shape)}",
            fix="the checkpoint and the HF folder hold different models",
        )
    diff = (reference - ours).abs()
    a, b = reference.reshape(-1, reference.shape[-1]).double(), ours.reshape(-1, ours.shape[-1]).double()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    agree = (a.argmax(-1) == b.argmax(-1)).double().mean()
    return Metrics(float(diff.max()), float(diff.mean()), float(cosine.min()), float(agree))


def table(rows: Sequence[tuple], tolerance: float) -> str:
    """Plain-text table (it lands in logs and CI output as well as terminals)."""
    header = ("check", "max |diff|", "mean |diff|", "min cosine", "argmax agree", "result")
    lines = [header]
    for name, m in rows:
        lines.append(
            (name, f"{m.max_abs:.3e}", f"{m.mean_abs:.3e}", f"{m.min_cosine:.8f}", f"{m.argmax_agreement:.2%}",
             "ok" if m.ok(tolerance) else f"FAIL (> {tolerance:g})")
        )
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*lines[0]), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in lines[1:]]
    return "\n".join(out)


# --- the megatron side, on every rank ---


@dataclass
class Job:
    """One checkpoint at one layout, run on every rank of a spawned group."""

    ckpt: str
    parallel: ParallelConfig
    tokens: str  # a saved token batch
    logits_out: Optional[str] = None  # written by the rank holding the last stage's TP rank 0
    resave_root: Optional[str] = None  # save the loaded weights again at this layout (resharding checks)


def checkpoint_config(ckpt: Path, parallel: ParallelConfig, world: int, mtp: bool = False) -> RunConfig:
    """The checkpoint's own recipe in float32 at ``parallel``, padding the vocabulary to its row count.

    Without its multi-token-prediction layers unless ``mtp``: logits and generation need none (DeepSeek-V3
    drops them at inference), and megatron-core 0.16's GPTModel cannot run them without labels (it rolls
    ``labels`` for their loss; 0.19 skips them when inferring). Their weights stay unread (load_weights)."""
    _, cfg, meta = checkpoint.read_run(ckpt)
    model = stored_vocab_rows(cfg.model, meta, parallel.tp)
    cfg = dataclasses.replace(
        cfg, model=model if mtp else dataclasses.replace(model, mtp_num_layers=None),
        precision=dataclasses.replace(cfg.precision, name="fp32", params_dtype="fp32", fp8=None, fp4=None),
    )
    return layouts.with_parallel(cfg, parallel, world)


def stored_vocab_rows(model, meta: dict, tp: int):
    """``model`` padding its vocabulary at ``tp`` to the rows the checkpoint stores (a run at TP=2 pads
    vocab_size=640 to 768; read at TP=1 the default padding would give 640 rows and refuse it)."""
    rows = (meta.get("layout") or {}).get("padded_vocab_size")
    if rows and rows % tp == 0 and derived.padded_vocab_size(model, tp) != rows:
        return dataclasses.replace(model, make_vocab_size_divisible_by=rows // tp)
    return model


def forward_logits(cfg: RunConfig, chunks: List[torch.nn.Module], tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary float32 logits on the rank that holds them (None on the others)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(chunks[0].parameters()).device
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)

    def step(data_iterator, model):
        ids = next(data_iterator).to(device)
        output = model(ids, positions.to(device), attention_mask=None)

        def collect(output_tensor, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(output_tensor).float().cpu()

        return output, collect

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter([tokens]) for _ in chunks] if len(chunks) > 1 else iter([tokens]),
            model=chunks,
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            decoder_seq_length=seq,
            forward_only=True,
            collect_non_loss_data=True,
        )
    holder = (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    return outputs[0][..., : cfg.model.vocab_size] if holder else None


def rank_jobs(jobs: Sequence[Job], world: int) -> None:
    """Run ``jobs`` in order on this rank (spawned by ``ranks.run_ranks``)."""
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import collectives
    from megatron_recipes.runtime.distributed import init_model_parallel, shutdown

    def loaded(job: Job, mtp: bool):
        cfg = checkpoint_config(Path(job.ckpt), job.parallel, world, mtp=mtp)
        init_model_parallel(cfg)  # groups of this model (its MTP placement shapes the embedding group)
        chunks = build_model_chunks(cfg)
        checkpoint.load_weights(Path(job.ckpt), chunks, cfg)
        return cfg, chunks

    try:
        for job in jobs:
            cfg, chunks = None, None
            if job.resave_root:  # every tensor, MTP layers included
                cfg, chunks = loaded(job, mtp=True)
                checkpoint.save(Path(job.resave_root), 0, chunks, None, None, {"step": 0}, cfg, keep_last=0)
                collectives.barrier()
            if chunks is None or cfg.model.mtp_num_layers:  # logits from the model without its MTP layers
                cfg, chunks = loaded(job, mtp=False)
            logits = forward_logits(cfg, chunks, torch.load(job.tokens))
            if logits is not None and job.logits_out:
                torch.save(logits, job.logits_out)
            collectives.barrier()
    finally:
        shutdown()


def run_jobs(jobs: Sequence[Job], world: int, moe: bool = False) -> None:
    """``jobs`` in turn on ``world`` local ranks (``moe``: the checkpoints hold MoE models)."""
    from megatron_recipes.convert.ranks import run_ranks

    run_ranks(rank_jobs, world, list(jobs), world, compiles=moe)


# --- the command ---


def max_local_ranks() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 8  # CPU lane: gloo processes; more is slow, not wrong


def verify_layout(saved: Dict[str, object], requested: Optional[ParallelConfig]) -> ParallelConfig:
    """The requested layout, else the checkpoint's (without VPP) if it fits here, else one rank."""
    if requested is not None:
        return requested
    p = ParallelConfig(
        tp=int(saved.get("tp") or 1), pp=int(saved.get("pp") or 1), ep=int(saved.get("ep") or 1), etp=saved.get("etp")
    )
    return p if layouts.min_world_size(p) <= max_local_ranks() else ParallelConfig()


SAME_MODEL_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "vocab_size", "num_moe_experts", "moe_ffn_hidden_size", "tie_embeddings")


def check_same_model(hf_dir: Path, cfg: RunConfig, ckpt: Path) -> None:
    """The HF folder and the checkpoint describe the same architecture (else logits cannot be compared)."""
    from megatron_recipes import families
    from megatron_recipes.families.hf_config import load_hf_config

    hf = load_hf_config(hf_dir)
    fam = families.by_architecture(getattr(hf, "architectures", None), getattr(hf, "model_type", None))
    fields = dict(fam.config_from_hf(hf), family=fam.name)
    diffs = [f"{k}: HF {fields[k]}, checkpoint {getattr(cfg.model, k)}" for k in SAME_MODEL_FIELDS
             if k in fields and fields[k] != getattr(cfg.model, k)]
    if diffs:
        raise RecipeError(
            f"{hf_dir} and {ckpt} are different models ({'; '.join(diffs)})",
            fix="verify a checkpoint against the HF folder it was imported from (or exported to)",
        )


def _phase(what: str, since: Optional[float] = None) -> None:
    """What verify is doing now (minutes for a large model), on stderr; the table stays on stdout."""
    took = f" [{time.monotonic() - since:.0f} s so far]" if since is not None else ""
    print(f"verify: {what}{took}", file=sys.stderr, flush=True)


def run_verify(hf_dir: Path, ckpt: Path, parallel: Optional[ParallelConfig] = None, tolerance: float = TOLERANCE) -> Metrics:
    """Compare ``hf_dir`` and ``ckpt`` logits at a layout; prints the table, raises RecipeError beyond tolerance."""
    resolved = checkpoint.resolve(Path(ckpt))
    meta = checkpoint.read_meta(resolved)
    layout = verify_layout(meta.get("layout") or {}, parallel)
    world = layouts.min_world_size(layout)
    if world > max_local_ranks():
        raise RecipeError(
            f"verifying at {layouts.layout_string(layout)} needs {world} local ranks, this machine runs {max_local_ranks()}",
            fix="pass a smaller layout, e.g. parallel.tp=1 parallel.pp=1",
        )
    cfg = checkpoint_config(resolved, layout, world)
    check_same_model(Path(hf_dir), cfg, resolved)
    tokens = prompt_tokens(cfg.model.vocab_size)
    started = time.monotonic()
    _phase(f"the HF model's logits ({hf_dir}, {tokens.shape[0]} x {tokens.shape[1]} tokens)")
    reference = hf_logits(Path(hf_dir), tokens)
    _phase(f"the checkpoint's logits on {world} rank(s) at {layouts.layout_string(layout)}", started)
    with tempfile.TemporaryDirectory(prefix="mr-verify-") as tmp:
        torch.save(tokens, Path(tmp, "tokens.pt"))
        out = Path(tmp, "logits.pt")
        run_jobs([Job(str(resolved), layout, str(Path(tmp, "tokens.pt")), str(out))], world, derived.is_moe(cfg.model))
        ours = torch.load(out)
    _phase("compared", started)
    metrics = compare(reference, ours)
    print(table([(f"HF vs checkpoint at {layouts.layout_string(layout)}", metrics)], tolerance), flush=True)
    if not metrics.ok(tolerance) and metrics.looks_unrelated():
        raise RecipeError(
            f"{hf_dir} and {resolved} have the same architecture but other weights (logits differ by up to "
            f"{metrics.max_abs:.3e}, argmax agrees on {metrics.argmax_agreement:.0%} of positions): they are not one "
            "model converted, e.g. a checkpoint trained or fine-tuned after its import, or two different downloads",
            fix="verify a checkpoint against the HF folder it was imported from or exported to",
        )
    if not metrics.ok(tolerance):
        raise RecipeError(
            f"logits differ by up to {metrics.max_abs:.3e} (tolerance {tolerance:g}) between {hf_dir} and {resolved}",
            fix="the conversion is wrong for this model; do not use this checkpoint (please report it with the table)",
        )
    return metrics
