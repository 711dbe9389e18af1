"""onnx.build: the op-by-op graph builder: names, the shared weight store, and graphs that onnxruntime runs."""
import numpy as np
import onnx
import pytest
import torch

from workbench.onnx.build import DATA_FILE, TensorStore, build_graphs, input_names, output_names


def test_input_and_output_names_follow_the_kv_cache_convention():
    assert input_names(2, False) == ["input_ids", "attention_mask", "position_ids"]
    assert input_names(2, True)[3:] == ["past_key_values.0.key", "past_key_values.0.value",
                                        "past_key_values.1.key", "past_key_values.1.value"]
    assert output_names(1) == ["logits", "present.0.key", "present.0.value"]


def test_the_store_keeps_small_tensors_inline_and_spills_past_its_limit(tmp_path):
    store = TensorStore(tmp_path, inline_limit=100)
    a = store.add("a", np.arange(10, dtype=np.float32))  # 40 bytes: inline
    assert not store.external and store.proto(a).raw_data
    store.alias("a2", "a", (2, 5))
    assert list(store.proto("a2").dims) == [2, 5]
    store.add("b", np.ones(20, np.float32))  # 120 bytes in all: everything goes to the data file
    store.close()
    assert store.external and (tmp_path / DATA_FILE).stat().st_size >= 120
    ref = {e.key: e.value for e in store.proto("b").external_data}
    assert ref["location"] == DATA_FILE and int(ref["length"]) == 80
    with pytest.raises(ValueError, match="already written"):
        store.add("a", np.zeros(1, np.float32))


@pytest.mark.parametrize("inline_limit", [None, 0])
def test_built_graphs_name_every_layer_and_run_like_the_model(lm, tmp_path, inline_limit):
    import onnxruntime as ort
    built = build_graphs(lm.model, tmp_path, inline_limit=inline_limit)
    assert (built.data_path is not None) == (inline_limit == 0)
    assert set(built.weight_names) >= {info.name for info in lm.layers}
    names = {i.name for i in onnx.load(str(built.prefill_path), load_external_data=False).graph.initializer}
    assert set(built.weight_names.values()) <= names
    layers = lm.model.config.num_hidden_layers
    sess = ort.InferenceSession(str(built.prefill_path), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == output_names(layers)
    ids = np.array([[5, 17, 99, 3]], np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feed.update({i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs()
                 if i.name.startswith("past_key_values")})
    logits = sess.run(["logits"], feed)[0]
    with torch.no_grad():
        want = lm.model(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4)
