"""The app on a vision-language model, without a browser: Load names the demo VLM's parts, a picture is chosen (a
bundled one or an upload, bad files refused in one red line), Precisions groups the layers by part with a setter
each, Quantize scores the quantized model on pictures as the library does, Generate answers about the picture."""
import io
from datetime import datetime, timezone
import struct
import zlib
from pathlib import Path

import pytest
from conftest import build_tiny_model, loaded_app

from workbench.assets import DEMO_VL_DATA_DIR
from workbench.model.vision_quality import VisionEvalSet, measure_vision_quality, part_layers, vision_eval_set
from workbench.quantize.plan import QuantPlan
from workbench.ui.app import WorkbenchApp
from workbench.ui.overrides import OverridePanel
from workbench.ui.session import report_markdown
from workbench.ui.vision import bundled_pictures, model_words, vision_sentences

RED = "color:#c0392b"


def png_bytes(size=(40, 30), colour=(200, 30, 30, 255), mode="RGBA") -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width=100_000, height=100_000) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels, with a few bytes of data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def small_set() -> VisionEvalSet:
    """A dozen questions and eight captioned pictures of the bundled held-out set: seconds, not a minute."""
    full = vision_eval_set()
    return VisionEvalSet(full.questions[:12], full.captions[:8], "12 bundled questions, 8 captioned pictures")


@pytest.fixture(scope="module")
def vl_app(tmp_path_factory):
    app = loaded_app(tmp_path_factory.mktemp("vlapp"), "demo-vl", 128)
    app.quantize_panel.vision_set = small_set()
    return app


def test_load_says_vision_language_and_names_each_part(vl_app):
    lm = vl_app.lm
    parts = lm.parts()
    assert [p.name for p in parts] == ["vision encoder", "projector", "language model"]
    status = vl_app.status.value
    assert "a vision-language model" in status
    panel = vl_app.vision_panel
    assert vl_app.vision_box.children == (panel,)
    for p in parts:  # the figures `workbench info` gives, in the status line and in the parts table
        assert f"{p.name} {p.parameters:,} parameters" in status
        assert f"<b>{p.name}</b>" in panel.parts.value and f"{p.parameters:,}" in panel.parts.value
        assert f"<td>{p.layers}</td>" in panel.parts.value
    assert sum(p.layers for p in parts) == len(lm.layers)


def test_picture_picker_bundled_and_uploads(vl_app):
    panel, session = vl_app.vision_panel, vl_app.session
    bundled = bundled_pictures()
    assert len(bundled) == 48 and all(p.is_file() for _, p in bundled)
    assert session.image == bundled[0][1] and panel.picture.value == bundled[0][1]
    first = panel.preview.value
    panel.picture.value = bundled[5][1]  # what the dropdown does
    assert session.image == bundled[5][1] and panel.preview.value != first and panel.error is None
    assert "56 x 56 pixels" in panel.caption.value
    images = session.out_dir / "images"
    for name, data, words in (("notes.png", b"plain text, not a picture", "not an image Pillow can read"),
                              ("cut.png", png_bytes()[:60], "truncated or corrupt"),
                              ("bomb.png", bomb_png(), "decompression bomb"),
                              ("empty.jpg", b"", "is empty")):
        assert panel.upload(name, data) is None
        assert RED in panel.status.value and words in panel.status.value, panel.status.value
        assert name in panel.status.value and str(images) not in panel.status.value  # the upload's own name
        assert session.image == bundled[5][1]  # the previous picture stays chosen
        assert not (images / name).exists()  # nothing refused is left behind as a choice
    # a picture with transparency, through the FileUpload widget itself
    panel.upload_button.value = ({"name": "my photo.png", "type": "image/png", "size": 10, "last_modified": datetime.now(timezone.utc),
                                  "content": memoryview(png_bytes())},)
    assert panel.error is None, panel.error
    assert session.image == images / "my_photo.png" and session.image.is_file()
    assert panel.picture.options[-1] == ("uploaded: my_photo.png", images / "my_photo.png")
    assert panel.status.value == "" and panel.upload_button.value == ()
    panel.choose(bundled[0][1])
    assert session.image == bundled[0][1]


def test_precisions_groups_the_layers_by_part(vl_app):
    panel = vl_app.override_panel
    lm = vl_app.lm
    groups = part_layers(lm)
    assert list(panel.sections) == ["vision encoder", "projector", "language model"]
    for part, names in groups.items():
        body = panel.sections[part].children[0]
        assert [r for r in body.children[2:]] == [panel.rows[n] for n in names]  # the part's rows, in order
        assert panel.sections[part].get_title(0).startswith(f"{part}: {len(names)} layers")
    assert all(n.startswith("model.visual.merger.") for n in groups["projector"])
    assert not any(n.startswith("model.visual.merger.") for n in groups["vision encoder"])
    before = panel.plan
    assert panel.set_part("vision encoder", "int8") == 15
    panel.part_setters["projector"].value = "fp16"  # the section's own button
    resolved = panel.plan.resolve([i.name for i in lm.layers])
    assert {resolved[n] for n in groups["vision encoder"]} == {"int8"}
    assert {resolved[n] for n in groups["projector"]} == {"fp16"}
    assert resolved["model.language_model.layers.0.mlp.down_proj"] == before.precision_name_for(
        "model.language_model.layers.0.mlp.down_proj")
    assert all(r.pattern in resolved for r in panel.plan.rules if r.pattern not in {q.pattern for q in before.rules})
    assert panel.sections["vision encoder"].get_title(0).endswith("all INT8")
    assert panel.part_setters["vision encoder"].value == "int8" and panel.part_precision("projector") == "fp16"
    panel.set_precision("model.visual.blocks.0.attn.qkv", "int4")  # one row differs: the part is mixed
    assert panel.part_setters["vision encoder"].value is None
    assert "mixed INT4 / INT8" in panel.sections["vision encoder"].get_title(0)
    panel.undo()
    assert panel.part_setters["vision encoder"].value == "int8"
    panel.sections["language model"].selected_index = None  # collapsed: its rows are still in the plan
    with pytest.raises(KeyError, match="not a part of this model"):
        panel.set_part("mmproj", "int8")


def test_a_text_model_has_no_parts_to_group(tmp_path):
    from workbench.model.load import load_model
    lm = load_model(str(build_tiny_model(tmp_path / "tiny")))
    panel = OverridePanel(lm, plan=QuantPlan.uniform("int4"))
    assert panel.sections == {} and panel.part_layers == {}
    assert panel.table.children[1] is panel.rows[lm.layers[0].name]
    assert model_words(lm) == ""


def test_quantize_reports_the_pictures_as_the_library_measures_them(vl_app):
    app = vl_app
    app.override_panel.set_part("vision encoder", "int8")
    app.override_panel.set_part("projector", "int8")
    app.use_plan()
    panel = app.quantize_panel
    assert panel.image_set in panel.children  # only a VLM's panel has the field
    assert panel.run() is not None, panel.error
    q = app.session.vision_quality
    assert q is panel.vision and q.questions == 12 and q.captions == 8
    again = measure_vision_quality(app.lm, panel.qm.build_model(), small_set())
    assert q.answer_kl == pytest.approx(again.answer_kl, rel=1e-4, abs=1e-9)
    assert q.answer_top1 == pytest.approx(again.answer_top1) and q.itm_accuracy == again.itm_accuracy
    assert q.reference_itm_accuracy == again.reference_itm_accuracy
    shown = panel.pictures.value
    for line in vision_sentences(q.to_dict()):
        assert line.replace("'", "&#x27;") in shown
    assert f"{q.answer_kl:.5f} ± {q.answer_kl_stderr:.5f}" in shown and "float model" in shown
    saved = (app.session.quantized_path / "report.json").read_text()
    assert '"vision"' in saved and '"answer_kl"' in saved
    # a worse plan for the pictures: the language model at INT2 moves the answers further
    app.override_panel.set_part("language model", "int2")
    app.use_plan()
    assert panel.run() is not None, panel.error
    assert len(panel.vision_rows) == 2 and panel.vision.answer_kl > q.answer_kl
    assert panel.pictures.value.count("<tr>") == 4  # header, float, two runs
    report = app.session.report()
    assert report["quantized"]["vision"]["answer_kl"] == panel.vision.answer_kl
    assert [p["name"] for p in report["model"]["parts"]] == ["vision encoder", "projector", "language model"]
    markdown = report_markdown(report)  # the run's report.md says it in the same words
    assert all(line in markdown for line in vision_sentences(report["quantized"]["vision"]))


def test_generate_answers_about_the_chosen_picture(vl_app):
    app = vl_app
    if app.session.quantized is None:
        assert app.quantize_panel.run() is not None, app.quantize_panel.error
    panel = app.generate_panel
    panel._refresh_choices(select_latest=True)
    assert panel.model.value == str(app.session.quantized_path)
    assert panel.prompt.value == "Describe this image in one sentence."
    panel.max_tokens.value = 10
    answers = {}
    for name in ("heldout-000.png", "heldout-001.png"):
        app.vision_panel.choose(DEMO_VL_DATA_DIR / "images" / name)
        assert name in panel.picture_note.value and panel.picture.value
        results = panel.run()
        assert results is not None, panel.error
        assert set(results) == {"chosen", "float"} and "quantized" in panel.columns["chosen"].name
        for key, gen in results.items():
            assert gen.text.strip() and gen.text.strip()[:10] in panel.columns[key].text.value
            assert gen.stats.prompt_tokens > 20  # the picture's tokens are in the prompt
        answers[name] = results["float"].text
    assert answers["heldout-000.png"] != answers["heldout-001.png"]  # two pictures, two answers
    panel.question.value = "How many shapes are there?"
    assert panel.prompt.value == "How many shapes are there?"
    assert panel.run() is not None and results["float"].text != panel.results["float"].text


def test_generate_without_a_picture_says_so(vl_app):
    app, panel = vl_app, vl_app.generate_panel
    saved = app.session.image
    app.session.image = None
    try:
        assert "no picture chosen" in panel.picture_note.value
        assert panel.run() is None and RED in panel.status.value and "choose a picture first" in panel.status.value
    finally:
        app.vision_panel.choose(saved)
