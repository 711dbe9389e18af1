import json
import shutil
from pathlib import Path

import pytest
import torch

from workbench.errors import ModelLoadError
from workbench.assets import DEMO_MODEL_DIR
from workbench.model.load import load_model, quantizable_layers, resolve_model_path


def test_demo_alias():
    assert resolve_model_path("demo") == DEMO_MODEL_DIR


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_loads_supported_architectures(make_tiny_model, arch):
    path = make_tiny_model(arch)
    lm = load_model(path)
    assert lm.model.dtype == torch.float32 and not lm.model.training
    names = [layer.name for layer in lm.layers]
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.1.mlp.down_proj" in names
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert lm.layer("lm_head").tied_to == "model.embed_tokens"
    q = lm.layer("model.layers.0.self_attn.q_proj")
    assert q.shape == (64, 64) and q.parameters == 4096 and q.role == "q_proj" and q.block == "layers.0"
    assert q.bytes_at("fp16") == 8192 and q.bytes_at("int8", group_size=None) == 4096 + 64 * 2
    assert lm.tokenizer is not None


def test_dtype_choice(tiny_model_dir):
    assert load_model(tiny_model_dir, dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(tiny_model_dir, dtype="float7")


def test_size_counts_tied_weights_once(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    fp16 = lm.size_bytes(precision="fp16")
    params = lm.parameters
    assert fp16 == 2 * params


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*local Hugging Face model directory"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path / "m")


def test_not_a_causal_lm(tiny_model_dir, tmp_path):
    d = tmp_path / "bert"
    shutil.copytree(tiny_model_dir, d)
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelLoadError, match="'bert' \\(BertModel\\), not a causal language model"):
        load_model(d)


def test_truncated_weights(tiny_model_dir, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_model_dir, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(d)


def test_corrupt_weights_header(tiny_model_dir, tmp_path):
    d = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, d)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(d)


def test_no_weights(tiny_model_dir, tmp_path):
    d = tmp_path / "noweights"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(d)


def test_missing_tokenizer(tiny_model_dir, tmp_path):
    d = tmp_path / "notok"
    shutil.copytree(tiny_model_dir, d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_model(d)
    assert load_model(d, load_tokenizer=False).tokenizer is None


def test_pickled_weights_load_with_weights_only(tiny_model_dir, tmp_path):
    d = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, d)
    ref = load_model(tiny_model_dir)
    (d / "model.safetensors").unlink()
    torch.save(ref.model.state_dict(), d / "pytorch_model.bin")
    lm = load_model(d)
    x = torch.tensor([[1, 2, 3]])
    assert torch.allclose(lm.model(x).logits, ref.model(x).logits)


def test_quantizable_layers_marks_untied(make_tiny_model):
    lm = load_model(make_tiny_model(tie=False))
    assert lm.layer("lm_head").tied_to is None
    assert [i.kind for i in quantizable_layers(lm.model)].count("embedding") == 1


def _edit_weights(d, edit):
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def test_weights_that_do_not_cover_the_model_are_refused_by_name(make_tiny_model):
    """Never a randomly initialised layer: missing, unexpected and reshaped tensors are named (first few + count)."""
    def case(config=None, weights=None):
        d = make_tiny_model("llama")
        if config:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **config}))
        if weights:
            _edit_weights(d, weights)
        return d

    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4}
    with pytest.raises(ModelLoadError, match=r"do not match the model its config.json describes: \d+ missing "
                                             r"\(lm_head.weight, transformer\..* and \d+ more\); \d+ unexpected "
                                             r"\(model.embed_tokens.weight, .* and \d+ more\) tensors"):
        load_model(case(config=gpt2))
    with pytest.raises(ModelLoadError, match=r"6 with another shape \(model.layers.0.mlp.down_proj.weight "
                                             r"\[64, 128\] vs \[64, 96\], .* and 3 more\)"):
        load_model(case(config={"intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r": 1 missing \(model.layers.0.mlp.up_proj.weight\) tensors"):
        load_model(case(weights=lambda t: t.pop("model.layers.0.mlp.up_proj.weight")))
    with pytest.raises(ModelLoadError, match=r": 1 unexpected \(model.layers.0.mlp.extra\) tensors"):
        load_model(case(weights=lambda t: t.update({"model.layers.0.mlp.extra": torch.zeros(2)})))
    with pytest.raises(ModelLoadError, match=r": 1 missing \(lm_head.weight\) tensors"):
        load_model(case(config={"tie_word_embeddings": False}))  # a tied checkpoint read as untied


def test_pickled_weights_that_do_not_cover_the_model_are_refused(tiny_model_dir, tmp_path):
    d = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, d)
    state = load_model(tiny_model_dir).model.state_dict()
    del state["model.norm.weight"]
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"1 missing \(model.norm.weight\)"):
        load_model(d)


def test_a_quantized_directory_loads_as_the_quantized_model(tiny_model_dir, tmp_path):
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    from workbench.quantize.layers import QuantLinear
    lm = load_model(tiny_model_dir)
    qm = quantize_model(lm, QuantPlan.uniform("int4", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    q = load_model(out)
    assert q.quantized is not None and q.quantized.precisions == qm.precisions and q.name == str(out)
    assert isinstance(q.model.model.layers[0].mlp.down_proj, QuantLinear)
    assert [(i.name, i.kind, i.shape, i.tied_to) for i in quantizable_layers(q.model)] == \
        [(i.name, i.kind, i.shape, i.tied_to) for i in lm.layers]
    assert q.parameters == lm.parameters and q.size_bytes(precision="int4") == lm.size_bytes(precision="int4")
    assert lm.quantized is None and load_model(out, load_tokenizer=False).tokenizer is None
    lm.require_float("sensitivity")
    with pytest.raises(ModelLoadError, match=r"is already quantized \(rtn\); run sensitivity on the float model it "
                                             r"was made from \(.*qwen3\)"):
        q.require_float("sensitivity")
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(q.model(x).logits, qm.build_model()(x).logits)


def _pickled_command_checkpoint(tiny_model_dir, tmp_path, save) -> Path:
    """A copy of the tiny model whose weights are a pickle that would run `touch tmp_path/ran`, written by ``save``."""
    import os

    class RunsACommand:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)
    d = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").unlink()
    save({"model.embed_tokens.weight": RunsACommand()}, d / "pytorch_model.bin")
    return d


def test_a_pickle_that_runs_a_command_is_refused_saying_what_and_the_fix(tiny_model_dir, tmp_path):
    d = _pickled_command_checkpoint(tiny_model_dir, tmp_path, torch.save)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "GLOBAL posix.system" in msg and "weights_only loading refused" in msg
    assert "convert the checkpoint to safetensors" in msg and "weights_only=False" not in msg and "\n" not in msg
    assert not (tmp_path / "ran").exists()


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_auto_map_with_a_built_in_type_loads_the_built_in_class_and_says_so(tiny_model_dir, tmp_path, caplog):
    d = _with_config(tiny_model_dir, tmp_path / "m", auto_map={"AutoModelForCausalLM": "modeling_mine.MyForCausalLM"})
    with caplog.at_level("WARNING", logger="workbench"):
        lm = load_model(d)
    assert type(lm.model).__name__ == "Qwen3ForCausalLM"
    note = " ".join(r.getMessage() for r in caplog.records)
    assert "auto_map: modeling_mine.MyForCausalLM" in note and "which is not run" in note
    assert "built-in class for 'qwen3'" in note and "workbench info --trust-remote-code" in note


def test_auto_map_note_is_printed_by_the_cli(tiny_model_dir, tmp_path, capsys):
    from workbench.cli import main
    d = _with_config(tiny_model_dir, tmp_path / "m", auto_map={"AutoModelForCausalLM": "modeling_mine.MyForCausalLM"})
    assert main(["info", str(d), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("workbench info: note: ") and len(err.strip().splitlines()) == 1


def test_a_custom_model_type_is_refused_naming_remote_code_and_the_option(tiny_model_dir, tmp_path):
    d = _with_config(tiny_model_dir, tmp_path / "m", model_type="mine", architectures=["MyForCausalLM"],
                     auto_map={"AutoConfig": "configuration_mine.MyConfig",
                               "AutoModelForCausalLM": "modeling_mine.MyForCausalLM"})
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    msg = str(e.value)
    assert "model_type 'mine'" in msg and "own code (auto_map: modeling_mine.MyForCausalLM)" in msg
    assert "which is not run" in msg and "`workbench info --trust-remote-code`" in msg


def test_info_has_the_trust_remote_code_option_the_messages_name():
    from workbench.cli import build_parser
    args = build_parser().parse_args(["info", "demo", "--trust-remote-code"])
    assert args.trust_remote_code is True


def test_a_config_that_is_not_an_object_or_has_odd_types_is_refused(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"config.json' holds a JSON list, not an object"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": ["qwen3"], "architectures": "Qwen3ForCausalLM"}))
    with pytest.raises(ModelLoadError, match="'model_type' must be a string and 'architectures' a list"):
        load_model(d)


def test_a_safetensors_header_that_is_not_a_tensor_table_is_refused(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    header = b"[1, 2, 3]"
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ModelLoadError, match=r"model.safetensors' has a corrupt safetensors header \(not a table"):
        load_model(d)


@pytest.mark.parametrize("content, says", [
    (b"", r"tokenizer\.json' is empty \(0 bytes\)"),
    (b"not json at all", r"tokenizer\.json' is not valid JSON"),
    (b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0', r"tokenizer\.json' is not valid JSON \(the file "
                                                                     r"looks truncated\)"),
    (b"[1, 2]", r"tokenizer\.json' is JSON but not a tokenizer"),
])
def test_a_damaged_tokenizer_json_is_named_by_info_and_by_loading(tiny_model_dir, tmp_path, content, says):
    from workbench.cli import main
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "tokenizer.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=says):
        load_model(d)
    assert main(["info", str(d)]) == 2  # info checks the directory's files too, without loading the tokenizer


def test_a_plain_pickle_that_runs_a_command_is_refused_naming_the_global_without_a_warning(tiny_model_dir, tmp_path,
                                                                                          recwarn):
    import pickle

    def plain_pickle(obj, path):  # a plain pickle, not torch.save's zip
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=4)
    d = _pickled_command_checkpoint(tiny_model_dir, tmp_path, plain_pickle)
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin\) that holds GLOBAL posix\.system, not only tensors"):
        load_model(d)
    assert not (tmp_path / "ran").exists()
    assert not [w for w in recwarn if "pickle" in str(w.message)], [str(w.message) for w in recwarn]
