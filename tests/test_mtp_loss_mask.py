"""Multi-token prediction honours the loss mask: the trainer's forward step hands it to GPTModel.

The MTP head computes its own loss inside GPTModel.forward (and adds its gradient in backward); it masks
that loss with the ``loss_mask`` the forward receives, and without one it trains on every position:
SFT prompts, padding, the seams of packed samples. Two batches that differ only in labels where the
loss mask is 0 must then give the same gradients, the MTP head's included.
"""

from __future__ import annotations

import pytest

from multiproc import run_ranks

SEQ, BATCH, PROMPT = 16, 2, 6


def _grads_for_two_batches(overrides):
    """(one rank) Gradients of the trainer's forward step + loss on batch A and on batch B (A's labels
    changed where the mask is 0), on a tiny fp32 model with one MTP layer (local spec)."""
    import torch

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import step

    cfg = compose_recipe("tiny_llama_cpu", overrides)
    runtime = distributed.init_model_parallel(cfg)
    (model,) = build_model_chunks(cfg)
    from megatron_recipes.config import derived

    forward_step = step.make_forward_step(runtime.device, use_te=False, mtp=derived.mtp_stage(cfg))
    vocab = cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ)
    mask[:, :PROMPT] = 0  # an SFT prompt: no loss there
    labels_a = torch.roll(tokens, -1, dims=1)
    labels_b = labels_a.clone()
    labels_b[:, :PROMPT] = torch.randint(0, vocab, (BATCH, PROMPT), generator=g)
    assert not torch.equal(labels_a, labels_b)

    def grads(labels):
        batch = {"tokens": tokens, "labels": labels, "loss_mask": mask,
                 "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()}
        model.zero_grad(set_to_none=True)
        output, loss = forward_step(iter([batch]), model)
        loss_sum, _, _ = loss(output)
        loss_sum.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    a, b = grads(labels_a), grads(labels_b)
    mtp = sorted(name for name in a if name.startswith("mtp."))
    differ = sorted(name for name in a if not torch.equal(a[name], b[name]))
    mtp_moves = any(bool(a[name].abs().sum() > 0) for name in mtp)
    distributed.shutdown()
    return mtp, mtp_moves, differ


@pytest.mark.slow
def test_mtp_loss_ignores_labels_where_the_loss_mask_is_zero():
    overrides = ["parallel=none", "cluster.gpus_per_node=1", "run.dir=unused", "precision=fp32",
                 "model.mtp_num_layers=1", "model.num_layers=2", "model.vocab_size=256"]
    mtp, mtp_moves, differ = run_ranks(_grads_for_two_batches, 1, overrides)[0]
    assert mtp and mtp_moves, "the MTP layer must train (else this test shows nothing)"
    assert differ == [], f"gradients depend on labels under loss_mask=0: {differ}"
