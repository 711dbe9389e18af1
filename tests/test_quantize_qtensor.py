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
