"""`workbench generate`: streams a model's continuation to stdout with its speed on stderr; JSON; one-line errors."""
import json

import pytest

from workbench.cli import main
from workbench.run.generate import open_model

pytestmark = pytest.mark.slow  # every test here converts or exports and runs a runtime first

PROMPT = "A class definition"


@pytest.fixture(scope="module")
def genai_folder(tmp_path_factory):
    """The demo model's INT4 plan as an ort-genai folder (the artifact onnxruntime-genai runs)."""
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    from workbench.targets.ort_genai import build_fused_onnx, write_genai_folder
    lm = load_model("demo")
    qm = quantize_model(lm, QuantPlan.uniform("int4", keep_embeddings=None), progress=False)
    sim = qm.build_model(lm.model)
    out = tmp_path_factory.mktemp("genai")
    build_fused_onnx(sim, out, qm.precisions, accuracy_level=4)
    write_genai_folder(out, sim, lm.path, lm.tokenizer)
    return out


def test_streams_the_text_the_library_makes(genai_folder, capsys):
    assert main(["generate", str(genai_folder), "--prompt", PROMPT, "--max-new-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    want = open_model(genai_folder).generate(PROMPT, max_new_tokens=16)
    assert out == want.text + "\n" and want.text.strip()
    assert "onnxruntime-genai" in err and "16 tokens" in err and "tok/s after the first" in err


def test_json_and_sampling(genai_folder, capsys):
    args = ["generate", str(genai_folder), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtime"] == "onnxruntime-genai" and doc["new_tokens"] == len(doc["tokens"]) == 12
    assert doc["tokens_per_second"] > 0 and doc["prefill_seconds"] > 0 and doc["stop_reason"] == "max_new_tokens"
    sampled = args + ["--temperature", "1.0", "--top-k", "20", "--seed", "3"]
    runs = []
    for _ in range(2):
        assert main(sampled) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1] and runs[0] != doc["tokens"]  # seeded: repeats, and differs from greedy


def test_float_model_in_pytorch(capsys):
    assert main(["generate", "demo", "--prompt", PROMPT, "--max-new-tokens", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtime"] == "PyTorch" and len(doc["tokens"]) == 6


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("workbench generate: error:") and "holds no model to generate with" in err
    assert "\n" not in err
    assert main(["generate", "demo", "--prompt", PROMPT, "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err
    assert main(["generate", "demo", "--prompt", "  "]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_a_corrupt_conversion_record_is_named_with_the_option_that_passes_the_source(tmp_path, capsys):
    from workbench.model.load import load_model
    from workbench.onnx.export import export_onnx
    export_onnx(load_model("demo"), tmp_path, check=False)
    (tmp_path / "conversion.json").write_text('{"target": "ort-int4", "quantized_model": {', encoding="utf-8")
    assert main(["generate", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "conversion.json' is corrupt (not JSON" in err and "--source" in err and "\n" not in err
    assert main(["generate", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "2", "--source", "demo"]) == 0
