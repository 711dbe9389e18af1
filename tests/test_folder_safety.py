"""A model folder is data: no library it names is loaded, and no file outside it is opened because a file in it
says so (checked with a library whose constructor writes a marker, and with an audit hook on every open)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from workbench.errors import ModelLoadError
from workbench.files.folder_paths import inside_folder

_OPENED: list[str] | None = None


def _watch(event, args):
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_watch)


class opened:
    """Every path opened through Python's ``open`` (numpy's memmap included) while the block runs."""

    def __enter__(self):
        global _OPENED
        _OPENED = []
        return _OPENED

    def __exit__(self, *exc):
        global _OPENED
        _OPENED = None


def _marker_library(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: apt-get install gcc")
    tmp_path.mkdir(parents=True, exist_ok=True)
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "ops.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {'
                   f' FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    lib = tmp_path / "ops.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib, marker


def test_the_marker_library_does_run_when_loaded(tmp_path):
    """The marker is real: loading the library writes it (so its absence below means it was not loaded)."""
    import ctypes
    lib, marker = _marker_library(tmp_path)
    ctypes.CDLL(str(lib))
    assert marker.exists()


@pytest.mark.parametrize("where", ["beside", "absolute"])
def test_a_genai_config_naming_a_custom_ops_library_is_refused_before_loading_it(tmp_path, where, capsys,
                                                                                  tiny_model_dir):
    pytest.importorskip("onnxruntime_genai", reason="pip install --no-deps onnxruntime-genai==0.18.0")
    from workbench.cli import main
    from workbench.targets.ort_genai import GenaiCausalLM
    lib, marker = _marker_library(tmp_path / "lib" if where == "absolute" else tmp_path / "genai")
    folder = lib.parent if where == "beside" else tmp_path / "genai"
    folder.mkdir(exist_ok=True)
    named = "ops.so" if where == "beside" else str(lib)
    (folder / "genai_config.json").write_text(json.dumps({
        "model": {"vocab_size": 8, "decoder": {"filename": "model.onnx",
                                               "session_options": {"custom_ops_library": named}}},
        "search": {"max_length": 16}}))
    (folder / "model.onnx").write_bytes(b"")
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, folder / f.name)
    with pytest.raises(ModelLoadError, match=r"genai_config\.json.*model\.decoder\.session_options\.custom_ops_library"):
        GenaiCausalLM(folder)
    assert main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "custom_ops_library" in err and "this is a bug" not in err
    assert not marker.exists()


@pytest.mark.parametrize("named", ["../outside/x.data", "ABSOLUTE", "link.data"])
def test_paths_named_by_a_folder_file_must_resolve_inside_it(tmp_path, named):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    (outside / "x.data").write_bytes(b"x" * 64)
    if named == "ABSOLUTE":
        named = str(outside / "x.data")
    if named == "link.data":
        (folder / "link.data").symlink_to(outside / "x.data")
    with pytest.raises(ModelLoadError, match="outside its folder"):
        inside_folder(folder, named, folder / "graph.onnx", "external data location")
    (folder / "w.data").write_bytes(b"")
    assert inside_folder(folder, "w.data", folder / "graph.onnx") == (folder / "w.data").resolve()


@pytest.fixture(scope="module")
def static_graphs(lm, tmp_path_factory):
    from workbench.onnx.export import export_onnx
    return export_onnx(lm, tmp_path_factory.mktemp("static"), static=(8, 16), check=False)


def _point_external_data_at(graph: Path, location: str) -> None:
    """Move every weight of ``graph`` to external data (first call), then make every location read ``location``."""
    proto = onnx.load(str(graph), load_external_data=False)
    if not any(init.external_data for init in proto.graph.initializer):
        from onnx.external_data_helper import convert_model_to_external_data
        proto = onnx.load(str(graph))
        convert_model_to_external_data(proto, all_tensors_to_one_file=True, location=graph.name + ".data",
                                       size_threshold=0)
        onnx.save(proto, str(graph))
        proto = onnx.load(str(graph), load_external_data=False)
    for init in proto.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, str(graph))


@pytest.mark.parametrize("kind", ["parent", "absolute", "symlink"])
def test_a_static_graph_whose_external_data_lies_outside_is_refused_before_opening_it(static_graphs, tmp_path, kind):
    from workbench.runtime.onnx_runner import OnnxCausalLM
    folder, outside = tmp_path / "graphs", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    for p in (static_graphs.prefill_path, static_graphs.decode_path):
        shutil.copy(p, folder / Path(p).name)
        for extra in Path(p).parent.glob(Path(p).name + "*.data"):
            shutil.copy(extra, folder / extra.name)
    decode = folder / Path(static_graphs.decode_path).name
    _point_external_data_at(decode, decode.name + ".data")
    (outside / "x.data").write_bytes(np.zeros(1 << 20, np.uint8).tobytes())
    named = {"parent": "../outside/x.data", "absolute": str(outside / "x.data"), "symlink": "link.data"}[kind]
    if kind == "symlink":
        (folder / "link.data").symlink_to(outside / "x.data")
    _point_external_data_at(decode, named)
    with opened() as paths, pytest.raises(ModelLoadError, match=r"decode.*outside its folder"):
        OnnxCausalLM(folder / Path(static_graphs.prefill_path).name, decode)
    assert not [p for p in paths if Path(p).resolve().is_relative_to(outside.resolve())]



@pytest.mark.parametrize("named", ["../outside/ctx_qnn.bin", "/etc/passwd", "link.bin"])
def test_a_context_graph_naming_a_binary_outside_is_refused_before_any_session(tmp_path, named):
    """An EPContext node's ep_cache_context (a compiled QNN context kept beside the graph) is a path like any
    other: outside the folder it is refused before onnxruntime is asked to open it."""
    from onnx import TensorProto, helper
    from workbench.runtime.onnx_runner import OnnxCausalLM
    folder, outside = tmp_path / "ctx", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    (outside / "ctx_qnn.bin").write_bytes(b"\0" * 4096)
    if named == "link.bin":
        (folder / "link.bin").symlink_to(outside / "ctx_qnn.bin")
    node = helper.make_node("EPContext", ["input_ids"], ["logits"], name="qnn_ctx", domain="com.microsoft",
                            embed_mode=0, ep_cache_context=named, source="Qnn")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8, 16])])
    path = folder / "prefill_ctx.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(path))
    with opened() as paths, pytest.raises(ModelLoadError, match=r"ep_cache_context of node 'qnn_ctx'.*outside its "
                                                                 r"folder"):
        OnnxCausalLM(path)
    assert not [p for p in paths if Path(p).resolve().is_relative_to(outside.resolve()) or p == "/etc/passwd"]


def test_a_packed_4_bit_weight_outside_is_refused_too(tmp_path):
    """4-bit (QDQ) weights are left to onnxruntime to read: their location is checked all the same."""
    from onnx import TensorProto, helper
    from workbench.files.folder_paths import check_graph_paths
    folder = tmp_path / "qdq"
    folder.mkdir()
    w = TensorProto(name="w", data_type=TensorProto.INT4, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "../elsewhere/w.bin"), ("offset", "0"), ("length", "2")):
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], initializer=[w])
    onnx.save(helper.make_model(graph), str(folder / "g.onnx"))
    with pytest.raises(ModelLoadError, match=r"external data location '\.\./elsewhere/w\.bin'.*outside"):
        check_graph_paths(folder / "g.onnx")
