"""tensorrt-edgellm: the plan's W4A16 codes as TensorRT Edge-LLM's ONNX bundle (its own exporter, in its own venv),
read back equal to the plan's integers and run by onnxruntime wherever no TensorRT plugin is needed."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from workbench.targets.convert import convert, prepare_models
from workbench.errors import PlanError, WorkbenchError
from workbench.quantize.plan import QuantPlan
from workbench.targets.edgellm import (BUILD_SCRIPT, INT4_OP, LLM_DIR, PLUGIN_DOMAIN, EdgeLlmError, bundle_weights,
                                       carried_group, check_bundle_codes, edgellm_python, unpack_fragment)

SKIP = pytest.mark.skipif(edgellm_python() is None, reason="tensorrt-edgellm is not installed: `make edgellm-env` "
                                                         "(creates .venv-edgellm with tensorrt-edgellm 0.11.0)")


@pytest.fixture(scope="module")
def demo4(tmp_path_factory):
    """`workbench convert demo --bits 4 --target tensorrt-edgellm` (symmetric int4, groups of 128)."""
    if edgellm_python() is None:
        pytest.skip("tensorrt-edgellm is not installed: `make edgellm-env`")
    out = tmp_path_factory.mktemp("edgellm")
    prep = prepare_models("demo", bits=4)
    return convert("demo", "tensorrt-edgellm", out, prepared=prep, max_tokens=256), out, prep


@SKIP
@pytest.mark.slow
def test_the_bundle_holds_the_plan_integers(demo4):
    """Every int4 plugin node's weights, unpacked from the ONNX's fragment layout, are the plan's codes and its
    float16 scales; the output layer (tied, float in the plan) is no int4 node."""
    report, out, prep = demo4
    stored = bundle_weights(out / LLM_DIR / "model.onnx")
    linear = [n for n in prep.qm.weights if prep.qm.layer(n).kind == "linear"]
    assert sorted(stored) == sorted(linear) and len(linear) == 28
    for name in linear:
        qw = prep.qm.weights[name]
        assert np.array_equal(stored[name]["codes"], qw.qweight.numpy().astype(np.int8)), name
        assert np.array_equal(stored[name]["scales"].astype(np.float32), qw.scales.numpy()), name
        assert stored[name]["group_size"] == 128
    assert report.details["edgellm"]["plan_layers_checked"] == 28
    assert "lm_head" in report.details["edgellm"]["float_layers"]


@SKIP
@pytest.mark.slow
def test_a_changed_code_is_caught(demo4):
    """The read-back check fails, naming the layer, when the bundle and the plan differ by one code."""
    _, out, prep = demo4
    qw = prep.qm.weights["model.layers.2.mlp.up_proj"]
    old = int(qw.qweight[5, 7])
    qw.qweight[5, 7] = old + 1 if old < 7 else old - 1
    try:
        with pytest.raises(WorkbenchError, match="model.layers.2.mlp.up_proj"):
            check_bundle_codes(out / LLM_DIR / "model.onnx", prep.qm)
    finally:
        qw.qweight[5, 7] = old
    assert check_bundle_codes(out / LLM_DIR / "model.onnx", prep.qm) == 28


@SKIP
@pytest.mark.slow
def test_onnxruntime_runs_everything_outside_the_plugins(demo4):
    """With the plugin nodes' outputs from the simulation, onnxruntime's norms, SiLU, residual adds and output layer
    (float16) reproduce the simulation's inputs to every int4 layer and its logits."""
    report, out, _ = demo4
    run = report.details["edgellm"]["onnxruntime_outside_plugins"]
    assert run["tokens"] == 128 and run["nodes_run"] > 100
    assert len(run["layer_input_max_rel_diff"]) == 28
    assert run["worst_layer_input_rel_diff"] < 5e-3  # float16 arithmetic against the float32 simulation
    assert run["logits_top1_vs_simulation"] == 1.0 and run["logits_kl_vs_simulation"] < 1e-5
    import onnx
    ops = {(n.domain, n.op_type) for n in onnx.load(str(out / LLM_DIR / "model.onnx"), load_external_data=False).graph.node}
    assert (PLUGIN_DOMAIN, INT4_OP) in ops and (PLUGIN_DOMAIN, "AttentionPlugin") in ops


@SKIP
@pytest.mark.slow
def test_the_bundle_is_what_the_jetson_builds_from(demo4):
    report, out, _ = demo4
    for f in ("model.onnx", "model.onnx.data", "config.json", "embedding.safetensors", "tokenizer.json"):
        assert (out / LLM_DIR / f).stat().st_size > 0, f
    cfg = json.loads((out / LLM_DIR / "config.json").read_text())
    assert cfg["model"] == "qwen3" and cfg["num_hidden_layers"] == 4
    script = (out / BUILD_SCRIPT).read_text()
    assert "llm_build" in script and "--onnxDir llm" in script and "--engineDir engines" in script
    assert json.loads((out / "conversion.json").read_text())["target"] == "tensorrt-edgellm"
    assert any("build.sh" in n for n in report.notes)


@SKIP
def test_unpack_inverts_the_exporters_fragment_packing(tmp_path):
    """The exporter's own packing (in its venv) of random nibbles, unpacked here, gives the nibbles back."""
    rng = np.random.default_rng(0)
    for n, k in ((128, 64), (192, 320)):  # one tile, and a partial 128-row block
        nib = rng.integers(0, 16, (n, k)).astype(np.int16)
        np.save(tmp_path / "nib.npy", nib)
        code = ("import numpy as np, sys; from tensorrt_edgellm.checkpoint.repacking import repack_to_cutedsl_fragment; "
                f"np.save(sys.argv[2], repack_to_cutedsl_fragment(np.load(sys.argv[1])))")
        subprocess.run([str(edgellm_python()), "-c", code, str(tmp_path / "nib.npy"), str(tmp_path / "buf.npy")],
                       check=True, timeout=120)
        assert np.array_equal(unpack_fragment(np.load(tmp_path / "buf.npy"), n, k), nib)


def _qw(shape, bits=4, group=128, symmetric=True, zeros=None):
    from types import SimpleNamespace
    return SimpleNamespace(shape=shape, bits=bits, group_size=group, symmetric=symmetric, zeros=zeros,
                           two_level=False, mins=None, super_block=None)


def test_layouts_the_plugin_cannot_hold_are_refused_by_layer():
    assert carried_group("a", _qw((256, 256))) == 128
    assert carried_group("a", _qw((256, 256), group=None)) == 256  # per channel: one group of the whole row
    with pytest.raises(PlanError, match="'model.layers.0.mlp.up_proj'.*asymmetric"):
        carried_group("model.layers.0.mlp.up_proj", _qw((256, 256), symmetric=False, zeros=torch.zeros(1)))
    with pytest.raises(PlanError, match="'x'.*4-bit codes only"):
        carried_group("x", _qw((256, 256), bits=8))
    with pytest.raises(PlanError, match="'y'.*multiple of 64"):
        carried_group("y", _qw((96, 256)))


def test_a_mixed_plan_is_refused_by_layer_name(tmp_path):
    """An int8 layer in the plan is named before anything is written."""
    plan = QuantPlan.uniform("int4").with_override("model.layers.1.mlp.down_proj", "int8")
    with pytest.raises(PlanError, match="model.layers.1.mlp.down_proj"):
        convert("demo", "tensorrt-edgellm", tmp_path / "out", plan=plan, evaluate_outputs=False)


def test_without_its_venv_the_error_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_EDGELLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(EdgeLlmError, match="make edgellm-env"):
        convert("demo", "tensorrt-edgellm", tmp_path / "out", bits=4, evaluate_outputs=False)
