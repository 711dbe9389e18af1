"""The vision encoder as a fixed-size ONNX graph: onnxruntime against PyTorch, windows, sizes refused by name."""
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch

from workbench.errors import DataError, ModelLoadError
from workbench.evaluation.images import read_image
from workbench.assets import DEMO_VL_DATA_DIR
from workbench.onnx.vision_export import encoder_feed, encoder_image_size, export_vision_encoder, vision_embeddings


@pytest.fixture(scope="module")
def demo_vl():
    from workbench import load_model
    return load_model("demo-vl")


def test_demo_vl_encoder_matches_pytorch_on_a_picture(demo_vl, tmp_path):
    vx = export_vision_encoder(demo_vl, tmp_path)
    assert vx.image_size == (56, 56) and vx.grid_thw == (1, 4, 4)  # the one size its preprocessor allows
    assert vx.input_shape == (16, 3 * 2 * 14 * 14) and vx.output_shape == (4, 128)
    assert set(vx.weight_names) == {n.name for n in demo_vl.layers if n.name.startswith("model.visual.")}
    assert vx.weight_names["model.visual.blocks.0.attn.qkv"] == "model.visual.blocks.0.attn.qkv.weight.T"
    feed = encoder_feed(demo_vl, read_image(DEMO_VL_DATA_DIR / "images" / "heldout-000.png"), vx)
    ref = vision_embeddings(demo_vl.model, feed["pixel_values"], vx.grid_thw)
    got = ort.InferenceSession(str(vx.path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()


def test_a_picture_of_another_size_is_resized_to_the_graph(demo_vl, tmp_path):
    from PIL import Image
    vx = export_vision_encoder(demo_vl, tmp_path, check=False)
    feed = encoder_feed(demo_vl, Image.new("RGB", (90, 40), "red"), vx)
    assert feed["pixel_values"].shape == vx.input_shape


def test_sizes_off_the_grid_and_text_models_refused(demo_vl):
    with pytest.raises(DataError, match="multiple of 28"):
        encoder_image_size(demo_vl, (50, 56))
    with pytest.raises(ModelLoadError, match="no vision encoder"):
        export_vision_encoder(SimpleNamespace(model=SimpleNamespace(model=None, config=SimpleNamespace(
            model_type="qwen2")), path="demo", layers=[]), "unused")


def test_windowed_attention_blocks_match_pytorch(tmp_path):
    """Qwen2.5-VL's window attention (every block but the full-attention ones) baked in as a mask."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    cfg = Qwen2_5_VLConfig(vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                          "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 56,
                                          "patch_size": 14, "spatial_merge_size": 2},
                           text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300,
                                        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                            "rope_theta": 10000.0}})
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    lm = SimpleNamespace(model=model, path="tiny", processor=None, layers=[])
    assert encoder_image_size(lm) == (336, 504)  # no preprocessor to say: Qualcomm's size for Qwen2.5-VL
    vx = export_vision_encoder(lm, tmp_path, image_size=(168, 112))  # 12x8 patches: windows of unequal sizes
    assert vx.windowed_blocks == [0]
    assert vx.max_abs_diff is not None and vx.max_abs_diff < 1e-4
