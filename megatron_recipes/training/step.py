"""One training step and one evaluation pass through megatron-core's pipeline schedules.

The loss is per token: the loss function returns ``(loss_sum, num_tokens, report)``, megatron-core's
``finalize_model_grads`` divides the gradients by the token count of the whole global batch, and the
reported loss is ``sum(loss) / sum(tokens)`` over microbatches and data-parallel ranks. Packed and
unpacked batches of the same tokens therefore give the same loss and the same gradients. That loss is the
main one: multi-token-prediction layers add theirs to the gradients inside GPTModel, and each is reported
beside it as Megatron-LM's training log reports it (``_mtp_losses``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.runtime import mcore_compat
from megatron_recipes.training import optim

LOSS_KEY = "lm loss"
ANSWER_KEY = "answers"  # [answers the model gets right, answers], for SFT task accuracy
_LN2 = 0.6931471805599453


@dataclass
class StepResult:
    loss: float  # mean per-token loss of the global batch (same value on every rank)
    num_tokens: int  # loss-bearing tokens in the global batch
    grad_norm: Optional[float] = None
    lr: Optional[float] = None
    skipped: bool = False  # the optimizer refused the update (inf/nan grads under fp16 loss scaling)
    mtp_losses: Optional[List[float]] = None  # one per MTP layer (same value on every rank); None without MTP


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses and the token count; megatron-core normalises by the global count."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().double(), num_tokens.detach().double()])
    return loss_sum, num_tokens, {LOSS_KEY: report, ANSWER_KEY: answer_counts(loss_mask, output_tensor)}


@torch.no_grad()
def answer_counts(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> torch.Tensor:
    """[right, total] over answers: runs of loss-bearing tokens in a row (answer-only SFT loss).

    An answer is right when each of its tokens has probability > 1/2 (loss < ln 2), so it is the model's
    most likely token and greedy decoding reproduces the whole answer. A lower bound on exact-match
    accuracy, computed from the per-token losses every layout already has on its last stage.
    """
    mask = loss_mask.reshape(loss_mask.shape[0], -1) > 0
    losses = per_token_loss.detach().float().reshape(mask.shape)
    before = torch.zeros_like(mask)
    before[:, 1:] = mask[:, :-1]
    starts = mask & ~before
    run_id = torch.cumsum(starts.reshape(-1).long(), 0).reshape(mask.shape)
    wrong = torch.unique(run_id[mask & (losses >= _LN2)]).numel()
    total = int(starts.sum())
    return torch.tensor([total - wrong, total], dtype=torch.float64)


def _chunk_stages(model: torch.nn.Module):
    """(first stage, last stage, (pipeline rank, virtual stage)) of a model chunk (virtual stage 0 without
    interleaving)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage", allow_none=True)
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return first, last, (parallel_state.get_pipeline_model_parallel_rank(), vp_stage or 0)


def _attention_inputs(batch: Dict[str, torch.Tensor], device: torch.device, use_te: bool, cp: tuple = (1, 0)) -> Dict[str, Any]:
    """Causal attention needs no mask; packed sequences need a block mask (local spec) or cu_seqlens (TE).

    Under CP the local spec's mask keeps this rank's query rows and the all-gathered key columns.
    """
    segments = batch.get("segment_ids")
    if segments is None:
        return {"attention_mask": None}
    from megatron_recipes.data import attention

    segments = segments.to(device, non_blocking=True)
    if use_te:
        if cp[0] > 1:  # TE's THD CP split is per sample, which cp_share does not do
            from megatron_recipes.config.errors import RecipeError

            raise RecipeError("packed sequences with parallel.cp>1 on Transformer Engine are not supported (rule cp.packing_te)",
                              fix="set data.packing=false, or parallel.cp=1")
        return {"attention_mask": None, "packed_seq_params": attention.packed_seq_params(segments)}
    mask = attention.packed_attention_mask(segments)
    if cp[0] > 1:
        from megatron_recipes.models.context_parallel import cp_packed_attention_mask

        mask = cp_packed_attention_mask(mask, *cp)
    return {"attention_mask": mask}


def cp_share(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int) -> Dict[str, torch.Tensor]:
    """This CP rank's chunks (``r`` and ``2*cp-1-r`` of ``2*cp``) of every per-token tensor of a batch.

    Segment ids stay whole: the packed mask needs every key's segment (``_attention_inputs`` cuts it).
    """
    from megatron_recipes.models.context_parallel import split_for_cp

    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: split_for_cp(v, cp_size, cp_rank) if k in keys else v for k, v in batch.items()}


def make_forward_step(device: torch.device, use_te: bool, mtp: Optional[tuple] = None):
    """The ``forward_step_func`` the schedules call once per microbatch and model chunk.

    Every chunk reads its own iterator on every microbatch (so all iterators stay at the same sample),
    but only moves to the device what its stage uses: tokens on the first stage, labels on the last, and
    with multi-token prediction tokens and labels on the chunk holding the MTP layers too (``mtp``: its
    (pipeline rank, virtual stage), ``derived.mtp_stage``; the last chunk unless a pipeline layout says
    otherwise): the MTP block embeds the shifted input ids itself, and masks its loss with ``loss_mask``. Under CP each rank keeps its share of the sequence (``cp_share``); the loss
    sums and token counts are then this rank's, and ``_reduce_losses`` / megatron-core's
    ``finalize_model_grads`` add them up over data x context ranks (``calculate_per_token_loss``).

    With ``parallel.overlap_moe_expert_parallel_comm`` megatron-core's combined 1F1B schedule calls it with
    ``return_schedule_plan=True`` on the bare ``GPTModel``: it then returns the model's schedule plan for the
    same inputs (``GPTModel.build_schedule_plan``, as Megatron-LM's pretrain_gpt), which the schedule runs
    layer by layer beside another micro-batch's backward. Packed sequences' ``packed_seq_params`` go with
    it (Megatron-LM's call drops them: the plan would attend across the packed samples' seams).
    """
    from megatron.core import parallel_state

    cp = (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank())

    def forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module,
                     return_schedule_plan: bool = False):
        batch = next(data_iterator)
        if cp[0] > 1:
            batch = cp_share(batch, *cp)
        first, last, position = _chunk_stages(model)
        mtp_here = mtp is not None and position == tuple(mtp)
        needs_ids = first or mtp_here
        tokens = batch["tokens"].to(device, non_blocking=True) if needs_ids else None
        position_ids = batch["position_ids"].to(device, non_blocking=True) if needs_ids else None
        labels = batch["labels"].to(device, non_blocking=True) if last or mtp_here else None
        loss_mask = batch["loss_mask"].to(device, non_blocking=True) if last or mtp_here else None
        # loss_mask as Megatron-LM's pretrain_gpt passes it: GPTModel's MTP head masks its own loss with it
        # (without it, every position: prompts, padding and the seams of packed samples)
        attention = _attention_inputs(batch, device, use_te, cp)
        if return_schedule_plan:
            plan = model.build_schedule_plan(tokens, position_ids, labels=labels, loss_mask=loss_mask, **attention)
            return plan, partial(loss_func, loss_mask)
        output = model(tokens, position_ids, labels=labels, loss_mask=loss_mask, **attention)
        return output, partial(loss_func, loss_mask)

    return forward_step


def _reduce_losses(losses: Sequence[Dict[str, torch.Tensor]], device: torch.device, key: str = LOSS_KEY) -> torch.Tensor:
    """[loss_sum, tokens] (or another 2-vector report) over microbatches, then data-parallel ranks, then
    copied to every pipeline stage."""
    from megatron.core import parallel_state

    from megatron_recipes.runtime import collectives

    total = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for item in losses:
            total += item[key].to(device)
    collectives.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds non-zeros
        collectives.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def _mtp_losses(cfg: RunConfig, device: torch.device) -> Optional[List[float]]:
    """Each MTP layer's loss of this step as Megatron-LM's training log computes ``mtp_<k> loss``: megatron-core's
    tracker holds, on the stage computing the loss, each micro-batch's masked mean (over the positions with a
    token k ahead) summed over micro-batches; divided by their count, averaged over the data x context-parallel
    ranks (the tracker's averaging group), then copied to every pipeline stage. Not token-weighted across
    micro-batches or ranks, unlike the main loss: the same numbers Megatron-LM prints for the same run."""
    n = cfg.model.mtp_num_layers
    if not n:
        return None
    from megatron.core import parallel_state

    from megatron_recipes.runtime import collectives, mcore_compat

    taken = mcore_compat.take_mtp_losses(n)
    total = torch.zeros(n, dtype=torch.float64, device=device)
    if taken is not None and parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        total += taken.to(device=device, dtype=torch.float64) / derived.num_microbatches(cfg)
    collectives.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    total /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds non-zeros
        collectives.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total.tolist()


def _run_schedule(cfg: RunConfig, model: List[torch.nn.Module], iterators, forward_step, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = cfg.train
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model,
        num_microbatches=derived.num_microbatches(cfg),
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        decoder_seq_length=t.seq_length,
        forward_only=forward_only,
    )


def train_step(cfg: RunConfig, model, optimizer, scheduler, iterators, forward_step, device) -> StepResult:
    """Zero grads, forward/backward every microbatch (1F1B or interleaved), reduce grads, step."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    optim.refresh_shared_param_buffer(cfg, optimizer)  # MXFP8 params sharing the zeroed grad buffer
    if cfg.model.mtp_num_layers:  # the MTP losses of this step's forward passes only
        mcore_compat.take_mtp_losses(cfg.model.mtp_num_layers)
    losses = _run_schedule(cfg, model, iterators, forward_step, forward_only=False)
    lr = float(optimizer.param_groups[0]["lr"])  # the rate this step applies (the scheduler moves it after)
    updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    loss_sum, tokens = _reduce_losses(losses, device).tolist()
    return StepResult(
        loss=loss_sum / max(tokens, 1.0),
        num_tokens=int(tokens),
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        lr=lr,
        skipped=not updated,
        mtp_losses=_mtp_losses(cfg, device),
    )


@torch.no_grad()
def evaluate(cfg: RunConfig, model, iterators, forward_step, device, num_iters: int) -> float:
    """Mean per-token loss over ``num_iters`` global batches, forward only."""
    return evaluate_with_accuracy(cfg, model, iterators, forward_step, device, num_iters)[0]


@torch.no_grad()
def evaluate_with_accuracy(cfg: RunConfig, model, iterators, forward_step, device, num_iters: int):
    """(mean per-token loss, answer accuracy or None when no answer was seen) over ``num_iters`` batches."""
    for chunk in model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    answers = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for _ in range(num_iters):
            losses = _run_schedule(cfg, model, iterators, forward_step, forward_only=True)
            total += _reduce_losses(losses, device)
            answers += _reduce_losses(losses, device, ANSWER_KEY)
    finally:
        for chunk in model:
            chunk.train()
    loss_sum, tokens = total.tolist()
    right, seen = answers.tolist()
    return loss_sum / max(tokens, 1.0), (right / seen if seen else None)
