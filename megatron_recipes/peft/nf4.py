"""4-bit NormalFloat (NF4) storage with double-quantised scales, in plain torch (CPU and GPU).

The numerics follow the QLoRA paper and bitsandbytes' ``quantize_4bit(quant_type="nf4",
compress_statistics=True)`` so a base quantised here and one quantised by bitsandbytes hold the same
codes:

* the weight is flattened row-major and cut into blocks of ``block_size`` (64) values; each block is
  scaled by the reciprocal of its absmax and every value is rounded to the nearest of the 16 NF4 levels;
  two 4-bit codes share a byte, the first in the high nibble;
* the per-block absmax scales (fp32) are stored as 8-bit codes: their mean is subtracted, the
  residuals are cut into blocks of ``double_quant_block_size`` (256) and quantised blockwise with the
  signed 8-bit "dynamic" code book (a partial last block is allowed here);
* dequantisation is ``nf4[code] * (dyn[qabsmax] * absmax2 + offset)`` in fp32, then cast.

On a GPU with bitsandbytes importable its kernels do the same work (``backend="bnb"``); the torch path is
the reference and the only one on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from megatron_recipes.config.errors import RecipeError

# The 16 NF4 levels as published (QLoRA, appendix E; identical to bitsandbytes' table). They are the
# quantiles of N(0, 1) at offset 0.9677083 on each side plus an exact zero, normalised to [-1, 1];
# ``normal_float_levels`` rebuilds them from that definition (the tests compare the two).
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_OFFSET = 0.9677083


def normal_float_levels(offset: float = NF4_OFFSET) -> torch.Tensor:
    """The NF4 construction: 8 positive and 7 negative normal quantiles, one zero, scaled to max 1."""
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return levels / levels.max()


@lru_cache(maxsize=None)
def nf4_code(device: str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def dynamic_code(device: str = "cpu") -> torch.Tensor:
    """The signed 8-bit dynamic (tree) code book used for the second-level scales (Dettmers 2015).

    Seven decades ``10**-6 .. 10**0``; decade ``i`` holds ``2**i`` magnitudes at the midpoints of an even
    split of ``[0.1, 1]``, each with both signs, plus 0 and 1: 256 sorted values. Split and scaling are
    float32 tensor arithmetic, so every entry rounds exactly as in bitsandbytes' table.
    """
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1.0, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (i - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


def _nearest(code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code value (code sorted ascending): compare against the midpoints."""
    mids = (code[1:] + code[:-1]) / 2
    return torch.bucketize(x, mids).to(torch.uint8)


def _blockwise_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """Absmax of consecutive blocks; the last block may be partial."""
    n = flat.numel()
    full = n // block
    parts = []
    if full:
        parts.append(flat[: full * block].view(full, block).abs().amax(dim=1))
    if n % block:
        parts.append(flat[full * block :].abs().amax().reshape(1))
    return torch.cat(parts)


def _scale_blocks(flat: torch.Tensor, per_block: torch.Tensor, block: int) -> torch.Tensor:
    return per_block.repeat_interleave(block)[: flat.numel()]


def quantize_blockwise_8bit(values: torch.Tensor, block: int):
    """Signed dynamic 8-bit blockwise quantisation (the double-quant level). Returns (codes, absmax)."""
    flat = values.reshape(-1).float()
    absmax = _blockwise_absmax(flat, block)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normed = flat * _scale_blocks(flat, inv, block)
    return _nearest(dynamic_code(str(flat.device)), normed), absmax


def dequantize_blockwise_8bit(codes: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    table = dynamic_code(str(codes.device))
    return table[codes.long()] * _scale_blocks(codes, absmax, block)


@dataclass
class NF4Tensor:
    """One quantised weight. fp32 statistics travel as int32 bit patterns so dtype casts of the owning
    module (``Float16Module`` calls ``.bfloat16()``) cannot touch them."""

    packed: torch.Tensor  # uint8 [numel / 2]
    absmax: torch.Tensor  # uint8 [blocks] (double quant) or int32 view of fp32 [blocks]
    absmax2: Optional[torch.Tensor]  # int32 view of fp32 [ceil(blocks / dq_block)], double quant only
    offset: Optional[torch.Tensor]  # int32 view of fp32 [1], double quant only
    shape: torch.Size
    block_size: int
    double_quant_block_size: Optional[int]

    def nbytes(self) -> int:
        tensors = [self.packed, self.absmax, self.absmax2, self.offset]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check_block_size(numel: int, block_size: int, where: str) -> None:
    if block_size < 2 or block_size % 2:
        raise RecipeError(f"peft.nf4_block_size={block_size} must be an even number >= 2", fix="use 64 (QLoRA's value)")
    if numel % block_size:
        raise RecipeError(
            f"peft.nf4_block_size={block_size} does not divide {where} ({numel} values)",
            fix="use a block size that divides it (64 is QLoRA's value)",
        )


def quantize_nf4(weight: torch.Tensor, block_size: int = 64, double_quant_block_size: Optional[int] = 256) -> NF4Tensor:
    """Quantise a weight to NF4. ``double_quant_block_size=None`` keeps the absmax scales in fp32."""
    check_block_size(weight.numel(), block_size, f"a weight of shape {tuple(weight.shape)}")
    flat = weight.detach().reshape(-1).float()
    absmax = _blockwise_absmax(flat, block_size)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normed = flat * _scale_blocks(flat, inv, block_size)
    codes = _nearest(nf4_code(str(flat.device)), normed)
    packed = (codes[0::2] << 4) | codes[1::2]
    if double_quant_block_size is None:
        return NF4Tensor(packed, absmax.view(torch.int32), None, None, weight.shape, block_size, None)
    offset = absmax.mean()
    qabsmax, absmax2 = quantize_blockwise_8bit(absmax - offset, double_quant_block_size)
    return NF4Tensor(
        packed,
        qabsmax,
        absmax2.view(torch.int32),
        offset.reshape(1).view(torch.int32),
        weight.shape,
        block_size,
        double_quant_block_size,
    )


def block_scales(q: NF4Tensor) -> torch.Tensor:
    """The fp32 per-block absmax as dequantisation sees it (after the double-quant round trip)."""
    if q.double_quant_block_size is None:
        return q.absmax.view(torch.float32)
    residual = dequantize_blockwise_8bit(q.absmax, q.absmax2.view(torch.float32), q.double_quant_block_size)
    return residual + q.offset.view(torch.float32)


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = torch.stack([q.packed >> 4, q.packed & 0x0F], dim=1).reshape(-1)
    values = nf4_code(str(q.packed.device))[codes.long()]
    values = values * _scale_blocks(values, block_scales(q), q.block_size)
    return values.view(q.shape).to(dtype)


def bnb_available() -> bool:
    try:
        import bitsandbytes.functional  # noqa: F401
    except Exception:  # absent, or present without a usable native library
        return False
    return True


def bnb_dequantize(q: NF4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantise with bitsandbytes' CUDA kernel from our storage (same layout: high nibble first)."""
    import bitsandbytes.functional as bnbf

    device = q.packed.device
    state2 = None
    absmax = q.absmax.view(torch.float32)
    offset = None
    if q.double_quant_block_size is not None:
        state2 = bnbf.QuantState(
            absmax=q.absmax2.view(torch.float32),
            code=dynamic_code(str(device)),
            blocksize=q.double_quant_block_size,
            dtype=torch.float32,
        )
        absmax, offset = q.absmax, q.offset.view(torch.float32)[0]
    state = bnbf.QuantState(
        absmax=absmax,
        shape=q.shape,
        code=nf4_code(str(device)),
        blocksize=q.block_size,
        quant_type="nf4",
        dtype=dtype,
        offset=offset,
        state2=state2,
    )
    return bnbf.dequantize_4bit(q.packed.view(-1, 1), quant_state=state)
