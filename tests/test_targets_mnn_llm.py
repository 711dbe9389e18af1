"""mnn-llm: MNN's LLM model directory, loaded, scored, streamed and timed by MNN's own engine (MNN.llm)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

try:
    import MNN.llm  # noqa: F401  (the engine)
    import _tools  # noqa: F401  (the converter extension)
except ImportError:
    pytest.skip("MNN is not installed: pip install -c constraints.txt MNN", allow_module_level=True)

from workbench.cli import main
from workbench.targets.convert import convert, prepare_models
from workbench.errors import ModelLoadError, WorkbenchError
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.run.locate import locate, open_runner
from workbench.targets.mnn_llm import FILES, MnnLlm, write_tokenizer_txt

EVAL = {"max_tokens": 2048}  # the demo text's first 2,048 tokens: four 512-token windows


@pytest.fixture(scope="module")
def bits4(tmp_path_factory):
    """`workbench convert demo --bits 4 --target mnn-llm` (the default plan: scale search on)."""
    out = tmp_path_factory.mktemp("mnn-llm")
    return convert("demo", "mnn-llm", out, bits=4, **EVAL), out


@pytest.fixture(scope="module")
def minmax(tmp_path_factory):
    """A plan whose scales are each block's range, which MNN's asymmetric re-quantization reproduces."""
    out = tmp_path_factory.mktemp("mnn-llm-minmax")
    prep = prepare_models("demo", plan=QuantPlan.uniform("int4", group_size=32, scale_search=False))
    return convert("demo", "mnn-llm", out, prepared=prep, **EVAL), out, prep


def test_convert_writes_the_engine_directory_and_scores_it_in_the_engine(bits4):
    report, out = bits4
    assert all((out / f).is_file() and (out / f).stat().st_size > 0 for f in FILES)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["llm_model"] == "llm.mnn" and cfg["tokenizer_file"] == "tokenizer.txt"
    assert json.loads((out / "llm_config.json").read_text())["layer_nums"] == 4
    assert report.details["mnn_llm"]["attention_ops"] == 4  # every layer's attention is MNN's KV-cache op
    sim = report.simulation["kl_divergence"]
    assert report.kl_divergence <= 1.5 * sim, (report.kl_divergence, sim)
    assert report.top1_agreement_vs_simulation >= 0.99 and report.gap is None
    d = report.decode  # teacher-forced through the engine's own KV cache, every step scored
    assert d["tokens"] >= 512 and d["kl_divergence"] <= 1.5 * sim and d["top1_agreement_vs_simulation"] >= 0.99
    speed = report.details["runtime_speed"]
    assert speed["runtime"] == "MNN-LLM" and speed["decode_tokens_per_second"] > 0 and speed["prefill_ms"] > 0


def _mnn_blocks(mnn_path, tmp_path):
    """Each quantized MNN op's weight ``{op name: value [rows, block]}`` read back from ``llm.mnn.weight`` as MNN's
    format lays it out: at the op's ``external`` offset its code buffer (a dims byte, int16 rows and block, the
    code table, codes high nibble first), then one float32 scale per row."""
    from workbench.targets.mnn import run_mnnconvert
    out = tmp_path / "readback.json"
    run_mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", str(mnn_path), "--JsonFile", str(out)])
    data = np.fromfile(f"{mnn_path}.weight", dtype=np.uint8)
    blocks = {}
    for op in json.loads(out.read_text())["oplists"]:
        main = op.get("main") or {}
        if op["type"] != "Convolution" or "quanParameter" not in main:
            continue
        offset, size, alpha_bytes = main["external"][:3]
        buf = data[offset:offset + size]
        alpha = data[offset + size:offset + size + alpha_bytes].view(np.float32)
        rows, width = (int(x) for x in buf[1:5].view(np.uint16))
        table = buf[6:6 + buf[5]].view(np.int8).astype(np.float32)
        codes = buf[6 + buf[5]:]
        idx = np.stack([codes >> 4, codes & 15], -1).reshape(rows, width)
        blocks[op["name"].split("__")[0]] = table[idx] * alpha[:, None]
    return blocks


def test_the_weight_file_holds_the_plan_integers(bits4, tmp_path):
    """The default plan's scales are searched (not each block's range): its codes and scales are written as they
    are, so every weight MNN reads back is the simulation's, exactly."""
    report, out = bits4
    info = report.details["mnn_llm"]
    assert (info["weight_bits"], info["block"], info["plan_codes_written"]) == (4, 128, 28)
    assert info["kept_float"]  # the tied fp16 head stays float
    prep = prepare_models("demo", bits=4)
    blocks = _mnn_blocks(out / "llm.mnn", tmp_path)
    assert len(blocks) == 28
    for name, qw in prep.qm.weights.items():
        if prep.qm.layer(name).kind == "linear":
            np.testing.assert_array_equal(blocks[name].reshape(qw.shape), qw.dequantize().numpy())


def test_min_max_plan_runs_within_the_simulation(minmax):
    report, out, prep = minmax
    assert report.details["mnn_llm"]["block"] == 32
    assert report.kl_divergence <= 1.5 * report.simulation["kl_divergence"]
    assert report.top1_agreement_vs_simulation >= 0.99


def test_engine_kv_cache_decode_matches_the_simulation(minmax):
    """Token by token through the engine's own cache: each step's logits are the simulation's at that position."""
    _, out, prep = minmax
    ids = prep.float_lm.tokenizer("The workbench measures what each choice costs.")["input_ids"]
    with torch.inference_mode():
        ref = prep.sim_lm.model(torch.tensor([ids])).logits[0].float().numpy()
    lm = MnnLlm(out, threads=1)
    steps = lm.steps()
    got = [steps.start(ids[:3])] + [steps.step(t, i) for i, t in enumerate(ids[3:], 3)]
    scale = np.abs(ref).max()
    assert np.abs(np.stack(got) - ref[2:]).max() < 0.01 * scale
    assert np.abs(lm.logits(np.array([ids]))[0] - ref).max() < 0.01 * scale  # every position, fresh prompt


def test_generate_streams_through_the_engine(bits4, capsys):
    _, out = bits4
    assert main(["generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtime"] == "MNN-LLM" and doc["new_tokens"] == 8


def test_profile_prints_the_engine_own_speed(bits4, capsys):
    _, out = bits4
    assert locate(out).target.name == "mnn-llm"
    assert main(["profile", str(out), "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "MNN-LLM" in text
    lm = open_runner(out)
    ctx_prompt = list(range(1, 33))
    assert lm.prefill_seconds(ctx_prompt) > 0 and lm.context.prompt_len == 32  # the engine's own counters
    assert lm.decode_seconds(ctx_prompt, 8) > 0 and lm.context.gen_seq_len == 9


def test_tokenizer_file_is_read_by_the_engine_like_the_model_tokenizer(bits4):
    _, out = bits4
    lm = MnnLlm(out)
    prep_tok = load_model("demo").tokenizer
    text = "Once upon a time, the model said words."
    assert lm.m.tokenizer_encode(text) == prep_tok(text, add_special_tokens=False)["input_ids"]


def test_a_folder_missing_a_file_is_refused_by_name(bits4, tmp_path):
    _, out = bits4
    for f in FILES:
        if f != "tokenizer.txt":
            (tmp_path / f).write_bytes((out / f).read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer.txt"):
        MnnLlm(tmp_path)


def test_non_bpe_tokenizer_is_refused(tmp_path):
    class Backend:
        def to_str(self):
            return json.dumps({"model": {"type": "Unigram", "vocab": []}, "pre_tokenizer": None})

    class Tok:
        backend_tokenizer = Backend()
    with pytest.raises(WorkbenchError, match="byte-level BPE"):
        write_tokenizer_txt(Tok(), tmp_path / "tokenizer.txt", [0])


def test_devices_gap_row_shows_the_engine_own_speed_beside_its_kl(bits4):
    from workbench.run.devices_gap import CONVERT_RUNTIMES, TARGETS, convert_row, missing_toolchain
    report, _ = bits4
    assert "mnn-llm" in TARGETS and missing_toolchain("mnn-llm") is None
    row = convert_row("mnn-llm", CONVERT_RUNTIMES["mnn-llm"], json.loads(json.dumps(report.to_dict(), default=str)),
                      1.0, 2**20)
    assert row["prefill"]["kl"] == report.kl_divergence and row["decode"]["kl"] == report.decode["kl_divergence"]
    assert "MNN-LLM's own" in row["note"] and row["speed"] and row["gap"] is None


@pytest.fixture(scope="module")
def biased_qwen2(tmp_path_factory):
    """A tiny Qwen2 whose q/k/v projections carry non-zero biases (MNN's converter merges each MatMul with its
    bias Add), converted with a plan MNN's block layout holds as it is."""
    from transformers import Qwen2ForCausalLM

    from conftest import build_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("qwen2-bias") / "qwen2", "qwen2")
    model = Qwen2ForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias is not None
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    out = tmp_path_factory.mktemp("mnn-llm-qwen2")
    prep = prepare_models(str(path), plan=QuantPlan.uniform("int4", group_size=32))
    return convert(str(path), "mnn-llm", out, prepared=prep, max_tokens=256), out, prep


def test_biased_projections_keep_the_plan_integers_and_their_bias(biased_qwen2, tmp_path):
    report, out, prep = biased_qwen2
    quantized = [n for n in prep.qm.weights if prep.qm.layer(n).kind == "linear"]
    assert len(quantized) == 14 and report.details["mnn_llm"]["plan_codes_written"] == 14
    blocks = _mnn_blocks(out / "llm.mnn", tmp_path)
    for name in quantized:
        qw = prep.qm.weights[name]
        np.testing.assert_array_equal(blocks[name].reshape(qw.shape), qw.dequantize().numpy())
    ids = prep.float_lm.tokenizer("The workbench measures what each choice costs.")["input_ids"]
    with torch.inference_mode():
        ref = prep.sim_lm.model(torch.tensor([ids])).logits[0].float().numpy()
    got = MnnLlm(out).logits(np.array([ids]))[0]  # the biases are in the engine graph: its logits are the simulation's
    assert np.abs(got - ref).max() < 0.01 * np.abs(ref).max()
    assert report.top1_agreement_vs_simulation >= 0.99


def test_weights_past_the_inline_limit_go_to_onnx_external_data(biased_qwen2, tmp_path):
    """Past ``inline_limit`` bytes the ONNX graph's weights are written to its external-data file one tensor at a
    time (what keeps a 0.5 B model's conversion bounded); the engine then computes what the inline graph does."""
    from workbench.onnx.build import DATA_FILE
    from workbench.targets.mnn_llm import write_mnn_llm_folder
    _, inline_out, prep = biased_qwen2
    work = tmp_path / "work"
    info = write_mnn_llm_folder(prep.sim_lm, prep.qm, tmp_path / "out", work, inline_limit=0)
    assert info["plan_codes_written"] == 14
    data = work / DATA_FILE
    assert data.is_file() and data.stat().st_size > 4 * (work / "llm.onnx").stat().st_size
    ids = np.array([prep.float_lm.tokenizer("Weights from the data file.")["input_ids"]])
    np.testing.assert_allclose(MnnLlm(tmp_path / "out").logits(ids), MnnLlm(inline_out).logits(ids), rtol=0, atol=1e-5)
