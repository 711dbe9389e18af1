"""The app on a vision-language model as a person meets it: Voila serves it, headless Chromium loads demo-vl, chooses
a bundled picture, uploads a file that is not a picture (one red line) and a real one, sets the vision encoder to
INT8 and the projector to FP16 in their Precisions sections, quantizes (answer-token KL, top-1 and image-text
matching of float and quantized, in words), and asks about the picture in Generate, quantized beside float.

A screenshot per step goes to ``$WORKBENCH_TEST_ARTIFACTS`` (default ``tests/artifacts/``, ``vl-*.png``). Needs
Debian's Chromium and the playwright package (skipped, saying how to install them, where either is missing).
"""
from __future__ import annotations

import json
import re
import time

from test_app_browser import ARTIFACTS, STEP_TIMEOUT_MS, app_page, browser_skips, served_app, \
    sync_playwright  # noqa: F401 - served_app is the fixture

pytestmark = browser_skips(sync_playwright is not None)
SPEED = re.compile(r"^[\d,]+\.\d tok/s$")


def _png(path, size=(64, 48), colour=(30, 90, 220)):
    from PIL import Image
    Image.new("RGB", size, colour).save(path, format="PNG")
    return path


def upload(page, section, path) -> None:
    """What a person does: press Upload and pick the file (the widget's file input is not in the page's tree)."""
    with page.expect_file_chooser() as chooser:
        section.locator(".widget-upload").click()
    chooser.value.set_files(str(path))


def test_vision_language_walk_in_headless_chromium(served_app, tmp_path):
    url, workspace = served_app
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    bad = tmp_path / "notes.png"
    bad.write_text("this is text, not a picture")
    good = _png(tmp_path / "blue.png")
    with app_page(url) as (page, w):
        try:
            # Load demo-vl: the status line and the parts table name vision encoder, projector, language model
            w.fill("model", "demo-vl")
            w.button("Load").click()
            w.wait_text(re.compile(r"loaded demo-vl: 33 quantizable layers; a vision-language model"))
            vision = page.locator(".workbench-vision").filter(visible=True)
            vision.wait_for()
            body = w.done("vl-loaded")
            table = vision.locator("table.workbench-parts").inner_text()
            for part, params in (("vision encoder", "448,224"), ("projector", "197,216"), ("language model", "919,168")):
                assert re.search(rf"{part}\s.*{params}", table), table

            # a picture: a bundled one from the dropdown, a bad upload refused, a good upload chosen
            picture = w.field("picture")
            labels = [t.replace("\xa0", " ") for t in picture.locator("option").all_inner_texts()]
            assert len(labels) == 48 and labels[1].startswith("heldout-001.png: ")
            picture.select_option(index=1)
            page.wait_for_function("() => [...document.querySelectorAll('.workbench-vision .widget-html')]"
                                   ".some(e => e.innerText.includes('heldout-001.png'))")
            upload(page, vision, bad)
            w.wait_text(re.compile(r"error: 'notes\.png' is not an image Pillow can read"))
            body = w.done("vl-bad-upload")
            upload(page, vision, good)
            w.wait_text("64 x 48 pixels", timeout=60_000)
            assert "uploaded: blue.png" in [t.replace("\xa0", " ") for t in picture.locator("option").all_inner_texts()]
            picture.select_option(index=1)  # back to the bundled picture the demo VLM knows
            page.wait_for_function("() => [...document.querySelectorAll('.workbench-vision .widget-html')]"
                                   ".some(e => e.innerText.includes('56 x 56 pixels'))")
            body = w.done("vl-picture")

            # Precisions: one section per part, each with its own setter
            w.tab("Precisions")
            sections = page.locator(".workbench-part").filter(visible=True)
            sections.first.wait_for()
            assert sections.count() == 3
            titles = sections.all_inner_texts()
            assert titles[0].startswith("vision encoder: 15 layers") and titles[1].startswith("projector: 2 layers")
            sections.nth(0).locator("button", has_text=re.compile(r"^\s*INT8\s*$")).first.click()
            page.get_by_text(re.compile(r"vision encoder: 15 layers.*all INT8")).first.wait_for()
            sections.nth(1).locator("button", has_text=re.compile(r"^\s*FP16\s*$")).first.click()
            page.get_by_text(re.compile(r"projector: 2 layers.*all FP16")).first.wait_for()
            w.button("Use this plan").click()
            w.wait_text("Quantize and Export use this plan")
            body = w.done("vl-plan")

            # Quantize: the pictures' measures in words and a table, float beside quantized
            w.tab("Quantize")
            t0 = time.perf_counter()
            w.button("Run").click()
            w.wait_text(re.compile(r"Image-text matching \(the picture's own caption"), timeout=STEP_TIMEOUT_MS)
            quantize_s = time.perf_counter() - t0
            body = w.done("vl-quantized")
            words = page.locator("div.workbench-pictures").filter(visible=True).inner_text()
            assert re.search(r"answer token is the float model's \d+\.\d% ± \d+\.\d% of the time", words), words
            assert re.search(r"float model \d+\.\d%, quantized \d+\.\d%", words), words
            assert "156 questions" in words and "48 pictures" in words

            # Generate: the question about the chosen picture, quantized beside float
            w.tab("Generate")
            w.wait_text("the picture chosen under Load")
            assert w.field("prompt").input_value() == "Describe this image in one sentence."
            w.fill("max tokens", 12)
            w.button("Generate").click()
            # done when the status line sums up both runs (each column streams first)
            w.wait_text(re.compile(r"demo-vl \(float, PyTorch\): \d+ tokens"), timeout=STEP_TIMEOUT_MS)
            body = w.done("vl-generated")
            speeds = page.locator(".widget-html b").filter(visible=True).filter(has_text=SPEED).all_inner_texts()
            assert len(speeds) == 2, speeds  # tokens/s under each column, a number (the status line sums up too)
            assert re.search(r"rtn-[0-9a-f]{8} \(rtn quantized, PyTorch\)", body) and "demo-vl (float, PyTorch)" in body
            answers = page.locator("div[style*='white-space:pre-wrap']").filter(visible=True).all_inner_texts()
            assert len(answers) == 2 and all(a.strip() for a in answers), answers
        except BaseException:  # what the page showed when a step failed
            page.screenshot(path=str(ARTIFACTS / "vl-failed.png"), full_page=True)
            (ARTIFACTS / "vl-failed.txt").write_text(page.inner_text("body"))
            raise
    saved = list((workspace / "app").glob("run-*/quantized/rtn-*/report.json"))
    assert len(saved) == 1
    vision_doc = json.loads(saved[0].read_text())["vision"]
    assert vision_doc["questions"] == 156 and vision_doc["captions"] == 48
    assert f"{vision_doc['answer_top1']:.1%}" in words
    (ARTIFACTS / "vl-timing.json").write_text(json.dumps({"seconds": w.seconds, "quantize_s": round(quantize_s, 1),
                                                          "answers": answers, "speeds": speeds}))
