"""Context parallelism's pieces on real gloo ranks: the load-balanced split, the batch path, the CP attention.

- Every CP rank gets exactly ``S/cp`` tokens: chunks ``r`` and ``2*cp-1-r`` of ``2*cp``, for tokens, labels,
  loss mask and position ids alike, through the trainer's real ``forward_step`` into a real model.
- The CP core attention on 2 ranks (each holding its chunks) gives the outputs and the q/k/v gradients of
  plain full-sequence attention computed by hand, for causal and packed (per-sample) masks, under GQA.
- The spec flag (``spec_supports_context_parallel``) and the machine check say what can run CP here.
"""

from __future__ import annotations

import math

import pytest
import torch

from multiproc import run_ranks

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.models import capabilities
from megatron_recipes.models.context_parallel import cp_positions, split_for_cp

S, B = 32, 2
CP_OVERRIDES = ["parallel=none", "cluster.gpus_per_node=2", "parallel.cp=2", "parallel.cp_comm_type=all_gather",
                f"train.seq_length={S}", f"train.micro_batch_size={B}", "train.global_batch_size=4", "precision=fp32"]


def test_split_keeps_two_balanced_chunks_per_rank():
    for cp in (2, 4):
        shares = [cp_positions(S, cp, r).tolist() for r in range(cp)]
        chunk = S // (2 * cp)
        for r, share in enumerate(shares):
            assert len(share) == S // cp
            assert share == list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
        assert sorted(sum(shares, [])) == list(range(S))
    x = torch.arange(3 * S).reshape(3, S)
    assert torch.equal(split_for_cp(x, 2, 1), x[:, list(range(8, 16)) + list(range(16, 24))])


def _batch(packed: bool):
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    batch = {
        "tokens": pos + 1,  # token value = position + 1: the model's input names the positions it got
        "labels": pos + 100,
        "loss_mask": (pos % 3 != 0).float(),
        "position_ids": pos.clone(),
    }
    if packed:
        batch["segment_ids"] = torch.tensor([[0] * 10 + [1] * 14 + [-1] * 8, [0] * 20 + [1] * 12])
    return batch


def _rank_forward_step(packed: bool):
    """The trainer's forward_step at CP=2 on a real model: what the model and the loss function receive."""
    from megatron.core import parallel_state

    from megatron_recipes.models.builder import build_gpt_model
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import step

    cfg = compose_recipe("tiny_llama_cpu", CP_OVERRIDES)
    distributed.init_model_parallel(cfg)
    model = build_gpt_model(cfg)
    seen = {}

    def capture(module, args, kwargs):
        seen["tokens"], seen["position_ids"] = args[0].clone(), args[1].clone()
        seen["labels"] = kwargs["labels"].clone()
        mask = kwargs.get("attention_mask")
        seen["mask_shape"] = None if mask is None else tuple(mask.shape)

    model.register_forward_pre_hook(capture, with_kwargs=True)
    forward_step = step.make_forward_step(torch.device("cpu"), use_te=False)
    output, loss_fn = forward_step(iter([_batch(packed)]), model)
    _, num_tokens, _ = loss_fn(output)
    rank = parallel_state.get_context_parallel_rank()
    return {"rank": rank, "output_shape": tuple(output.shape), "num_tokens": int(num_tokens), **seen}


@pytest.mark.parametrize("packed", [False, True])
def test_each_cp_rank_sees_only_its_chunks(packed):
    results = run_ranks(_rank_forward_step, 2, packed, timeout=600)
    full = _batch(packed)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        idx = cp_positions(S, 2, r["rank"])
        assert r["tokens"].shape == (B, S // 2), f"CP rank {r['rank']} got tokens of shape {tuple(r['tokens'].shape)}"
        for key in ("tokens", "position_ids", "labels"):
            assert torch.equal(r[key], full[key][:, idx]), f"CP rank {r['rank']} got the wrong {key}: {r[key][0].tolist()}"
        assert r["output_shape"] == (B, S // 2)
        assert r["num_tokens"] == int(full["loss_mask"][:, idx].sum())
        assert r["mask_shape"] == ((B, 1, S // 2, S) if packed else None)
    assert sum(r["num_tokens"] for r in results) == int(full["loss_mask"].sum())


def _reference_attention(q, k, v, masked):
    """Plain attention over the whole sequence: [S, b, heads, d] inputs, ``masked`` [b|1, 1, S, S] True = off."""
    heads, groups = q.size(2), k.size(2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    out = probs @ v  # [b, heads, S, d]
    return out.permute(2, 0, 1, 3).reshape(q.size(2), q.size(0), -1)


def _rank_attention(packed: bool):
    """CP attention on this rank's chunks vs hand-written full attention: outputs and q/k/v gradients."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import custom_backward
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_recipes.data.attention import packed_attention_mask
    from megatron_recipes.models.context_parallel import ContextParallelSDPAttention, cp_packed_attention_mask
    from megatron_recipes.runtime import distributed

    distributed.init_process_group()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    rank = parallel_state.get_context_parallel_rank()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               context_parallel_size=2, use_cpu_initialization=True, attention_dropout=0.0)
    attention = ContextParallelSDPAttention(config, 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, 4, 16, generator=gen, dtype=torch.float64).float()
    k, v = (torch.randn(S, B, 2, 16, generator=gen, dtype=torch.float64).float() for _ in range(2))
    weight = torch.randn(S, B, 64, generator=gen)
    if packed:
        segments = torch.tensor([[0] * 10 + [1] * 14 + [-1] * 8, [0] * 20 + [1] * 12])
        full_mask = packed_attention_mask(segments)
        local_mask = cp_packed_attention_mask(full_mask, 2, rank)
    else:
        full_mask = ~torch.ones(S, S, dtype=torch.bool).tril().view(1, 1, S, S)
        local_mask = None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = _reference_attention(*ref_in, full_mask)
    (ref_out * weight).sum().backward()
    mine = [split_for_cp(t, 2, rank, seq_dim=0).clone().requires_grad_() for t in (q, k, v)]
    out = attention(*mine, local_mask)
    # the schedules' own backward call (Tensor.backward would run outside the CPU lane's device mapping)
    custom_backward((out * split_for_cp(weight, 2, rank, seq_dim=0)).sum(), None)
    diffs = {"out": (out - split_for_cp(ref_out, 2, rank, seq_dim=0)).abs().max().item()}
    for name, got, ref in zip("qkv", mine, ref_in):
        diffs[f"grad_{name}"] = (got.grad - split_for_cp(ref.grad, 2, rank, seq_dim=0)).abs().max().item()
    return diffs


@pytest.mark.parametrize("packed", [False, True])
def test_cp_attention_equals_full_sequence_attention(packed):
    for rank, diffs in enumerate(run_ranks(_rank_attention, 2, packed, timeout=300)):
        bad = {k: d for k, d in diffs.items() if not d <= 1e-5}
        assert not bad, f"CP rank {rank}: max abs differences from full attention {bad}"


def test_layer_spec_cp_flag():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_recipes.models.builder import layer_spec, transformer_config_for
    from megatron_recipes.models.context_parallel import spec_supports_context_parallel

    cfg = compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1"])
    config = transformer_config_for(cfg)
    assert spec_supports_context_parallel(layer_spec(cfg, config, pp_rank=0, use_te=False))
    assert not spec_supports_context_parallel(get_gpt_layer_local_spec())  # megatron-core's own local spec


def test_machine_check_asks_for_all_gather_without_te():
    machine = capabilities.Machine(cuda=False, transformer_engine=False, deep_ep=False, compute_capability=(0, 0))
    p2p = compose_recipe("tiny_llama_cpu", CP_OVERRIDES[:3] + ["parallel.cp_comm_type=p2p"])
    problems = capabilities.unmet_requirements(p2p, machine)
    assert any("cp_comm_type=all_gather" in p for p in problems), problems
    assert capabilities.unmet_requirements(compose_recipe("tiny_llama_cpu", CP_OVERRIDES), machine) == []
