"""The quantized-weight representation: validation, storage codes, int4 packing."""
import pytest
import torch

from workbench.errors import PlanError
from workbench.quantize import QuantizedWeight, pack_int4, quantize_weight, unpack_int4
from workbench.quantize.qtensor import code_range


@pytest.mark.parametrize("length", [1, 2, 7, 64])
def test_int4_packing_round_trips_including_odd_lengths(length):
    codes = torch.randint(0, 16, (3, length), dtype=torch.uint8, generator=torch.Generator().manual_seed(length))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, (length + 1) // 2)
    assert torch.equal(unpack_int4(packed, length), codes)


def test_packing_puts_even_column_in_the_low_nibble():
    assert pack_int4(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).item() == 0xA3


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_storage_codes_round_trip(bits, symmetric):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    qw = quantize_weight(w, bits, 32, symmetric)
    codes = qw.storage_codes()
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2 ** bits - 1
    back = QuantizedWeight.from_storage_codes(codes, qw.scales, qw.zeros, bits, 32)
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_code_ranges_and_unsupported_bits():
    assert code_range(4, True) == (-8, 7)
    assert code_range(4, False) == (0, 15)
    assert code_range(8, True) == (-128, 127)
    with pytest.raises(PlanError, match="7-bit weights are not supported; choose one of \\[2, 3, 4, 5, 6, 8\\]"):
        code_range(7, True)


def test_shapes_are_validated():
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales shape"):
        QuantizedWeight(q, torch.ones(4, 3), None, 4, 32)
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedWeight(q, torch.ones(4, 2), None, 4, 48)
    qw = QuantizedWeight(q, torch.ones(4, 2), None, 4, 32)
    assert qw.storage_bytes() == 4 * 64 // 2 + 2 * 8
    assert qw.symmetric and qw.n_groups == 2


def test_dequantize_is_codes_minus_zero_times_scale():
    q = torch.tensor([[0, 1, 2, 3]], dtype=torch.uint8)
    qw = QuantizedWeight(q, torch.tensor([[0.5, 2.0]]), torch.tensor([[1, 2]], dtype=torch.uint8), 4, 2)
    assert qw.dequantize().tolist() == [[-0.5, 0.0, 0.0, 2.0]]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("length", [1, 7, 64, 1001])
def test_bit_packing_round_trips_in_exactly_the_counted_bytes(bits, length):
    from workbench.quantize.qtensor import pack_bits, unpack_bits
    codes = torch.randint(0, 1 << bits, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-length * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, length), codes)


def test_bit_packing_is_int4_packing_at_four_bits_and_lowest_bits_first():
    from workbench.quantize.qtensor import pack_bits
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack_bits(codes, 4), pack_int4(codes).reshape(-1))
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([5, 3, 7], dtype=torch.uint8), 3).tolist() == [0b11011101, 0b1]


def test_two_level_weight_dequantizes_exactly_as_code_times_sub_scale_times_channel_scale():
    q = torch.tensor([[-8, 7, 1, -1], [3, 0, -2, 5]], dtype=torch.int8)
    sub = torch.tensor([[16, 1], [3, 2]], dtype=torch.uint8)
    ch = torch.tensor([0.0999755859375, 2.0 ** -20])  # float16 values, one tiny (subnormal in float16)
    qw = QuantizedWeight.two_level_weight(q, sub, ch, 4, 2, 4)
    assert qw.two_level and qw.symmetric and qw.scale_bits == 4
    expected = [[float(c) * float(s) * float(ch[r])
                 for c, s in zip(q[r].tolist(), sub[r].repeat_interleave(2).tolist())] for r in range(2)]
    assert qw.dequantize().tolist() == expected  # exact: float32 holds every product
    # stored: codes at 4 bits, sub-scales at 4 bits, one float16 per row
    assert qw.storage_bytes() == 8 * 4 // 8 + 4 * 4 // 8 + 2 * 2
    rows = qw.rows(torch.tensor([1]))
    assert rows.two_level and torch.equal(rows.dequantize(), qw.dequantize()[1:])
    with pytest.raises(ValueError, match="sub-scales must lie in \\[1, 16\\]"):
        QuantizedWeight.two_level_weight(q, sub * 0, ch, 4, 2, 4)
    with pytest.raises(ValueError, match="symmetric"):
        QuantizedWeight(q.to(torch.uint8), qw.scales, torch.zeros(2, 2, dtype=torch.uint8), 4, 2, sub, ch, 4)
    with pytest.raises(ValueError, match="together"):
        QuantizedWeight(q, qw.scales, None, 4, 2, sub, None, 4)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_new_widths_round_trip_through_storage_codes(bits):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(bits))
    for symmetric in (True, False):
        qw = quantize_weight(w, bits, 32, symmetric)
        lo, hi = code_range(bits, symmetric)
        assert lo <= int(qw.qweight.min()) and int(qw.qweight.max()) <= hi
        back = QuantizedWeight.from_storage_codes(qw.storage_codes(), qw.scales, qw.zeros, bits, 32)
        assert torch.equal(back.dequantize(), qw.dequantize())
        assert qw.storage_bytes() == 8 * 64 * bits // 8 + 2 * 16 + (0 if symmetric else -(-16 * bits // 8))


def test_two_level_minimums_dequantize_as_scale_times_code_minus_minimum():
    """Q4_K's arithmetic: w = (d * sc) * q - (dmin * m), both products exact in float32, one rounding."""
    from workbench.quantize.qtensor import SubScales
    layout = SubScales(6, 63, 8, mins=True)  # 4-column groups in 8-column super-blocks
    q = torch.arange(16, dtype=torch.uint8).view(2, 8)
    sub = torch.tensor([[63, 1], [5, 7]], dtype=torch.uint8)
    sub_min = torch.tensor([[0, 63], [2, 9]], dtype=torch.uint8)
    d, dmin = torch.tensor([[0.0999755859375], [2.0 ** -20]]), torch.tensor([[0.5], [0.25]])
    qw = QuantizedWeight.two_level_weight(q, sub, d, 4, 4, layout, sub_mins=sub_min, channel_mins=dmin)
    assert not qw.symmetric and qw.sub_layout == layout
    want = [[float(q[r, c]) * float(sub[r, c // 4]) * float(d[r, 0]) - float(sub_min[r, c // 4]) * float(dmin[r, 0])
             for c in range(8)] for r in range(2)]
    assert torch.equal(qw.dequantize(), torch.tensor(want, dtype=torch.float64).float())  # correctly rounded once
    assert qw.storage_bytes() == 16 * 4 // 8 + 2 * (4 * 6 // 8 + 2 * 2)  # codes, then scales and minimums alike
    assert torch.equal(qw.rows(torch.tensor([1])).dequantize(), qw.dequantize()[1:])
    with pytest.raises(ValueError, match="sub-minimums must lie in"):
        QuantizedWeight.two_level_weight(q, sub, d, 4, 4, layout, sub_mins=sub_min + 60, channel_mins=dmin)
    with pytest.raises(ValueError, match="takes sub_mins and channel_mins"):
        QuantizedWeight.two_level_weight(q, sub, d, 4, 4, layout)
