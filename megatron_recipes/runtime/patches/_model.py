"""Rows for what every model runs, on GPUs and on the CPU lane alike (scope ``model``: applied where the model
builder starts, ``models/builder.py``).

Each ``_fix`` / ``_defect`` pair is one row of the table in ``runtime/patches/__init__.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Iterator

import torch


# --- model: the MoE router's load-balancing loss under per-token loss ----------------------------
#
# The trainer sets calculate_per_token_loss: finalize_model_grads divides every gradient by the step's token
# count, summed over micro-batches and data x context ranks, each micro-batch counted as its loss function
# counted it (the whole micro-batch of this DP rank, CP share aside). So that the aux loss keeps its intended
# 1/(micro-batches x DP) weight, megatron-core multiplies it by "this micro-batch's tokens" before attaching
# it. Up to 0.18 that count is the router's own tokens: under sequence parallelism the router sees 1/TP of
# the sequence (1/(TP x CP) with CP), and each TP rank's partial aux-loss gradient is then summed over TP
# (the router weight is marked sequence_parallel): the aux gradient is 1/(TP x CP) of one rank's. The
# seq_aux_loss path passes the count per sequence, so it is 1/micro_batch_size more. 0.19 counts
# num_local_tokens x tp_cp size, and x bsz for seq_aux_loss (Megatron-LM PR 5047 and the seq_aux count fix).


def _scale_aux_loss_by_micro_batch_tokens() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    attach = TopKRouter.attach_and_log_load_balancing_loss
    if getattr(attach, "_megatron_recipes", False):
        return
    seq_aux = TopKRouter._apply_seq_aux_loss
    attach_signature, seq_signature = inspect.signature(attach), inspect.signature(seq_aux)

    @functools.wraps(attach)
    def attach_and_log_load_balancing_loss(self, *args, **kwargs):
        if not self.calculate_per_token_loss:
            return attach(self, *args, **kwargs)
        bound = attach_signature.bind(self, *args, **kwargs)
        count = bound.arguments.get("valid_token_count")
        if count is None:
            count = bound.arguments["activation"].shape[0]
        sequences = getattr(self, "_megatron_recipes_sequences", 1)  # set by _apply_seq_aux_loss below
        bound.arguments["valid_token_count"] = count * sequences * self.tp_cp_group.size()
        return attach(*bound.args, **bound.kwargs)

    @functools.wraps(seq_aux)
    def _apply_seq_aux_loss(self, *args, **kwargs):
        self._megatron_recipes_sequences = seq_signature.bind(self, *args, **kwargs).arguments["bsz"]
        try:
            return seq_aux(self, *args, **kwargs)
        finally:
            self._megatron_recipes_sequences = 1

    attach_and_log_load_balancing_loss._megatron_recipes = True
    TopKRouter.attach_and_log_load_balancing_loss = attach_and_log_load_balancing_loss
    TopKRouter._apply_seq_aux_loss = _apply_seq_aux_loss


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A 1-rank gloo group in memory where none exists (the router's token count reduce needs one)."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _probe_router(kind: str, tp_cp: int):
    """A real TopKRouter in per-token-loss mode whose TP x CP group reports ``tp_cp`` ranks (a stand-in
    group: what the probes call only asks its size, or reduces over it when it has one rank)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                               moe_router_topk=2, moe_router_load_balancing_type=kind, moe_aux_loss_coeff=1.0,
                               calculate_per_token_loss=True, use_cpu_initialization=True)
    group = types.SimpleNamespace(size=lambda: tp_cp, rank=lambda: 0)
    return TopKRouter(config, pg_collection=types.SimpleNamespace(tp=group, cp=group, tp_cp=group, tp_dp_cp=group))


def _aux_loss_counts_the_routers_share_of_tokens() -> bool:
    """Either count is short: the aux loss attached on a TP x CP = 2 rank is scaled by its own 8 tokens, not
    16 (the micro-batch, as the loss function counts it); or seq_aux_loss's gradient per token halves when
    a micro-batch holds the same sequence twice (counted per sequence, not per micro-batch)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        router = _probe_router("aux_loss", tp_cp=2)
        aux = torch.ones((), requires_grad=True)
        activation = torch.zeros(8, 4, requires_grad=True)
        router.attach_and_log_load_balancing_loss(activation, 1.0, aux, "load_balancing_loss", router.tp_cp_group,
                                                  valid_token_count=8).sum().backward()
        if aux.grad.item() != 16.0:
            return True
        router = _probe_router("seq_aux_loss", tp_cp=1)
        one = torch.rand(6, 1, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)

        def grad_of_first_sequence(bsz: int) -> torch.Tensor:
            scores = one.expand(6, bsz, 4).reshape(6 * bsz, 4).clone().requires_grad_(True)
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2, dim=1).indices, True)
            probs = torch.zeros_like(scores, requires_grad=True)
            with _one_process_group():
                router._apply_seq_aux_loss(probs, scores, routing_map, 6, bsz).sum().backward()
            return scores.grad.reshape(6, bsz, 4)[:, 0]

        return not torch.allclose(grad_of_first_sequence(2), grad_of_first_sequence(1), rtol=1e-6, atol=0.0)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
