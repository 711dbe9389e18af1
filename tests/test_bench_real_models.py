"""bench/real_models.py and scripts/gguf_to_hf.py on a tiny model written here (no package, no download)."""
import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
real = runpy.run_path(str(ROOT / "bench" / "real_models.py"))
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_to_hf  # noqa: E402


def test_reference_rounding_is_the_workbench_full_range_grid_on_the_plans_layers(make_tiny_model):
    pytest.importorskip("gguf")
    from workbench.models import load_model
    from workbench.quantize import quantize_model
    lm = load_model(str(make_tiny_model("llama", tie=False)), dtype="float32")
    plan = real["uniform_plan"](4, full_range=True, scale_search=False)
    ref = real["reference_weights"](lm, "Q4_0", plan)
    qm = quantize_model(lm, plan, progress=False)
    modules = dict(lm.model.named_modules())
    for info in lm.layers:
        if plan.precision_for(info.name).is_float:  # the embedding and output layer: float16, as the plan keeps them
            assert torch.equal(ref[info.name], modules[info.name].weight.detach().half().float())
        else:  # llama.cpp's Q4_0 (the gguf package's quantizer) and the workbench's 16-level RTN: the same weights
            assert torch.equal(ref[info.name], qm.weights[info.name].dequantize())


def test_gguf_to_hf_round_trips_a_gguf_and_records_its_source(make_tiny_model, tmp_path):
    pytest.importorskip("gguf")
    from workbench.models import load_model
    from workbench.quantize import quantize_model
    from workbench.targets.gguf_file import write_gguf
    lm = load_model(str(make_tiny_model("qwen2")), dtype="float32")
    qm = quantize_model(lm, real["uniform_plan"](8, full_range=True), progress=False)
    path = write_gguf(qm, tmp_path / "g" / "model.gguf")
    rec = gguf_to_hf.convert(path, tmp_path / "hf", "tiny==0")
    assert rec["package"] == "tiny==0" and rec["stored_types"]["Q8_0"] == len(qm.weights)
    assert len(rec["sha256"]) == 64 and (tmp_path / "hf" / "SOURCE.json").is_file()
    back = load_model(str(tmp_path / "hf"), dtype="float32")
    name = next(iter(qm.weights))
    got = dict(back.model.named_modules())[name].weight.detach()
    assert torch.equal(got, qm.weights[name].dequantize())
