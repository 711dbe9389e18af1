"""Save and reload: same logits, same perplexity, packed int4 on disk, clear errors for broken directories."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from workbench.errors import ModelLoadError, WorkspaceError
from workbench.evaluate import evaluate
from workbench.models import load_model
from workbench.plan import QuantPlan
from workbench.quantize import load_quantized, quantize_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import build_tiny_model
    return load_model(build_tiny_model(tmp_path_factory.mktemp("io") / "m"))


def _ids(n=300, seed=0):
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("symmetric", [True, False])
def test_reload_gives_the_same_logits_and_perplexity(tiny, tmp_path, symmetric):
    plan = (QuantPlan.uniform("int4", group_size=32, symmetric=symmetric)
            .with_override("*.mlp.down_proj", "int8").with_override("model.embed_tokens", "int8"))
    qm = quantize_model(tiny, plan, progress=False)
    simulated = qm.apply_(copy.deepcopy(tiny.model))
    out = qm.save(tmp_path / "q")
    lm2, qm2 = load_quantized(out)
    assert qm2.precisions == qm.precisions
    ids = _ids()
    with torch.no_grad():
        a = simulated(input_ids=ids[None, :128]).logits
        b = lm2.model(input_ids=ids[None, :128]).logits
    assert torch.equal(a, b)
    ra = evaluate(simulated, ids, ctx=128, progress=False)
    rb = evaluate(lm2.model, ids, ctx=128, progress=False)
    assert ra.perplexity == rb.perplexity
    assert not lm2.model.config.tie_word_embeddings  # the plan untied lm_head (fp16) from the int8 embedding
    assert lm2.tokenizer is not None


def test_files_hold_packed_int4_and_a_manifest(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32, symmetric=False), progress=False)
    out = qm.save(tmp_path / "q", report={"note": "x"})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", "quantized.safetensors", "plan.json",
            "quantization.json", "report.json", "manifest.json"} <= names
    q = load_file(out / "quantized.safetensors")
    qw = q["model.layers.0.mlp.gate_proj.qweight"]
    assert qw.dtype == torch.uint8 and tuple(qw.shape) == (128, 32)  # [out, in / 2]
    assert q["model.layers.0.mlp.gate_proj.scales"].dtype == torch.float16
    assert tuple(q["model.layers.0.mlp.gate_proj.zeros"].shape) == (128, 1)  # 2 groups, packed two per byte
    assert not any(k.endswith(".qweight") for k in load_file(out / "model.safetensors"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"]["quantized.safetensors"]["size"] == (out / "quantized.safetensors").stat().st_size
    assert QuantPlan.load(out / "plan.json") == qm.plan
    # integer bytes on disk match the accounting: packed codes + float16 scales + packed zeros
    expected = sum(w.storage_bytes() for n, w in qm.weights.items() if n != "lm_head")
    assert sum(t.numel() * t.element_size() for t in q.values()) == expected


def test_saving_replaces_an_earlier_result_but_not_a_foreign_directory(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int8", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    qm.save(out)  # replacing an earlier quantized model is fine
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "readme.txt").write_text("mine")
    with pytest.raises(WorkspaceError, match="exists and is not a quantized-model directory"):
        qm.save(foreign)
    assert (foreign / "readme.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_broken_directories_give_clear_errors(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_quantized(tmp_path / "missing")
    qm = quantize_model(tiny, QuantPlan.uniform("int8", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    data = bytearray((out / "quantized.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "quantized.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="quantized.safetensors' is missing or differs from the manifest"):
        load_quantized(out)
    (out / "plan.json").unlink()
    with pytest.raises(ModelLoadError, match="has no plan.json: not a complete quantized model"):
        load_quantized(out)
