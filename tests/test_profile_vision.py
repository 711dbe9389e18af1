import json

import pytest

from workbench.cli import main
from workbench.errors import WorkbenchError
from workbench.run.profile import is_vision_folder, profile_vision_model


def test_profile_times_the_encoder_and_the_first_token_with_the_image():
    p = profile_vision_model("assets/demo-vl-model", repeats=2, decode_steps=4)
    assert p.image == (56, 56) and p.image_tokens == 4  # the demo processor's fixed 3136 pixels, merge 2
    assert p.prompt_tokens > p.image_tokens
    assert 0 < p.encoder_ms < p.first_token_ms and p.prefill_ms == pytest.approx(p.first_token_ms - p.encoder_ms)
    assert p.decode_tokens_per_second > 0 and p.size_bytes > 1e6


def test_profile_cli_on_a_vlm_folder_notes_a_resized_picture(capsys):
    assert main(["profile", "assets/demo-vl-model", "--repeats", "1", "--decode-steps", "2", "--image", "112x112",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["vision_profile"]
    assert d["image"] == [112, 112] and d["image_tokens"] == 4
    assert any("resizes the 112x112 picture to 56x56" in n for n in d["notes"])


def test_profile_refuses_a_vl_folder_missing_its_vision_weights(capsys, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    for f in ("config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"assets/demo-vl-model/{f}", tmp_path / f)
    weights = load_file("assets/demo-vl-model/model.safetensors")
    save_file({k: v for k, v in weights.items() if "visual" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    assert is_vision_folder(tmp_path)
    assert main(["profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0] and "model.visual" in err[0]


def test_profile_refuses_image_for_a_text_folder(capsys, tmp_path):
    assert not is_vision_folder(tmp_path)
    with pytest.raises(WorkbenchError):
        profile_vision_model(tmp_path)
    assert main(["profile", str(tmp_path), "--image", "56x56"]) == 2
