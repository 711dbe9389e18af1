"""The runtime seam: a runnable target registered here, in the test, is converted to, generated with and profiled
through `workbench convert`, `workbench generate` and `workbench profile`, with no edit to generate.py or profile.py;
folders are matched to targets by conversion.json or by the files a target declares."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.cli import main
from workbench.errors import ModelLoadError, WorkbenchError
from workbench.run.locate import describe_files, find_runnable, locate, open_runner
from workbench.targets import Target, get_target, register_target

TABLE = "skipgram.npz"


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


class SkipBlocksRunner:
    """The model without its transformer blocks: the last token's embedding, the final norm, the head. A runner
    as the seam wants one: ``run_prefill`` / ``run_decode`` (an empty KV cache), ``logits`` and a runtime name."""

    runtime = "numpy skip-blocks"

    def __init__(self, folder, *, threads=None):
        data = np.load(Path(folder) / TABLE)
        self.embed, self.norm, self.head, self.eps = data["embed"], data["norm"], data["head"], float(data["eps"])
        self.threads = threads

    def logits(self, ids) -> np.ndarray:
        return rms_norm(self.embed[np.asarray(ids)], self.norm, self.eps) @ self.head.T

    def run_prefill(self, prompt):
        logits = self.logits([list(prompt)])
        return logits[0, -1], logits, []

    def run_decode(self, token, kv, position):
        return self.logits([[token]])[0, -1], kv, []


def convert_skip_blocks(job) -> None:
    """Write the simulation's embedding, final norm and head: all the skip-blocks runner needs."""
    model = job.prep.sim_lm.model
    job.out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        np.savez(job.out / TABLE, embed=model.get_input_embeddings().weight.float().numpy(),
                 norm=model.model.norm.weight.float().numpy(), head=model.get_output_embeddings().weight.float().numpy(),
                 eps=model.config.rms_norm_eps)
    job.report.details["skip_blocks"] = "embedding, final norm and head only"
    job.measure(SkipBlocksRunner(job.out).logits, job.out / TABLE, "skip-blocks")


@pytest.fixture(scope="module")
def exported(lm, tmp_path_factory):
    from workbench.onnx.export import export_onnx
    return export_onnx(lm, tmp_path_factory.mktemp("onnx"), check=False)


@pytest.fixture
def skip_blocks(monkeypatch):
    """A runnable target defined in this test and registered for this test only."""
    from workbench.targets import registry
    monkeypatch.setattr(registry, "_TARGETS", dict(registry._TARGETS))
    return register_target(Target("skip-blocks", "Skip the blocks (test)", convert=convert_skip_blocks, runnable=True,
                                  runner=SkipBlocksRunner, files=(TABLE,), module=__name__))


def expected_tokens(lm, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the same computation in PyTorch: head(norm(embed(last token)))."""
    m, out, last = lm.model, [], prompt_ids[-1]
    with torch.no_grad():
        for _ in range(n):
            h = m.model.norm(m.get_input_embeddings()(torch.tensor([[last]])).float())
            last = int(m.get_output_embeddings()(h)[0, -1].argmax())
            out.append(last)
    return out


def test_a_runnable_target_defined_in_a_test_converts_generates_and_profiles(skip_blocks, tiny_model_dir, lm,
                                                                              tmp_path, capsys):
    out = tmp_path / "runs" / "skip"
    assert main(["convert", str(tiny_model_dir), "--target", "skip-blocks", "--bits", "8", "--out", str(out),
                 "--max-tokens", "200", "--ctx", "32", "--json"]) == 0
    capsys.readouterr()
    assert json.loads((out / "conversion.json").read_text())["target"] == "skip-blocks"
    found = locate(out)
    assert found.target is get_target("skip-blocks") and found.recorded == "skip-blocks" and found.entry == out / TABLE
    assert isinstance(open_runner(out), SkipBlocksRunner)

    assert main(["generate", str(out), "--prompt", "The workbench", "--max-new-tokens", "6", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtime"] == "numpy skip-blocks" and "skip-blocks" in doc["model"]
    want = expected_tokens(lm, doc["prompt_ids"], 6)
    assert doc["tokens"] == want[:len(doc["tokens"])] and doc["tokens"]  # stops early only at an end-of-sequence id
    assert len(doc["tokens"]) == 6 or doc["tokens"][-1] == 0

    assert main(["profile", str(out.parent), "--prompt-lengths", "4", "--repeats", "1", "--decode-steps", "2",
                 "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)["profiles"]
    assert p["name"] == "skip" and p["runtime"] == "numpy skip-blocks"
    assert p["size_bytes"] == (out / TABLE).stat().st_size and p["decode_tokens_per_second"] > 0
    assert p["prefill_ms"]["4"] > 0


def test_a_folder_is_matched_by_the_files_its_target_declares(skip_blocks, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    rng = np.random.default_rng(0)
    np.savez(bare / TABLE, embed=rng.normal(size=(16, 4)), norm=np.ones(4), head=rng.normal(size=(16, 4)), eps=1e-6)
    found = locate(bare)  # no conversion.json: recognised by its file
    assert found.target.name == "skip-blocks" and found.recorded is None and found.decode_graph == bare / TABLE
    assert locate(bare / TABLE).folder == bare  # the target's first file opens its folder too
    runner = open_runner(bare)
    last, logits, kv = runner.run_prefill([1, 2, 3])
    assert logits.shape == (1, 3, 16) and np.allclose(last, logits[0, -1]) and kv == []
    assert [f.folder for f in find_runnable(tmp_path)] == [bare]
    assert TABLE in describe_files()


def test_partial_and_unknown_folders_are_one_line_errors(tmp_path, exported):
    export = exported
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(export.prefill_path, half / "prefill.onnx")
    with pytest.raises(ModelLoadError, match="has prefill.onnx but no decode.onnx"):
        locate(half)
    assert locate(half, strict=False) is None
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "conversion.json").write_text(json.dumps({"target": "ort-qdq"}))
    with pytest.raises(ModelLoadError, match="is a ort-qdq conversion without prefill.qdq.onnx, decode.qdq.onnx"):
        locate(recorded)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "conversion.json").write_text(json.dumps({"target": "tensorrt"}))  # a target without a runner
    with pytest.raises(ModelLoadError, match="is a tensorrt conversion, which does not run here: pick an output of"):
        open_runner(bundle)
    with pytest.raises(ModelLoadError, match="is not a prefill graph or model file a target runs"):
        locate(bundle / "conversion.json")
    with pytest.raises(WorkbenchError, match="nothing to run below"):
        find_runnable(bundle)


def test_an_export_runs_in_onnxruntime_and_a_qnn_folder_in_the_runner_its_files_name(tmp_path, exported):
    export = exported
    folder = export.prefill_path.parent
    found = locate(folder)
    assert found.target.name == "ort-int4" and found.recorded is None  # the export's files are ort-int4's
    runner = open_runner(folder, threads=1)
    assert runner.runtime == "onnxruntime" and runner.decode is not None
    qnn = tmp_path / "qnn"
    shutil.copytree(folder, qnn)
    (qnn / "conversion.json").write_text(json.dumps({"target": "qnn"}))  # qnn registers no runner: its float graphs run
    assert locate(qnn).target.name == "ort-int4" and locate(qnn).recorded is None


def test_onnx_runner_applies_session_options_to_every_session(exported, lm, tmp_path):
    """``session_options`` configures each session it makes (another execution provider goes there): called once
    per session, before it is created; an EP chosen on the options replaces the runner's ``providers``."""
    import onnxruntime as ort

    from workbench.onnx.export import export_onnx
    from workbench.runtime.onnx_runner import OnnxCausalLM
    seen = []

    def configure(opts):
        assert isinstance(opts, ort.SessionOptions)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        seen.append(opts)

    ids = np.array([[1, 5, 9, 2]])
    plain = OnnxCausalLM(exported.prefill_path, exported.decode_path)
    tuned = OnnxCausalLM(exported.prefill_path, exported.decode_path, session_options=configure)
    assert len(seen) == 1  # a dynamic decode graph serves prefill too: one session
    np.testing.assert_allclose(tuned.logits(ids), plain.logits(ids), atol=1e-4)
    cpu = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    static = export_onnx(lm, tmp_path / "static", static=(8, 16), check=False)
    by_device = OnnxCausalLM(static.prefill_path, static.decode_path, providers=("NoSuchExecutionProvider",),
                             session_options=lambda opts: opts.add_provider_for_devices(cpu, {}))
    assert by_device.prefill is not by_device.decode  # static graphs: two sessions, both on the device's EP
    assert by_device.prefill.get_providers()[0] == "CPUExecutionProvider"
    last, _, kv = by_device.run_prefill([1, 5, 9])
    np.testing.assert_allclose(last, plain.run_prefill([1, 5, 9])[0], atol=1e-4)


def test_an_rknn_conversion_is_refused_as_not_runnable_here_and_a_tree_profile_goes_on(exported, tmp_path, capsys):
    """rknn writes prefill.onnx + decode.onnx too: its conversion.json, not its file names, says whose folder it
    is; a tree profile reports the rknn and the damaged folder and still profiles the intact export."""
    from workbench.run.profile import profile_directory
    tree = tmp_path / "out"
    good, rknn, bad = tree / "a_export", tree / "b_rknn", tree / "c_bad"
    shutil.copytree(Path(exported.prefill_path).parent, good)
    shutil.copytree(good, rknn)
    (rknn / "conversion.json").write_text(json.dumps({"target": "rknn"}))
    bad.mkdir()
    for name in ("prefill.onnx", "decode.onnx"):
        (bad / name).write_bytes(b"not a graph")
    with pytest.raises(ModelLoadError, match="rknn conversion.*does not run here"):
        open_runner(rknn)
    assert locate(rknn, strict=False) is None
    assert main(["generate", str(rknn), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "does not run here" in capsys.readouterr().err
    profiles = profile_directory(tree, prompt_lengths=(4,), decode_steps=2, repeats=1)
    err = capsys.readouterr().err
    assert [p.name for p in profiles] == ["a_export"]
    assert "b_rknn" in err and "does not run here" in err and "c_bad" in err


def test_a_damaged_graph_or_htp_json_is_a_one_line_error_naming_that_file(exported, tmp_path):
    from workbench.runtime.onnx_runner import GraphLoadError, OnnxCausalLM
    from workbench.targets.htp import SOC_FILE, htp_runner
    folder = tmp_path / "g"
    shutil.copytree(Path(exported.prefill_path).parent, folder)
    (folder / "prefill.onnx").write_bytes((folder / "prefill.onnx").read_bytes()[:100])
    with pytest.raises(GraphLoadError, match=r"prefill\.onnx"):
        OnnxCausalLM(folder / "prefill.onnx", None)
    (folder / SOC_FILE).write_text("not json")
    with pytest.raises(ModelLoadError, match=r"htp\.json.*convert again"):
        htp_runner(folder)
