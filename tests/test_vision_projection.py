import json

import pytest

from workbench.cli import main
from workbench.devices.vision_projection import (encoder_cost, image_tokens, parse_image_size, project_vision,
                                                 vendor_vl_check, vision_model)
from workbench.devices.profiles import get_device
from workbench.errors import WorkbenchError


def test_image_tokens_follow_patch_merge_and_the_fixed_sizes():
    _, q25, _ = vision_model("qwen2.5-vl-3b")
    _, q3, _ = vision_model("qwen3-vl-4b")
    assert image_tokens(q25, 504, 336) == (504, 336, 36 * 24, 36 * 24 // 4)  # Qualcomm's Qwen2.5-VL size: 216
    assert image_tokens(q25, 512, 512) == (504, 504, 1296, 324)  # rounded to multiples of 28
    assert image_tokens(q3, 512, 512) == (512, 512, 1024, 256)  # patch 16, merge 2
    with pytest.raises(WorkbenchError):
        parse_image_size("512")
    assert parse_image_size("640x480") == (640, 480)


def test_resize_matches_transformers_smart_resize_and_the_demo_processor_bounds():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    text, vs, _ = vision_model("demo-vl")
    assert text["model_type"] == "qwen2" and vs.min_pixels == vs.max_pixels == 3136  # its preprocessor_config.json
    for w, h in ((640, 480), (64, 64), (30, 300), (1000, 999)):
        rh, rw = smart_resize(h, w, 28, vs.min_pixels, vs.max_pixels)
        assert image_tokens(vs, w, h) == (rw, rh, rw * rh // 196, rw * rh // 196 // 4)


def test_encoder_flops_grow_with_patches_and_full_attention():
    _, vs, _ = vision_model("qwen2.5-vl-3b")
    small, params = encoder_cost(vs, 504, 336)
    big, same = encoder_cost(vs, 1008, 672)
    assert params == same and 4 < big / small < 5  # 4x the patches; full-attention blocks grow quadratically
    assert 6e8 < params < 7e8  # Qwen2.5-VL's 32-block, 1280-wide encoder is ~0.67 B parameters


def test_project_vision_adds_the_encoder_to_the_first_token():
    vp = project_vision("qwen2.5-vl-3b", "8elite", image=(512, 512), runtime="genie")
    assert vp.text.prompt == 128 + vp.image_tokens == 452
    assert vp.encoder_ms > vp.encoder_read_ms > 0 and vp.image_prefill_ms > 0
    assert vp.first_token_ms == pytest.approx(vp.encoder_ms + vp.text_first_token_ms)
    assert 0 < vp.encoder_share < 1
    check = vp.vendor_check
    assert check.n >= 1 and "Qwen2.5-VL-7B-Instruct" in check.models and check.ttft_error is not None


def test_vendor_check_says_none_where_nobody_measured_a_vlm():
    assert vendor_vl_check(get_device("rk3588"), "rkllm").n == 0


def test_project_cli_prints_the_encoder_share_and_the_vendor_check(capsys):
    assert main(["project", "qwen2.5-vl-3b", "--device", "8elite", "--runtime", "genie", "--image", "512x512"]) == 0
    out = capsys.readouterr().out
    assert "324 image tokens" in out and "encoder's share" in out and "% of the first token" in out
    assert "vendor VLM measurement(s) held out of the fit" in out
    assert main(["project", "qwen3-vl-2b", "--device", "rk3588", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["image"] == [512, 512] and d["image_tokens"] == 256 and d["vendor_check"]["n"] == 0


def test_project_cli_refuses_an_image_for_a_text_model(capsys):
    assert main(["project", "qwen3-1.7b", "--device", "8elite", "--image", "512x512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no vision part" in err[0]
    assert main(["project", "qwen2.5-vl-3b", "--device", "8elite", "--image", "big"]) == 2
