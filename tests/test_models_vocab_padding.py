"""Padded vocabulary rows are not tokens: their logits are masked, so the loss is the real-vocab loss.

Megatron pads the output layer to a multiple of make_vocab_size_divisible_by x TP. Without masking, an
imported HF model (pad rows zero) would take softmax mass on them and its loss would differ from the HF
model's. Checked at TP=1 and TP=2 (where only the second rank's shard holds padding).
"""

from __future__ import annotations

import pytest

from multiproc import run_ranks

VOCAB = 1000  # padded to 1024 with make_vocab_size_divisible_by=128 at TP=1 and TP=2


def _rank(tp: int, world: int):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from megatron_recipes.config import compose_recipe
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime.distributed import init_model_parallel

    cfg = compose_recipe(
        "tiny_llama_cpu",
        [f"model.vocab_size={VOCAB}", f"parallel.tp={tp}", f"cluster.gpus_per_node={world}", "train.seq_length=16"],
    )
    init_model_parallel(cfg)
    (model,) = build_model_chunks(cfg)
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        losses = model(tokens, positions, None, labels=labels)
        shard = model(tokens, positions, None)  # [b, s, padded/tp]
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(tp)]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    logits = torch.cat(parts, dim=-1)
    reference = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="none")
    return {
        "padded": logits.shape[-1],
        "pad_logits_max": logits[..., VOCAB:].max().item(),
        "max_abs_diff": (losses.reshape(-1).float() - reference).abs().max().item(),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_rows_take_no_probability(tp):
    result = run_ranks(_rank, tp, tp, tp)[0]
    assert result["padded"] == 1024
    assert result["pad_logits_max"] < -1e30
    assert result["max_abs_diff"] < 1e-5
