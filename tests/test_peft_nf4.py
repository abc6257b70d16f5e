"""NF4 numerics: the code book, blockwise absmax, packing, double quantisation, memory, errors."""

from __future__ import annotations

import pytest
import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.peft import nf4


def test_code_book_is_the_published_table_and_the_normal_quantile_construction():
    table = torch.tensor(nf4.NF4_LEVELS, dtype=torch.float64)
    assert table.numel() == 16 and torch.all(table[1:] > table[:-1])
    assert table[0] == -1.0 and table[7] == 0.0 and table[15] == 1.0
    built = nf4.normal_float_levels()
    assert torch.allclose(built, table, atol=1e-6, rtol=0), (built - table).abs().max()


def test_dynamic_code_book_for_the_scales():
    code = nf4.dynamic_code()
    assert code.numel() == 256 and torch.all(code[1:] >= code[:-1])
    assert 0.0 in code.tolist() and code.max() == 1.0
    # decade 10^0 holds 64 midpoints of linspace(0.1, 1, 65): the largest negative is -(1 + 0.9859375) / 2
    assert code.min().item() == pytest.approx(-0.99296875, abs=1e-7)
    positive = code[code > 0]
    assert positive.min().item() == pytest.approx(0.55e-6, rel=1e-5)  # decade 10^-6: one midpoint, 0.55


def _block(values, fill=0.0, n=64):
    out = torch.full((n,), fill)
    out[: len(values)] = torch.tensor(values)
    return out


def test_hand_computed_codes_scales_and_packing():
    # block 0: absmax 1.0; block 1: absmax 4.0 (values are scaled by 1/absmax before rounding)
    b0 = _block([0.5, -1.0, 0.25, 0.1, -0.3, 1.0])
    b1 = _block([4.0, -2.0, 0.0, 1.0])
    q = nf4.quantize_nf4(torch.cat([b0, b1]).view(2, 64), block_size=64, double_quant_block_size=None)
    assert q.absmax.view(torch.float32).tolist() == [1.0, 4.0]
    codes = torch.stack([q.packed >> 4, q.packed & 0x0F], dim=1).reshape(-1).tolist()
    # nearest levels by hand: 0.5 -> 0.4407 (12: |0.0593| < |0.0626| to 0.5626); -1 -> 0; 0.25 -> 0.2461 (10);
    # 0.1 -> 0.0796 (8); -0.3 -> -0.2844 (4); 1 -> 15; zeros -> 7
    assert codes[:6] == [12, 0, 10, 8, 4, 15] and set(codes[6:64]) == {7}
    # 4/4 -> 15; -2/4 = -0.5 -> -0.5251 (2); 0 -> 7; 1/4 -> 0.2461 (10)
    assert codes[64:68] == [15, 2, 7, 10]
    assert q.packed[0].item() == (12 << 4) | 0  # first value in the high nibble
    deq = nf4.dequantize_nf4(q)
    assert deq[0, 0].item() == pytest.approx(nf4.NF4_LEVELS[12] * 1.0)
    assert deq[1, 1].item() == pytest.approx(nf4.NF4_LEVELS[2] * 4.0)
    assert deq[1, 3].item() == pytest.approx(nf4.NF4_LEVELS[10] * 4.0)


def test_double_quantisation_of_the_scales_by_hand():
    w = torch.cat([_block([1.0]), _block([4.0])]).view(2, 64)
    q = nf4.quantize_nf4(w, block_size=64, double_quant_block_size=256)
    assert q.absmax.dtype == torch.uint8 and q.offset.view(torch.float32).item() == 2.5  # mean of [1, 4]
    # residuals [-1.5, 1.5] in one (partial) block of 256: absmax2 = 1.5, normalised [-1, 1];
    # +1 is a code value, -1 is not: the nearest is -0.99296875
    assert q.absmax2.view(torch.float32).tolist() == [1.5]
    scales = nf4.block_scales(q).tolist()
    assert scales[0] == pytest.approx(2.5 - 1.5 * 0.99296875, abs=1e-6)
    assert scales[1] == pytest.approx(4.0, abs=1e-6)


def test_round_trip_error_is_bounded_by_half_the_widest_level_gap():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    q = nf4.quantize_nf4(w, 64, None)
    deq = nf4.dequantize_nf4(q)
    absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    gap = max(b - a for a, b in zip(nf4.NF4_LEVELS, nf4.NF4_LEVELS[1:])) / 2
    err = (w.reshape(-1, 64) - deq.reshape(-1, 64)).abs()
    assert torch.all(err <= absmax * gap + 1e-7)
    q2 = nf4.quantize_nf4(w, 64, 256)  # double quantisation only perturbs the scales slightly
    assert (nf4.dequantize_nf4(q2) - deq).abs().max() < 0.02 * w.abs().max()


def test_memory_is_at_least_3_5x_smaller_than_bf16():
    w = torch.randn(512, 1024)
    q = nf4.quantize_nf4(w, 64, 256)
    bf16 = w.numel() * 2
    assert bf16 / q.nbytes() >= 3.5, bf16 / q.nbytes()
    assert bf16 / q.nbytes() == pytest.approx(2 / (0.5 + 1 / 64 + 4 / (64 * 256) + 4 / w.numel()), rel=1e-6)


def test_statistics_survive_a_module_dtype_cast():
    """Float16Module casts every floating buffer; the fp32 scales travel as int32 bit patterns."""
    q = nf4.quantize_nf4(torch.randn(16, 128), 64, 256)
    holder = torch.nn.Module()
    for name in ("packed", "absmax", "absmax2", "offset"):
        holder.register_buffer(name, getattr(q, name).clone())
    holder.bfloat16()
    again = nf4.NF4Tensor(holder.packed, holder.absmax, holder.absmax2, holder.offset, q.shape, 64, 256)
    assert torch.equal(nf4.dequantize_nf4(again), nf4.dequantize_nf4(q))


def test_block_size_that_does_not_divide_is_a_clear_error():
    with pytest.raises(RecipeError, match=r"nf4_block_size=48 does not divide"):
        nf4.quantize_nf4(torch.randn(4, 40), block_size=48)
    with pytest.raises(RecipeError, match="even number"):
        nf4.quantize_nf4(torch.randn(4, 64), block_size=63)


@pytest.mark.skipif(not nf4.bnb_available(), reason="bitsandbytes is not importable here")
def test_bitsandbytes_agrees():
    """Same code books and NF4 codes; bnb's kernel dequantises our storage to the same numbers.

    bitsandbytes' own 8-bit quantiser of the scales picks the farther code in rare near-ties (its binary
    search), so its scale codes may differ by one step in a few blocks; ours is the nearest code.
    """
    import bitsandbytes.functional as bnbf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(bnbf.create_dynamic_map(signed=True), nf4.dynamic_code())
    w = (torch.randn(256, 512) * 0.02).to(device)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = nf4.quantize_nf4(w, 64, 256)
    assert torch.equal(packed.view(-1), ours.packed)
    assert torch.equal(state.absmax2 if hasattr(state, "absmax2") else state.state2.absmax, ours.absmax2.view(torch.float32))
    assert (state.absmax != ours.absmax).float().mean() < 0.01
    assert torch.equal(nf4.bnb_dequantize(ours, torch.float32).float(), nf4.dequantize_nf4(ours))
