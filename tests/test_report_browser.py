"""The run report in headless Chromium with the network cut off: every chart is drawn from the page alone.

Opens the demo flow's ``report.html`` (what Download writes) through file://, refuses every request that is not
file://, and counts the plotly graphs that drew their SVG. A screenshot goes to ``$WORKBENCH_TEST_ARTIFACTS``
(default ``tests/artifacts/report.png``). Needs Debian's Chromium and the playwright package; skipped, saying how to
install them, where either is missing.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import CHROMIUM, browser_skips
from workbench.charts.report import build_report

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("WORKBENCH_TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))
# no DNS and no proxy: a page that tried to load anything from the network would fail to
OFFLINE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
                 "--proxy-bypass-list=<-loopback>"]

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = browser_skips(sync_playwright is not None)


def test_every_chart_draws_offline(demo_run):
    root, app = demo_run
    page_file = app.out_dir / "report.html"
    figures = len(build_report(root).figures)
    assert figures == 8
    requests, errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=OFFLINE_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                       else route.abort())
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(page_file.as_uri())
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {figures}",
                                   timeout=60_000)
            drawn = page.evaluate("""() => [...document.querySelectorAll('.workbench-figure')].map(
                d => d.classList.contains('js-plotly-plot') && d.querySelector('.main-svg') !== null
                     && d.querySelectorAll('.main-svg .trace, .main-svg .table').length > 0)""")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        finally:
            browser.close()
    assert drawn == [True] * figures  # every figure drew its traces
    assert [u for u in requests if not u.startswith("file://")] == []
    assert errors == []
