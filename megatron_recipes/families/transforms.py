"""Typed transforms between HF tensors and one megatron-core tensor, shared by every model family.

A transform describes one megatron tensor (for one layer, one expert) in terms of HF tensors, in the
megatron *global* layout (what dist-checkpointing stores, independent of TP/PP/EP):

- ``hf_shapes``: the HF names and shapes it consumes, derived from the megatron shape (used to check a
  HF folder before writing anything and to lay out an export's headers);
- ``fill``: import; writes the HF rows straight into the megatron buffer (no intermediate copies);
- ``pieces``: export; the HF tensors as contiguous row pieces of the megatron tensor (views, no copies);
- ``check``: import, before anything is written; what the HF tensors' values must satisfy (most: nothing).

Megatron's global layouts: fused QKV is ``[q_1..q_n, k, v]`` per query group, groups in order; a gated
MLP's fc1 is ``[gate; up]``; embeddings and the output layer carry padded vocabulary rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from megatron_recipes.config import derived
from megatron_recipes.config.schema import ModelConfig

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Ctx:
    """Where a tensor sits: the model, and its layer/expert index when it has one."""

    model: ModelConfig
    layer: Optional[int] = None
    expert: Optional[int] = None
    extra: Dict[str, object] = field(default_factory=dict, compare=False, hash=False)  # family flags

    def name(self, template: str) -> str:
        return template.format(layer=self.layer, expert=self.expert)


class Source(Protocol):
    """Reads rows of a HF tensor into a buffer (the streaming safetensors reader)."""

    def read_rows(self, name: str, out: torch.Tensor, start: int = 0) -> None: ...

    def info(self, name: str) -> object: ...  # its ``shape``

    def __contains__(self, name: object) -> bool: ...


class Transform:
    def hf_shapes(self, shape: Shape, ctx: Ctx) -> Dict[str, Shape]:
        raise NotImplementedError

    def check(self, src: Source, ctx: Ctx) -> List[str]:
        """Problems with the HF tensors' values (their names and shapes are checked already)."""
        return []

    def optional_on_import(self, ctx: Ctx) -> List[str]:
        """HF names of ``hf_shapes`` an import may find absent (copies of another tensor it reads), which
        export still writes."""
        return []

    def fill(self, out: torch.Tensor, src: Source, ctx: Ctx) -> None:
        raise NotImplementedError

    def pieces(self, t: torch.Tensor, ctx: Ctx) -> Dict[str, List[torch.Tensor]]:
        raise NotImplementedError


@dataclass(frozen=True)
class Copy(Transform):
    """The same tensor on both sides (norms, projections, router weights)."""

    hf: str

    def hf_shapes(self, shape, ctx):
        return {ctx.name(self.hf): tuple(shape)}

    def fill(self, out, src, ctx):
        src.read_rows(ctx.name(self.hf), out)

    def pieces(self, t, ctx):
        return {ctx.name(self.hf): [t]}


def mtp_hf_layers(model: ModelConfig) -> range:
    """The ``{layer}`` of each MTP layer: they count on after the decoder's layers."""
    return range(model.num_layers, model.num_layers + (model.mtp_num_layers or 0))


@dataclass(frozen=True)
class Vocab(Transform):
    """Embedding / output rows: zero padding rows up to megatron's padded vocabulary; cut on export.

    ``per_mtp_layer``: where HF stores the same rows once more for each MTP layer (``{layer}``: its index), as
    DeepSeek-V3 stores the embedding and output head its MTP layers share with the model. megatron-core's MTP
    layers use the model's own, so import requires each copy present to equal them (a folder without the
    copies, as Megatron-Bridge exports DeepSeek-V3, imports the same), and export writes them back.
    """

    hf: str
    per_mtp_layer: str = ""

    def _copies(self, ctx: Ctx) -> List[str]:
        if not self.per_mtp_layer:
            return []
        return [self.per_mtp_layer.format(layer=i) for i in mtp_hf_layers(ctx.model)]

    def hf_shapes(self, shape, ctx):
        rows = (ctx.model.vocab_size, *shape[1:])
        return {name: rows for name in [ctx.name(self.hf), *self._copies(ctx)]}

    def optional_on_import(self, ctx):
        return self._copies(ctx)

    def fill(self, out, src, ctx):
        v = ctx.model.vocab_size
        src.read_rows(ctx.name(self.hf), out[:v])
        out[v:].zero_()

    def pieces(self, t, ctx):
        rows = t[: ctx.model.vocab_size]
        return {name: [rows] for name in [ctx.name(self.hf), *self._copies(ctx)]}

    def check(self, src, ctx, rows: int = 4096):
        """Each MTP layer's copy equals the model's rows, compared block by block (two blocks in memory)."""
        main, v = ctx.name(self.hf), ctx.model.vocab_size
        problems = []
        for copy in self._copies(ctx):
            if copy not in src:  # an absent copy is allowed (optional_on_import)
                continue
            width = src.info(main).shape[1:]
            for start in range(0, v, rows):
                n = min(rows, v - start)
                a, b = torch.empty((n, *width)), torch.empty((n, *width))
                src.read_rows(main, a, start), src.read_rows(copy, b, start)
                if not torch.equal(a, b):
                    first = start + int((a != b).reshape(n, -1).any(dim=1).nonzero()[0])
                    problems.append(f"{copy} differs from {main} (first at row {first}): megatron-core's MTP layers share "
                                    "the model's embedding and output head, so a separate one cannot be imported")
                    break
        return problems


@dataclass(frozen=True)
class QKV(Transform):
    """Separate q/k/v projections (weights or biases) <-> megatron's fused per-query-group layout."""

    q: str
    k: str
    v: str

    @staticmethod
    def _dims(ctx: Ctx) -> Tuple[int, int, int]:
        m = ctx.model
        groups = m.num_query_groups
        return groups, m.num_attention_heads // groups, derived.head_dim(m)

    def hf_shapes(self, shape, ctx):
        groups, per_group, d = self._dims(ctx)
        rest = tuple(shape[1:])
        return {
            ctx.name(self.q): (groups * per_group * d, *rest),
            ctx.name(self.k): (groups * d, *rest),
            ctx.name(self.v): (groups * d, *rest),
        }

    def fill(self, out, src, ctx):
        groups, n, d = self._dims(ctx)
        block = (n + 2) * d
        for g in range(groups):
            base = g * block
            src.read_rows(ctx.name(self.q), out[base : base + n * d], g * n * d)
            src.read_rows(ctx.name(self.k), out[base + n * d : base + (n + 1) * d], g * d)
            src.read_rows(ctx.name(self.v), out[base + (n + 1) * d : base + block], g * d)

    def pieces(self, t, ctx):
        groups, n, d = self._dims(ctx)
        block = (n + 2) * d
        q, k, v = [], [], []
        for g in range(groups):
            base = g * block
            q.append(t[base : base + n * d])
            k.append(t[base + n * d : base + (n + 1) * d])
            v.append(t[base + (n + 1) * d : base + block])
        return {ctx.name(self.q): q, ctx.name(self.k): k, ctx.name(self.v): v}


@dataclass(frozen=True)
class Gated(Transform):
    """Gated MLP: HF gate and up projections <-> megatron's fc1 ``[gate; up]``."""

    gate: str
    up: str

    def hf_shapes(self, shape, ctx):
        half = (shape[0] // 2, *shape[1:])
        return {ctx.name(self.gate): half, ctx.name(self.up): half}

    def fill(self, out, src, ctx):
        half = out.shape[0] // 2
        src.read_rows(ctx.name(self.gate), out[:half])
        src.read_rows(ctx.name(self.up), out[half:])

    def pieces(self, t, ctx):
        half = t.shape[0] // 2
        return {ctx.name(self.gate): [t[:half]], ctx.name(self.up): [t[half:]]}


def _rope_permutation(block: int, rope: int, rows: int, inverse: bool) -> torch.Tensor:
    """Row order that turns interleaved RoPE pairs (x0,y0,x1,y1..) into halves (x0,x1..,y0,y1..) per block."""
    half_order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    within = torch.cat([torch.arange(block - rope), block - rope + half_order])
    perm = torch.cat([b * block + within for b in range(rows // block)])
    return torch.argsort(perm) if inverse else perm


@dataclass(frozen=True)
class RopeRows(Transform):
    """Rows whose trailing RoPE channels megatron-core's MLA stores interleaved (x0,y0,x1,y1..).

    megatron-core's MLA de-interleaves those channels itself before rotating halves, as HF DeepSeek does
    with ``rope_interleave: true``; a HF model stored in halves (``rope_interleave: false``) has its RoPE
    rows interleaved once here, and back on export.
    """

    hf: str
    block: Callable[[ModelConfig], int]  # rows per head (or the whole tensor)
    rope: Callable[[ModelConfig], int]  # trailing RoPE rows in each block

    def _halves_order(self, rows: int, ctx: Ctx) -> Optional[torch.Tensor]:
        if ctx.extra.get("rope_interleave", True):
            return None
        return _rope_permutation(self.block(ctx.model), self.rope(ctx.model), rows, inverse=False)

    def hf_shapes(self, shape, ctx):
        return {ctx.name(self.hf): tuple(shape)}

    def fill(self, out, src, ctx):
        order = self._halves_order(out.shape[0], ctx)
        if order is None:
            src.read_rows(ctx.name(self.hf), out)
            return
        halves = torch.empty_like(out)
        src.read_rows(ctx.name(self.hf), halves)
        torch.index_select(halves, 0, torch.argsort(order), out=out)

    def pieces(self, t, ctx):
        order = self._halves_order(t.shape[0], ctx)
        return {ctx.name(self.hf): [t if order is None else t.index_select(0, order)]}
