"""workbench.run.layerwise: a graph altered in one layer is found departing there; one altered only in its output
layer departs after the blocks; an unaltered one keeps to the reference everywhere."""
import onnx
import pytest
from onnx import numpy_helper

from workbench.run.layerwise import POINTS, block_output_tensors, compare_blocks
from workbench.model.load import load_model
from workbench.onnx.export import export_onnx

WINDOW = list(range(5, 69))


@pytest.fixture(scope="module")
def graphs(untied_model_dir):
    lm = load_model(untied_model_dir)
    fx = export_onnx(lm, untied_model_dir.parent / "onnx", static=(64, 64), check=False)
    return lm, fx


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    from conftest import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("lw") / "untied", layers=3, tie=False)


def _altered(fx, layer: str, factor: float, out):
    proto = onnx.load(str(fx.prefill_path))
    name = fx.weight_names[layer]
    for init in proto.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * factor, name))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(out))
    return out


def test_two_points_per_block_in_order(graphs):
    lm, fx = graphs
    tensors = block_output_tensors(onnx.load(str(fx.prefill_path), load_external_data=False))
    assert len(tensors) == len(POINTS) * 3 and len(set(tensors)) == len(tensors)


def test_the_altered_layer_is_named(graphs, tmp_path):
    lm, fx = graphs
    bad = _altered(fx, "model.layers.1.mlp.down_proj", 1.5, tmp_path / "g" / "prefill.onnx")
    r = compare_blocks(fx.prefill_path, bad, lm.model, lm.model, WINDOW, what="the altered graph")
    assert [b["graph"] == 0 for b in r.blocks[:3]] == [True] * 3  # block 0 and block 1's attention agree exactly
    assert r.blocks[3]["graph"] > 1e-3 and (r.blocks[3]["block"], r.blocks[3]["part"]) == (1, "mlp")
    assert r.first_block == 1 and "at block 1's mlp (model.layers.1.mlp" in r.cause
    assert all(b["simulation"] == 0 for b in r.blocks)  # the "simulation" here is the float model itself


def test_an_output_layer_change_departs_after_the_blocks(graphs, tmp_path):
    lm, fx = graphs
    bad = _altered(fx, "lm_head", 1.3, tmp_path / "h" / "prefill.onnx")
    r = compare_blocks(fx.prefill_path, bad, lm.model, lm.model, WINDOW)
    assert r.first_block is None and "output layer (lm_head)" in r.cause and r.logits["graph"] > 0.1
    same = compare_blocks(fx.prefill_path, fx.prefill_path, lm.model, lm.model, WINDOW)
    assert same.first_block is None and "no single layer" in same.cause and same.logits["graph"] == 0
