"""The Export tab's Compare on the devices, as a person meets it: Voila serves the app, headless Chromium ticks the
targets, runs the comparison for the session's plan on a short token budget, and reads the table and the chart.

The cheapest targets: the simulation and CPU onnxruntime (QDQ), and the HTP emulator where onnxruntime-qnn is
installed. Screenshots go to ``$WORKBENCH_TEST_ARTIFACTS`` (default ``tests/artifacts/``). Needs Debian's Chromium
and the playwright package (skipped, saying how to install them, where either is missing).
"""
from __future__ import annotations

import json
import re
import time

from test_app_browser import ARTIFACTS, STEP_TIMEOUT_MS, app_page, browser_skips, served_app, \
    sync_playwright  # noqa: F401 - served_app is the fixture

from workbench.run.devices_gap import GAP_FILE, TABLE_HEADER
from workbench.targets.htp import qnn_available

pytestmark = browser_skips(sync_playwright is not None)
TOKENS = 256
NUMBER = re.compile(r"^\d\.\d\de-\d\d$")  # a KL cell


def test_compare_on_the_devices_in_headless_chromium(served_app):
    url, workspace = served_app
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    targets = ["simulation", "ort-qdq"] + (["htp"] if qnn_available() else [])
    with app_page(url) as (page, w):
        w.tab("Export")
        section = page.locator(".workbench-devices-gap").filter(visible=True)
        section.wait_for()
        box = lambda title: section.locator(".widget-checkbox").filter(has_text=title).locator("input")  # noqa
        assert box("simulation (PyTorch)").is_checked() and box("CPU onnxruntime (QDQ)").is_checked()
        if "htp" in targets:
            box("Hexagon HTP emulator").check()
        rknn = box("RK3588 simulator")
        if rknn.is_disabled():  # its toolchain is not here: the section says how to install it
            assert "make rknn-env" in section.inner_text()
        elif rknn.is_checked():
            rknn.uncheck()
        soc = w.field("HTP SoC")
        options = [o.replace("\xa0", " ") for o in soc.locator("option").all_inner_texts()]
        assert "Snapdragon 8 Gen 1 (soc 36, HTP v69)" in options  # every Snapdragon profile
        soc.select_option(index=options.index("Snapdragon 8 Gen 3 (soc 57, HTP v75)"))
        w.fill("tokens", TOKENS)
        body = w.done("devices-gap-chosen")
        t0 = time.perf_counter()
        w.button("Compare on the devices").click()
        # the run is in the background: the progress shows while it runs, and the page still answers
        w.wait_text(re.compile(r"simulation: running \(1/\d\)"), timeout=60_000)
        w.wait_text(re.compile(r"\d target\(s\) in \d+ s"), timeout=STEP_TIMEOUT_MS * 2)
        seconds = time.perf_counter() - t0
        body = w.done("devices-gap-table")
        rows = section.locator("tr.gap-row")
        assert rows.count() == len(targets), section.inner_text()
        cells = {}
        for i in range(rows.count()):
            row = rows.nth(i)
            tds = row.locator("td").all_inner_texts()
            cells[row.get_attribute("data-target")] = tds
        assert list(cells) == targets
        S = TABLE_HEADER.index("s")  # the columns by name: seconds, then peak GB
        for t in targets:  # a KL and a top-1 for prefill, real numbers, size / time / peak where measured
            tds = cells[t]
            assert NUMBER.match(tds[2]) and 0 < float(tds[3]) <= 1, (t, tds)
            assert float(tds[S]) > 0 and float(tds[S + 1]) > 0.05, (t, tds)  # seconds, peak GB
        assert NUMBER.match(cells["ort-qdq"][4]) and float(cells["ort-qdq"][8]) > 1  # decode KL; MB of graphs
        if cells["ort-qdq"][-1].startswith("GAP"):  # a flagged CPU QDQ graph is compared block by block
            assert re.search(r"Layer-wise: .*\d\.\d", cells["ort-qdq"][-1]), cells["ort-qdq"]
        if "htp" in targets:
            assert "snapdragon-8-gen-3 (soc 57, v75)" in cells["htp"][1] and NUMBER.match(cells["htp"][4])
        chart = section.locator(".js-plotly-plot").filter(visible=True)
        assert chart.count() == 1
        assert chart.first.locator(".bars .point").count() >= len(targets) + 1  # prefill each, decode some
        assert re.search(r"of demo with (uniform|mixed) [A-Z0-9 /]+, plan [0-9a-f]{8}", body) and "RTN" in body
        section.screenshot(path=str(ARTIFACTS / "devices-gap.png"))
    saved = list((workspace / "app").glob(f"run-*/devices-gap/plan-*/{GAP_FILE}"))
    assert len(saved) == 1
    doc = json.loads(saved[0].read_text())
    assert [r["target"] for r in doc["rows"]] == targets and doc["complete"] and doc["max_tokens"] == TOKENS
    sim = doc["rows"][0]["prefill"]
    assert f"{sim['kl']:.2e}" == cells["simulation"][2]
    (ARTIFACTS / "devices-gap-timing.json").write_text(json.dumps({"seconds": round(seconds, 1), "targets": targets}))
