"""Context parallelism without Transformer Engine: the load-balanced sequence split and a core attention for it.

Why: megatron-core's local ``DotProductAttention`` refuses CP, so without this module CP would exist only
on a GPU with Transformer Engine and nothing could test it. The scheme is TE's ``cp_comm_type=all_gather``:

- The split (``cp_positions``/``split_for_cp``): the sequence is cut into ``2*cp`` equal chunks and CP rank
  ``r`` keeps chunks ``r`` and ``2*cp-1-r``, so under a causal mask every rank does the same amount of work.
  This is the order megatron-core's rotary embedding (``get_pos_emb_on_this_cp_rank``) and TE expect.
- The attention (``ContextParallelSDPAttention``): each rank's keys/values are all-gathered over the CP
  group (megatron-core's autograd gather: the backward reduce-scatters their gradients) and the local
  queries attend to them with ``scaled_dot_product_attention`` under a causal mask computed from the global
  positions of the chunks. Under GQA the gathered K/V are ``num_query_groups/num_heads`` of the queries' size.
  Packed sequences bring their own mask (``cp_packed_attention_mask``: local query rows, gathered key
  columns), so per-sample boundaries are honoured exactly.

``spec_supports_context_parallel`` answers, for a built layer spec, whether its core attention can run CP;
``local_cp_limits`` answers, before anything is built, what of a recipe this attention cannot run under CP.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.models.local_spec import SDPAttention


def cp_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens CP rank ``cp_rank`` holds: chunks ``r`` and ``2*cp-1-r`` of ``2*cp``."""
    if seq_length % (2 * cp_size):
        raise RecipeError(
            f"sequence length {seq_length} is not divisible by 2*cp = {2 * cp_size}",
            fix="choose train.seq_length as a multiple of 2 * parallel.cp (rule cp.sequence_divisible)",
        )
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def gathered_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the keys after the CP all-gather (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([cp_positions(seq_length, cp_size, r, device) for r in range(cp_size)])


def split_for_cp(tensor: Optional[torch.Tensor], cp_size: int, cp_rank: int, seq_dim: int = 1) -> Optional[torch.Tensor]:
    """This CP rank's share of a ``[b, S, ...]`` batch tensor (tokens, labels, loss mask, position ids)."""
    if tensor is None or cp_size == 1:
        return tensor
    index = cp_positions(tensor.size(seq_dim), cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(seq_dim, index)


def cp_packed_attention_mask(full_mask: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """A ``[b, 1, S, S]`` packed-sequence mask cut to this rank's query rows and the gathered key order."""
    s = full_mask.size(-1)
    rows = cp_positions(s, cp_size, cp_rank, device=full_mask.device)
    cols = gathered_positions(s, cp_size, device=full_mask.device)
    return full_mask.index_select(-2, rows).index_select(-1, cols)


def _unsupported_under_cp(config, attention_dropout: Optional[float]) -> list:
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    problems = []
    if config.window_size is not None:
        problems.append("model.sliding_window (sliding-window attention)")
    if config.softmax_type != "vanilla":
        problems.append(f"softmax_type={config.softmax_type}")
    if config.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling")
    if dropout:
        problems.append(f"attention dropout {dropout}")
    return problems


def local_cp_limits(cfg) -> list:
    """What of ``cfg`` (a RunConfig at cp>1) this module's CP attention cannot run, as the attention itself
    would refuse it at build or forward time; empty when it can."""
    from megatron_recipes.models.transformer_config import build_transformer_config

    config = build_transformer_config(cfg, use_te=False, cpu_init=True)
    problems = _unsupported_under_cp(config, None)
    m = cfg.model
    if m.multi_latent_attention and m.qk_head_dim + m.qk_pos_emb_head_dim != m.v_head_dim:
        problems.append(
            f"multi-latent attention with query/key head size {m.qk_head_dim}+{m.qk_pos_emb_head_dim} != value head size {m.v_head_dim}"
        )
    return problems


class ContextParallelSDPAttention(SDPAttention):
    """The local spec's SDPA core attention, able to run under context parallelism (all-gathered K/V)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            problems = _unsupported_under_cp(config, attention_dropout)
            if problems:
                raise RecipeError(
                    f"context parallelism on the local layer spec (no Transformer Engine) does not support {', '.join(problems)}",
                    fix="set parallel.cp=1, or run on a GPU with Transformer Engine",
                )
        # The parent refuses CP (its materialised attention cannot); it sees a CP=1 copy of the config.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection)
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None or query.size(-1) != value.size(-1):
            raise RecipeError(
                "context parallelism on the local layer spec takes [s, b, h, d] inputs with equal q/k/v head sizes, "
                "no THD packing and no attention bias",
                fix="set parallel.cp=1, or run on a GPU with Transformer Engine",
            )
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        group = parallel_state.get_context_parallel_group()
        rank = parallel_state.get_context_parallel_rank()
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=group)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if attention_mask is not None:  # packed sequences: rows = local queries, columns = gathered keys
            allowed = ~attention_mask.bool()
        else:
            seq = query.size(0) * self.cp_size
            q_pos = cp_positions(seq, self.cp_size, rank, device=q.device)
            k_pos = gathered_positions(seq, self.cp_size, device=q.device)
            allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [s_local, S]: causal in global positions
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def spec_supports_context_parallel(layer_spec) -> bool:
    """Whether every layer of a built decoder block spec has a core attention that can run CP.

    Transformer Engine's attention and ``ContextParallelSDPAttention`` can; megatron-core's local
    ``DotProductAttention`` (and anything else) cannot.
    """
    layers = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for layer in layers:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        core = getattr(getattr(attention, "submodules", None), "core_attention", None)
        if not isinstance(core, type) or not _is_cp_capable(core):
            return False
    return True


def _is_cp_capable(core: type) -> bool:
    if issubclass(core, ContextParallelSDPAttention):
        return True
    return core.__module__.startswith("megatron.core.extensions.transformer_engine")
