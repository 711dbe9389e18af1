"""Streaming generation: every runtime continues a prompt with the tokens a cache-free PyTorch loop picks,
EOS and limits stop it, tokens/s is measured time, text arrives in whole characters, bad folders are one line."""
import json
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from workbench.errors import ModelLoadError, WorkbenchError
from workbench.run.generate import IncrementalText, encode_prompt, open_model
from workbench.onnx.export import export_onnx
from workbench.runtime.onnx_runner import OnnxCausalLM
from workbench.runtime.stream import GenerationStats, Sampling, stream_tokens

STEPS = 32


@torch.inference_mode()
def greedy_without_cache(model, prompt, steps):
    """The reference: the whole sequence through the model at every step, argmax of the last position."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def demo():
    """The demo model: trained, so its greedy continuations vary (a random tiny model repeats one token)."""
    from workbench.model.load import load_model
    return load_model("demo")


@pytest.fixture(scope="module")
def prompt(demo):
    return demo.tokenizer("A class definition")["input_ids"]


@pytest.fixture(scope="module")
def reference(demo, prompt):
    tokens = greedy_without_cache(demo.model, prompt, STEPS)
    assert len(set(tokens)) >= 8  # varied enough that a wrong cache or position shows
    return tokens


@pytest.fixture(scope="module")
def exported(demo, tmp_path_factory):
    return export_onnx(demo, tmp_path_factory.mktemp("onnx"), check=False)


def test_pytorch_stream_with_kv_cache_is_greedy_argmax(demo, prompt, reference):
    stats = GenerationStats(len(prompt))
    assert list(stream_tokens(demo.model, prompt, STEPS, stats=stats)) == reference
    assert stats.new_tokens == STEPS and stats.stop_reason == "max_new_tokens"


def test_onnx_stream_equals_generate_greedy_and_pytorch(exported, prompt, reference):
    runner = OnnxCausalLM(exported.prefill_path, exported.decode_path)
    assert list(stream_tokens(runner, prompt, STEPS)) == runner.generate_greedy(prompt, STEPS) == reference
    assert runner.generate_greedy(prompt, 0) == []


def test_open_model_on_an_export_folder_streams_text(exported, prompt, reference):
    model = open_model(exported.prefill_path.parent, source="demo")
    assert model.runtime == "onnxruntime" and model.eos_ids == (0,) and model.max_positions == 512
    gen = model.stream(prompt, max_new_tokens=STEPS)
    pieces = list(gen)
    assert [p.token for p in pieces if p.token is not None] == gen.tokens == reference
    assert "".join(p.text for p in pieces) == gen.text == model.tokenizer.decode(reference, skip_special_tokens=True)
    with pytest.raises(RuntimeError, match="streams once"):
        list(gen)


def test_mnn_stream_with_kv_cache_equals_pytorch(exported, prompt, reference, tmp_path):
    from workbench.targets.mnn import convert_to_mnn
    for graph in ("prefill", "decode"):
        convert_to_mnn(exported.prefill_path.with_name(f"{graph}.onnx"), tmp_path / f"{graph}.mnn")
    model = open_model(tmp_path, source="demo")
    assert model.runtime == "MNN"
    assert model.generate(prompt, max_new_tokens=STEPS).tokens == reference


def test_quantized_directory_runs_in_pytorch(demo, prompt, tmp_path):
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    out = quantize_model(demo, QuantPlan.uniform("int4", group_size=32), progress=False).save(tmp_path / "q")
    model = open_model(out)
    assert model.runtime == "PyTorch" and "rtn quantized" in model.name
    assert model.generate(prompt, max_new_tokens=6).tokens == greedy_without_cache(model.runner, prompt, 6)


def test_eos_stops_and_is_the_last_token(demo, prompt, reference):
    k = next(i for i, t in enumerate(reference) if t not in reference[:i] and i >= 3)
    stats = GenerationStats(len(prompt))
    tokens = list(stream_tokens(demo.model, prompt, STEPS, eos_ids=[reference[k]], stats=stats))
    assert tokens == reference[:k + 1] and stats.stop_reason == "eos"
    model = replace(open_model(demo), eos_ids=(reference[k],))
    assert model.generate(prompt, max_new_tokens=STEPS).stats.stop_reason == "eos"


def test_positions_limit_stops_with_context(lm):
    prompt = list(range(5, 14))
    stats = GenerationStats(len(prompt))
    tokens = list(stream_tokens(lm.model, prompt, 50, max_positions=len(prompt) + 4, stats=stats))
    assert len(tokens) == 5 and stats.stop_reason == "context"  # 4 more positions fed, a 5th token predicted
    with pytest.raises(ValueError, match="more than the model's 4 positions"):
        list(stream_tokens(lm.model, prompt, 5, max_positions=4))


def test_static_decode_graph_stops_when_its_past_is_full(demo, prompt, tmp_path):
    res = export_onnx(demo, tmp_path, static=(16, 20), check=False)
    stats = GenerationStats(len(prompt))
    tokens = list(stream_tokens(OnnxCausalLM(res.prefill_path, res.decode_path), prompt, 50, stats=stats))
    assert stats.stop_reason == "context" and len(tokens) == 20 + 1 - len(prompt) + 1
    assert tokens == greedy_without_cache(demo.model, prompt, len(tokens))


class SlowRunner:
    """A real runner behind a fixed delay per call: the measured speed must show the delay."""

    def __init__(self, runner, delay):
        self.runner, self.delay = runner, delay

    def run_prefill(self, prompt):
        time.sleep(self.delay)
        return self.runner.run_prefill(prompt)

    def run_decode(self, token, kv, position):
        time.sleep(self.delay)
        return self.runner.run_decode(token, kv, position)


def test_tokens_per_second_is_measured_time_without_the_callers(exported, prompt):
    delay = 0.03
    runner = SlowRunner(OnnxCausalLM(exported.prefill_path, exported.decode_path), delay)
    stats = GenerationStats(len(prompt))
    t0 = time.perf_counter()
    for _ in stream_tokens(runner, prompt, 6, stats=stats):
        time.sleep(0.05)  # the caller drawing the token: not the model's time
    wall = time.perf_counter() - t0
    assert stats.prefill_seconds >= delay and stats.decode_seconds >= 5 * delay
    assert 1 / (delay + 0.02) < stats.tokens_per_second <= 1 / delay  # 5 decode steps of >= 30 ms each
    assert stats.prefill_seconds + stats.decode_seconds < wall - 6 * 0.05 + 0.01
    assert GenerationStats(3, new_tokens=1, prefill_seconds=0.1).tokens_per_second is None


def test_incremental_text_holds_back_unfinished_characters(lm):
    tok = lm.tokenizer
    text = "héllo wörld 日本 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # characters spanning several tokens, as in the demo vocabulary
    inc = IncrementalText(tok, tok("say:", add_special_tokens=False)["input_ids"])
    pieces = [inc.add(t) for t in ids] + [inc.flush()]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # a token that ends inside a character gives nothing until the character is whole
    cut = IncrementalText(tok)
    assert "".join(cut.add(t) for t in ids[:2]) + cut.flush() == tok.decode(ids[:2])  # 'h' and half of 'é'


class FixedLogits:
    """A runner whose every step scores token 1 highest, then 2, then 3: for the sampling rules alone."""

    logits = np.array([-9.0, 3.0, 2.5, 2.0, -9.0])

    def run_prefill(self, prompt):
        return self.logits, None, []

    def run_decode(self, token, kv, position):
        return self.logits, kv, []


def test_sampling_is_seeded_and_keeps_to_top_k():
    draw = lambda s: list(stream_tokens(FixedLogits(), [1], 200, sampling=s))  # noqa: E731
    assert set(draw(Sampling())) == {1} and set(draw(Sampling(1.0, top_k=1))) == {1}
    a = draw(Sampling(1.0, top_k=2, seed=7))
    assert a == draw(Sampling(1.0, top_k=2, seed=7)) and a != draw(Sampling(1.0, top_k=2, seed=8))
    assert set(a) == {1, 2}
    assert set(draw(Sampling(1.0, seed=0))) == {1, 2, 3}
    with pytest.raises(ValueError, match="temperature"):
        Sampling(-1.0)
    with pytest.raises(ValueError, match="top_k"):
        Sampling(1.0, top_k=0)


def test_prompt_errors_are_one_line(lm):
    with pytest.raises(WorkbenchError, match="the prompt is empty"):
        encode_prompt(lm.tokenizer, "  ")
    with pytest.raises(WorkbenchError, match="no chat template"):
        encode_prompt(lm.tokenizer, "hi", chat=True)
    assert encode_prompt(lm.tokenizer, "héllo") == lm.tokenizer("héllo")["input_ids"]
    import copy
    chat = copy.deepcopy(lm.tokenizer)
    chat.chat_template = ("{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}model:{% endif %}")
    rendered = lm.tokenizer("user: hi\nmodel:", add_special_tokens=False)["input_ids"]
    assert encode_prompt(chat, "hi", chat=True) == rendered


def one_line_error(path, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as e:
        open_model(path, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_model_folders_are_one_line_errors(exported, tmp_path):
    assert "does not exist" in one_line_error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "holds no model to generate with" in one_line_error(tmp_path / "empty")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "conversion.json").write_text(json.dumps({"target": "qnn"}))
    assert "is a qnn conversion, which does not run here" in one_line_error(bundle)
    half = tmp_path / "half"
    half.mkdir()
    (half / "prefill.onnx").write_bytes(exported.prefill_path.read_bytes())
    assert "no decode.onnx" in one_line_error(half)
    assert "does not name the model it was converted from" in one_line_error(exported.prefill_path.parent)
    assert "is not a prefill graph" in one_line_error(exported.prefill_path.with_name("weight_names.json"))


@pytest.mark.slow
def test_ort_genai_folder_streams_in_onnxruntime_genai(demo, prompt, tmp_path):
    """An ort-genai folder runs in onnxruntime-genai; with float activations and fp16 layers it continues as the
    PyTorch model of the same weights does, and it needs no conversion.json: the folder holds its tokenizer."""
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    from workbench.targets.ort_genai import build_fused_onnx, write_genai_folder
    qm = quantize_model(demo, QuantPlan.uniform("int4"), progress=False)
    sim = qm.build_model(demo.model)
    build_fused_onnx(sim, tmp_path, qm.precisions, accuracy_level=0)
    write_genai_folder(tmp_path, sim, demo.path, demo.tokenizer)
    model = open_model(tmp_path)
    assert model.runtime == "onnxruntime-genai" and model.eos_ids == (0,) and model.max_positions == 512
    gen = model.generate(prompt, max_new_tokens=STEPS)
    assert gen.tokens == greedy_without_cache(sim, prompt, STEPS) and gen.text.strip()
    assert gen.stats.tokens_per_second > 0
    assert open_model(tmp_path / "model.onnx").runtime == "onnxruntime-genai"
    (tmp_path / "genai_config.json").unlink()
    assert "no genai_config.json beside it" in one_line_error(tmp_path / "model.onnx")
