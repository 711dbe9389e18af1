"""The generate panel without a browser: in the app it streams the demo model's INT4 ONNX conversion beside the
float model, with tokens/s for each; standalone it opens any convert output; bad input is a status line."""
import re

import pytest
from conftest import loaded_app

from workbench.assets import DEMO_MODEL_DIR
from workbench.ui.app import TAB_TITLES, WorkbenchApp
from workbench.ui.generate import FLOAT, GeneratePanel

pytestmark = pytest.mark.slow  # every test here converts or exports and runs a runtime first

SPEED = re.compile(r"<b>([\d,]+\.\d) tok/s</b>")


def speed(column) -> float:
    found = SPEED.search(column.stats.value)
    assert found, column.stats.value
    return float(found.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def demo_app(tmp_path_factory):
    """The app on the demo model, quantized (RTN INT4) and converted to ort-int4 through its own tabs."""
    app = loaded_app(tmp_path_factory.mktemp("app"), "demo", 256)
    assert app.quantize_panel.run() is not None, app.quantize_panel.error
    assert app.convert_panel.run("ort-int4") is not None, app.convert_panel.error
    return app


def test_generate_tab_streams_the_int4_onnx_beside_the_float_model(demo_app):
    app, panel = demo_app, demo_app.generate_panel
    assert app.tabs.get_title(TAB_TITLES.index("Generate")) == "Generate"
    assert app.tabs.children[TAB_TITLES.index("Generate")] is panel
    int4 = app.session.conversions[-1].out_dir
    assert panel.model.value == str(int4) and panel.choice.options[0][0].startswith("ort-int4: ")
    seen = []
    panel.columns["chosen"].text.observe(lambda change: seen.append(change["new"]), names="value")
    panel.max_tokens.value = 24
    panel.generate_button.click()
    assert panel.error is None, panel.error
    chosen, float_ = panel.results["chosen"], panel.results["float"]
    assert chosen.model.runtime == "onnxruntime" and "ort-int4" in panel.columns["chosen"].heading.value
    assert float_.model.runtime == "PyTorch" and "float" in panel.columns["float"].heading.value
    for key, gen in panel.results.items():
        assert gen.stats.new_tokens == 24 and gen.text.strip()
        assert gen.text.strip()[:20] in panel.columns[key].text.value.replace("&#x27;", "'").replace("&quot;", '"')
        assert speed(panel.columns[key]) == pytest.approx(gen.stats.tokens_per_second, rel=1e-3, abs=0.06)
        assert gen.stats.tokens_per_second > 0 and "prefill" in panel.columns[key].stats.value
    texts = [t for t in seen if t]
    assert len(texts) >= 10 and len(texts[0]) < len(texts[-1])  # streamed token by token, not shown at the end
    # the INT4 model follows the float model's greedy text for a while (same plan as the simulation's checks)
    assert chosen.tokens[:4] == float_.tokens[:4]


def test_the_float_model_alone_and_a_bad_folder(demo_app, tmp_path):
    panel = demo_app.generate_panel
    labels = [label for label, _ in panel.choice.options]
    assert labels[-1] == "float model (PyTorch)" and any(label.startswith("quantized model") for label in labels)
    panel.choice.value = FLOAT
    assert panel.model.value == FLOAT
    panel.max_tokens.value = 8
    results = panel.run()
    assert list(results) == ["chosen"] and results["chosen"].model.runtime == "PyTorch"
    assert "the chosen model is the float model" in panel.columns["float"].stats.value
    panel.model.value = str(tmp_path)
    assert panel.run() is None and "holds no model to generate with" in panel.error
    assert "error:" in panel.status.value and not panel.generate_button.disabled
    panel.model.value = str(demo_app.session.conversions[-1].out_dir)
    panel.prompt.value = " "
    assert panel.run() is None and "the prompt is empty" in panel.error


def test_standalone_panel_finds_the_float_model_in_conversion_json(demo_app):
    int4 = demo_app.session.conversions[-1].out_dir
    panel = GeneratePanel(int4, max_new_tokens=6)
    assert [v for _, v in panel.choice.options] == [str(int4), FLOAT]
    results = panel.run()
    assert results is not None, panel.error
    assert results["float"].model.path == DEMO_MODEL_DIR and results["float"].stats.new_tokens == 6
    panel.temperature.value, panel.top_k.value, panel.seed.value = 1.0, 20, 3
    first = panel.run()["chosen"]
    again = panel.run()["chosen"]
    assert again.tokens == first.tokens  # seeded sampling repeats
    assert again.model is first.model is results["chosen"].model and len(panel._loaded) == 2  # opened once
    panel.threads.value = 2  # another thread count opens the runtime again; only two models stay loaded
    assert panel.run()["chosen"].model is not first.model and len(panel._loaded) == 2


def test_generate_tab_streams_the_ort_genai_artifact_in_onnxruntime_genai(demo_app):
    """Export's ort-genai output becomes the newest choice and streams from onnxruntime-genai's runtime."""
    app, panel = demo_app, demo_app.generate_panel
    assert app.convert_panel.run("ort-genai") is not None, app.convert_panel.error
    genai = app.session.conversions[-1].out_dir
    assert panel.model.value == str(genai) and panel.choice.options[0][0].startswith("ort-genai: ")
    panel.prompt.value, panel.max_tokens.value = "A class definition", 16
    panel.generate_button.click()
    assert panel.error is None, panel.error
    chosen, float_ = panel.results["chosen"], panel.results["float"]
    assert chosen.model.runtime == "onnxruntime-genai" and "ort-genai" in panel.columns["chosen"].heading.value
    assert chosen.stats.new_tokens == 16 and chosen.text.strip() and speed(panel.columns["chosen"]) > 0
    assert chosen.text.strip()[:12] in panel.columns["chosen"].text.value.replace("&#x27;", "'").replace("&quot;", '"')
    assert float_.model.runtime == "PyTorch" and chosen.tokens[:4] == float_.tokens[:4]


def test_why_a_generation_stopped_is_said_in_words():
    """Issue 55.10: "stopped: max_new_tokens" on the page and in the status line."""
    from workbench.runtime.stream import GenerationStats
    s = GenerationStats(prompt_tokens=3, new_tokens=24, stop_reason="max_new_tokens")
    assert "stopped: reached the token limit (max tokens)" in s.summary() and "max_new_tokens" not in s.summary()
    assert s.to_dict()["stop_reason"] == "max_new_tokens"  # the code stays in the JSON
