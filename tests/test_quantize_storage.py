"""quantize.storage: the stored layout of one layer (packing, shapes, reading back) and the directory's manifest."""
import json

import pytest
import torch

from workbench.quantize.rtn import quantize_weight
from workbench.quantize.storage import (ct_layout, pack_int32, stored_shapes, unpack_int32, weight_file_bytes,
                                        weight_from_file, weight_tensors, write_manifest)
from workbench.files.workspace import file_sha256


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_packing_round_trips_codes_of_any_width(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 37), generator=g, dtype=torch.uint8)  # 37: not a whole word
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, -(-37 * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, 37), codes)
    first = int(packed[0, 0]) & (2 ** bits - 1)
    assert first == int(codes[0, 0])  # the first code in the lowest bits


@pytest.mark.parametrize("bits,group_size,symmetric,scale_bits", [
    (4, 32, True, None), (8, None, False, None), (3, 32, True, None), (3, 32, False, None), (4, 16, True, 4)])
def test_one_layer_is_stored_as_its_shapes_say_and_reads_back_exactly(bits, group_size, symmetric, scale_bits):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    qw = quantize_weight(w, bits, group_size, symmetric, scale_bits=scale_bits)
    tensors = weight_tensors("l", qw)
    shapes = stored_shapes("l", qw.shape, bits, group_size, symmetric, scale_bits)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert ct_layout(bits, scale_bits) == (bits in (4, 8) and scale_bits is None)
    assert ("l.weight_zero_point" in shapes) == (not symmetric)
    assert ("l.weight_sub_scale" in shapes) == (scale_bits is not None)
    back = weight_from_file("l", tensors, bits, group_size, scale_bits)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_float_minimums_are_stored_beside_their_scales_and_read_back_exactly():
    """int4-min / int5-min (llama.cpp's Q4_1 / Q5_1): a float16 minimum per group, no zero point, never in
    compressed-tensors' layout (it has no float minimum)."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) + 0.5
    for bits in (4, 5):
        qw = quantize_weight(w, bits, 32, True, minimums=True)
        assert qw.float_minimums and qw.zeros is None and qw.qweight.dtype == torch.uint8
        tensors = weight_tensors("l", qw)
        shapes = stored_shapes("l", qw.shape, bits, 32, qw.symmetric, None, True)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes and "l.weight_min" in shapes
        assert not ct_layout(bits, None, True) and "l.weight_zero_point" not in shapes
        back = weight_from_file("l", tensors, bits, 32, None, True)
        assert torch.equal(back.dequantize(), qw.dequantize()) and torch.equal(back.mins, qw.mins)
        assert qw.storage_bytes() == sum(t.numel() * t.element_size() for k, t in tensors.items()
                                         if not k.endswith("weight_shape"))


def test_the_manifest_lists_every_file_with_its_size_and_hash(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "workbench.safetensors").write_bytes(b"y" * 28)
    (tmp_path / "config.json").write_text("{}")
    write_manifest(tmp_path, {"method": "rtn"})
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["method"] == "rtn" and set(doc["files"]) == {"model.safetensors", "workbench.safetensors", "config.json"}
    assert doc["files"]["model.safetensors"] == {"size": 100, "sha256": file_sha256(tmp_path / "model.safetensors")}
    assert weight_file_bytes(tmp_path) == 128  # the weight files only
