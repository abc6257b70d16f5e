"""How likely the checkpoint's model finds a continuation: lm-eval's ``loglikelihood`` request (the sum of the
continuation's token log-probabilities, and whether greedy decoding would produce it), at any layout.

Why megatron-core's pipeline schedule (forward only, ``collect_non_loss_data``) and not the inference engine:
a score needs every position's distribution in one pass, which the schedule gives at any TP/PP/EP layout
with the activations passed between stages as training passes them. The last stage gathers its
vocabulary-parallel logits over the tensor-parallel group and drops the padded vocabulary rows (an export has
none), so the distribution is the one transformers computes on the export. Rows are right-padded: causal
attention keeps padding from reaching the positions that are scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_recipes.config.schema import RunConfig

Score = Tuple[float, bool]  # (log-probability of the continuation, greedy decoding produces it)


@dataclass
class Row:
    tokens: List[int]  # the model's input: context and continuation, without the continuation's last token
    targets: List[int]  # the continuation: the next tokens at the last len(targets) input positions


def _padded_length(longest: int, tp: int) -> int:
    multiple = 8 * tp  # sequence parallelism splits the sequence over TP ranks
    return -(-longest // multiple) * multiple


def _row_scores(logits: torch.Tensor, rows: Sequence[Row], vocab: int) -> List[Score]:
    """Scores from the last stage's [batch, sequence, vocabulary / TP] logits."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    logprobs = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
    scores: List[Score] = []
    for i, row in enumerate(rows):
        end = len(row.tokens)
        span = logprobs[i, end - len(row.targets): end]
        targets = torch.tensor(row.targets, dtype=torch.long, device=span.device)
        picked = span.gather(1, targets[:, None]).squeeze(1)
        scores.append((float(picked.sum()), bool((span.argmax(dim=-1) == targets).all())))
    return scores


def _score_batch(cfg: RunConfig, model: torch.nn.Module, rows: Sequence[Row]) -> Optional[List[Score]]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device
    length = _padded_length(max(len(r.tokens) for r in rows), cfg.parallel.tp)
    tokens = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
    positions = torch.arange(length, dtype=torch.long).expand(len(rows), length)

    def forward_step(data_iterator: Iterator, chunk: torch.nn.Module):
        ids, pos = next(data_iterator)
        first = parallel_state.is_pipeline_first_stage()
        out = chunk(ids.to(device) if first else None, pos.to(device) if first else None, attention_mask=None)

        def collect(output: torch.Tensor, non_loss_data: bool = False):
            if not non_loss_data:  # the schedule is run with collect_non_loss_data=True: it hands over what this returns
                raise RuntimeError("scoring expects megatron-core's schedule to collect non-loss data")
            return _row_scores(output, rows, cfg.model.vocab_size)

        return out, collect

    store = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([(tokens, positions)]), model=[model], num_microbatches=1,
        seq_length=length, micro_batch_size=len(rows), decoder_seq_length=length, forward_only=True,
        collect_non_loss_data=True,
    )
    last = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    return store[0] if last else None


@torch.no_grad()
def score_rows(cfg: RunConfig, model: torch.nn.Module, rows: Sequence[Row], batch_size: int) -> List[Score]:
    """Every row's score, on every rank of the layout (each calls this with the same rows)."""
    from megatron_recipes.runtime import collectives

    model.eval()
    mine: Optional[List[Score]] = []
    for start in range(0, len(rows), batch_size):
        got = _score_batch(cfg, model, rows[start: start + batch_size])
        mine = mine + got if (mine is not None and got is not None) else None
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return mine or []
    # the pipeline's last stage holds them (each data-parallel copy alike): hand them to every rank
    return next(scores for scores in collectives.all_gather_object(mine) if scores is not None)
