"""Attention inputs for packed rows: every pipeline stage rebuilds them from ``segment_ids``.

``packed_attention_mask`` is for megatron-core's local (non-TE) attention, which takes a boolean mask
with True = masked out: block-diagonal and causal, so no token attends across samples. Padding tokens
(segment -1) attend only to themselves, which keeps every softmax row finite. ``packed_seq_params``
gives Transformer Engine the same boundaries as ``cu_seqlens`` in the ``thd`` layout.
"""

from __future__ import annotations

import torch


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool mask, True where attention is not allowed."""
    seg = segment_ids.to(torch.int64)
    s = seg.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # [b, s, s]
    real = (seg >= 0).unsqueeze(-1)
    allowed = same & causal & real
    eye = torch.eye(s, dtype=torch.bool, device=seg.device)
    allowed |= eye & ~real  # padding: itself only
    return (~allowed).unsqueeze(1)


def cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths of the flattened batch's sequences; each row's padding is one more sequence."""
    bounds = [0]
    offset = 0
    for row in segment_ids.to(torch.int64).cpu():
        change = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        bounds += (offset + change).tolist() + [offset + row.numel()]
        offset += row.numel()
    return torch.tensor(bounds, dtype=torch.int32, device=segment_ids.device)


def packed_seq_params(segment_ids: torch.Tensor):
    """megatron-core ``PackedSeqParams`` (qkv_format ``thd``) for Transformer Engine attention."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens(segment_ids)
    longest = int((cu[1:] - cu[:-1]).max().item())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
