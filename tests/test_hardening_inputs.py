"""Hostile inputs the commands refuse in one line naming the file: broken runtime files, absurd thread counts,
configs whose sizes no model here can have or that disagree with their weights."""
from __future__ import annotations

import json
import os
import shutil

import onnx
import pytest
from onnx import TensorProto, helper

from workbench.assets import DEMO_MODEL_DIR
from workbench.cli import main
from workbench.errors import ModelLoadError


def _one_line_error(capsys, argv, *needles):
    """Run the CLI: exit 2, one stderr line that is an input error (not a bug report) holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error" not in err[0], err
    for n in needles:
        assert str(n) in err[0], err[0]
    return err[0]


# -- item: .mnn files MNN cannot parse ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mnn_prefill(tmp_path_factory):
    """A real prefill.mnn of the demo model's export (its bytes, to truncate)."""
    from workbench.model.load import load_model
    from workbench.onnx.export import export_onnx
    from workbench.targets.mnn import convert_to_mnn
    root = tmp_path_factory.mktemp("mnn")
    ex = export_onnx(load_model(DEMO_MODEL_DIR), root / "onnx", check=False)
    return convert_to_mnn(ex.prefill_path, root / "prefill.mnn").read_bytes()


@pytest.mark.parametrize("cut", ["empty", "header", "half", "tail", "garbage"])
def test_a_broken_mnn_file_is_refused_naming_it(mnn_prefill, cut, tmp_path):
    from workbench.targets.mnn import MnnCausalLM
    data = {"empty": b"", "header": mnn_prefill[:16], "half": mnn_prefill[:len(mnn_prefill) // 2],
            "tail": mnn_prefill[:-64], "garbage": b"not an MNN model\n" * 100}[cut]
    path = tmp_path / "prefill.mnn"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match="prefill.mnn.*convert again with --target mnn"):
        MnnCausalLM(path)


def test_generate_on_a_truncated_mnn_folder_is_one_line(mnn_prefill, tmp_path, capsys):
    folder = tmp_path / "mnn"
    folder.mkdir()
    (folder / "prefill.mnn").write_bytes(mnn_prefill[:1000])
    (folder / "decode.mnn").write_bytes(mnn_prefill[:1000])
    _one_line_error(capsys, ["generate", str(folder), "--prompt", "Once", "--source", str(DEMO_MODEL_DIR)],
                    folder / "prefill.mnn", "--target mnn")


def test_a_damaged_decode_graph_beside_a_good_prefill_is_named(mnn_prefill, tmp_path):
    from workbench.errors import ModelLoadError
    from workbench.targets.mnn import MnnCausalLM
    (tmp_path / "prefill.mnn").write_bytes(mnn_prefill)
    (tmp_path / "decode.mnn").write_bytes(b"not a graph" * 100)
    lm = MnnCausalLM(tmp_path / "prefill.mnn")  # the prefill graph loads
    with pytest.raises(ModelLoadError, match=r"decode\.mnn' as a graph .*convert again with --target mnn"):
        lm.run_prefill([1, 2, 3])


# -- item: genai_config.json of an ort-genai folder -------------------------------------------------

def _genai_folder(tmp_path, config_text: str):
    """An ort-genai folder's files with the given genai_config.json (a stand-in graph: the config is read first)."""
    folder = tmp_path / "genai"
    folder.mkdir()
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
                              [helper.make_tensor_value_info("logits", TensorProto.INT64, [1, None])])
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    (folder / "genai_config.json").write_text(config_text, encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


GOOD_MODEL = {"vocab_size": 4096, "context_length": 128, "eos_token_id": 0,
              "decoder": {"filename": "model.onnx"}}


@pytest.mark.parametrize("text, says", [
    (json.dumps({"model": GOOD_MODEL}), "search"),                                  # no `search`
    ('{"model": {"vocab_size": 4096}, "search": {"max_le', "not readable JSON"),  # cut short
    ("\x00\xff garbage", "not readable JSON"),
    (json.dumps([1, 2]), "search"),                                                 # not an object
    (json.dumps({"model": GOOD_MODEL, "search": {"max_length": "long"}}), "max_length"),
])
@pytest.mark.parametrize("command", ["generate", "profile"])
def test_a_bad_genai_config_is_one_line_naming_it(text, says, command, tmp_path, capsys):
    folder = _genai_folder(tmp_path, text)
    argv = ([command, str(folder), "--prompt", "Once"] if command == "generate" else
            [command, str(folder), "--prompt-lengths", "8", "--repeats", "1", "--workspace", str(tmp_path / "ws")])
    _one_line_error(capsys, argv, folder / "genai_config.json", says, "convert")


# -- item: --threads beyond the machine ------------------------------------------------------------

@pytest.mark.parametrize("command", [["generate", "demo", "--prompt", "Once"], ["profile", "demo"],
                                     ["quantize", "demo", "--out", "unused"]])
def test_threads_beyond_the_cores_are_refused_before_any_work(command, capsys):
    from workbench.cli import build_parser
    cores = os.cpu_count() or 1
    assert build_parser().parse_args(command + ["--threads", str(cores)]).threads == cores
    for n in (cores + 1, 20_000, 1_000_000):
        with pytest.raises(SystemExit) as e:
            main(command + ["--threads", str(n)])
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0].endswith(f"argument --threads: must be at most {cores} (this machine's CPU cores), got {n}")


# -- item: configs no model here can have, or that their weights contradict -----------------------------

def _demo_with(tmp_path, **changes):
    """The demo model's files with config.json changed."""
    d = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))  # NaN is written as JSON's NaN, as Python reads it back
    return d


ABSURD = [({"num_hidden_layers": 1_000_000}, "1,000,000 layers"),
          ({"hidden_size": 2 ** 40}, "B parameters"),
          ({"vocab_size": 2 ** 40}, "B parameters"),
          ({"num_hidden_layers": float("nan")}, "num_hidden_layers must be a positive whole number, got nan"),
          ({"hidden_size": 256.5}, "hidden_size must be a positive whole number"),
          ({"vocab_size": 0}, "vocab_size must be a positive whole number, got 0"),
          ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, got 0"),
          ({"intermediate_size": -768}, "intermediate_size must be a positive whole number"),
          ({"num_hidden_layers": "4"}, "num_hidden_layers must be a positive whole number, got '4'")]
MISMATCHED = [({"num_hidden_layers": 8, "layer_types": ["full_attention"] * 8},
               "num_hidden_layers 8 but the weights in '{d}' hold 4 (layers.0 to layers.3)"),
              ({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}, "num_hidden_layers 2 but"),
              ({"hidden_size": 512}, "hidden_size 512 but the weights in '{d}' have model.norm.weight of shape [256]"),
              ({"vocab_size": 8192}, "vocab_size 8,192 but the weights in '{d}' have model.embed_tokens.weight")]


@pytest.mark.parametrize("changes, says", ABSURD + MISMATCHED)
def test_load_model_refuses_a_config_before_building_it(changes, says, tmp_path):
    from workbench.model.load import load_model
    d = _demo_with(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match="fix config.json") as e:
        load_model(d)
    assert str(d / "config.json") in str(e.value) and says.format(d=d) in str(e.value)


@pytest.mark.parametrize("argv", [["info"], ["eval", "--max-tokens", "64"], ["quantize", "--out", "{out}"],
                                  ["export", "--out", "{out}"]])
def test_every_command_refuses_a_million_layers_in_one_line(argv, tmp_path, capsys):
    import time
    d = _demo_with(tmp_path, num_hidden_layers=1_000_000)
    argv = [a.format(out=tmp_path / "out") for a in argv]
    start = time.perf_counter()
    _one_line_error(capsys, [argv[0], str(d), *argv[1:]], d / "config.json", "1,000,000 layers")
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_quantized_directory_with_an_edited_config_is_refused(lm, tmp_path):
    from workbench.model.load import load_model, load_quantized
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    out = quantize_model(lm, QuantPlan.uniform("int8"), progress=False).save(tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    for changes, says in [({"num_hidden_layers": 1_000_000}, "1,000,000 layers"),
                          ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "hold 2 (layers.0 to "),
                          ({"hidden_size": 128}, "hidden_size 128 but")]:
        (out / "config.json").write_text(json.dumps({**cfg, **changes}))
        with pytest.raises(ModelLoadError, match="differs from the manifest"):
            load_model(out)
        with pytest.raises(ModelLoadError, match="fix config.json") as e:  # past the manifest: the config itself
            load_quantized(out, verify=False)
        assert says in str(e.value) and str(out / "config.json") in str(e.value)


@pytest.mark.parametrize("changes, says", [(c, s) for c, s in ABSURD if all(type(v) is int for v in c.values())])
def test_shape_only_configs_are_refused_where_models_are_built(changes, says):
    """``model_from_config`` (what `project`, `prune` and the quantized loader build with) checks first; transformers'
    own config class already refuses sizes that are not integers."""
    from transformers import AutoConfig
    from workbench.model.load import model_from_config
    cfg = {**json.loads((DEMO_MODEL_DIR / "config.json").read_text()), **changes}
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with pytest.raises(ModelLoadError, match="fix config.json") as e:
        model_from_config(config)
    assert says in str(e.value)


def test_the_largest_real_shapes_still_pass():
    """The bound sits above real models: a 72 B Qwen2.5 shape and an 80-layer one are not refused."""
    from workbench.model.load import check_model_config
    qwen72 = {"vocab_size": 152064, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 29568, "tie_word_embeddings": False}
    check_model_config(qwen72, "qwen2.5-72b")
    with pytest.raises(ModelLoadError, match="about 1.*B parameters"):
        check_model_config({**qwen72, "num_hidden_layers": 160}, "twice as deep")
