"""The app as a person meets it: Voila serves it, headless Chromium clicks through the whole flow.

On the demo model: calibrate, the default sensitivity, one layer to FP16 by its row's button, Evaluate (a point on the chart),
Use this plan, quantize with AWQ, convert to ort-int4 and MNN, profile, generate from the INT4 ONNX
beside the float model, project the plans onto devices, download the run and read
the downloaded model with ``workbench eval``; then the Fine-tune tab for two steps. After every step
the page must show the step's figures and tables, and no "Error displaying widget", no "Loading
widget..." left behind, no Python traceback and no box that scrolls where it should not (a layer row's tiny
scrollbar, a stray horizontal one). A screenshot after every action and tab goes to ``$WORKBENCH_TEST_ARTIFACTS``
(default ``tests/artifacts/``, git-ignored).

Needs Debian's Chromium and the playwright package (its own browser download is not used); skipped,
saying how to install them, where either is missing. ``.ci/run`` installs Chromium before the tests.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import CHROMIUM, browser_skips, build_tiny_model, stop_process

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("WORKBENCH_TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))
WIDGET_ERRORS = ("Error displaying widget", "Traceback (most recent call last)")
STEP_TIMEOUT_MS = 420_000  # one heavy step (AWQ, a conversion) on a busy 2-core machine
APP_URL = re.compile(r"http://127\.0\.0\.1:\d+/\?token=[0-9a-f]+")

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the skip below says how to install it
    sync_playwright = None

pytestmark = browser_skips(sync_playwright is not None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_url(proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The URL with the token the server prints once it listens, as a person would copy it (no page requested:
    each page request starts a kernel)."""
    deadline = time.time() + timeout
    while not (found := APP_URL.search(log.read_text())):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, f"voila printed no URL with a token within {timeout:.0f} s"
        time.sleep(0.5)
    return found.group(0)


@pytest.fixture
def served_app(tmp_path):
    """``python -m workbench.ui.serve`` on a free loopback port, with a fresh workspace; its URL with the token."""
    port = _free_port()
    log = tmp_path / "voila.log"
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE")}
    env["WORKBENCH_WORKSPACE"] = str(tmp_path / "workspace")
    # the kernel imports this checkout, not a copy installed into the environment (a worktree's walk tested main's)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "workbench.ui.serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield _wait_for_url(proc, log), tmp_path / "workspace"
    finally:
        stop_process(proc, 30)


@contextlib.contextmanager
def app_page(url: str):
    """Headless Chromium on the served app until its first page is up: a tall page (Voila scrolls inside it, so a
    screenshot shows the viewport) and the ``Walk`` that steps through it; the browser closes afterwards."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 2400})
            page.set_default_timeout(120_000)
            w = Walk(page, ARTIFACTS)
            page.goto(url, timeout=300_000)
            page.locator(".lm-TabBar-tab").first.wait_for(timeout=300_000)
            w.wait_text("quantizable layers")
            yield page, w
        finally:
            browser.close()


def _outside(url: str) -> bool:
    """A request that would leave this machine (data: and blob: URLs never do)."""
    parts = urlsplit(url)
    return parts.scheme not in ("data", "blob", "about") and parts.hostname not in ("127.0.0.1", "localhost", "::1")


class Walk:
    """The page, plus the checks and the screenshot that close every step."""

    def __init__(self, page, artifacts: Path):
        self.page, self.artifacts, self.n = page, artifacts, 0
        self.console_errors: list[str] = []
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        self.requests: list[str] = []  # every URL the page asked for, websockets included
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("websocket", lambda ws: self.requests.append(ws.url))
        self.seconds: dict[str, float] = {}
        self.stray: dict[str, list[str]] = {}  # step -> the boxes that showed a scrollbar they should not
        self._t = time.perf_counter()

    def shot(self, name: str) -> None:
        """A screenshot of the page as it is now (numbered in the walk's order): after every action, not only at a
        step's end, so a busy state (a progress bar, a "receiving" count) is on record too."""
        self.n += 1
        self.page.screenshot(path=str(self.artifacts / f"{self.n:02d}-{name}.png"), full_page=True)

    def tab(self, title: str) -> None:
        self.page.locator(".lm-TabBar-tab", has_text=re.compile(rf"^{re.escape(title)}$")).first.click()
        self.page.wait_for_timeout(300)  # the tab's widgets laid out
        self.shot(f"tab-{title.lower().replace(' ', '-')}")

    def click(self, name: str) -> None:
        """Press the visible button reading ``name``; a screenshot right after (the action under way)."""
        self.button(name).click()
        self.page.wait_for_timeout(400)
        self.shot(f"pressed-{name.lower().replace(' ', '-').replace('(', '').replace(')', '')}")

    def charts(self, name: str) -> None:
        """A screenshot of each visible chart on its own: the page's screenshot shows the viewport, and Voila
        scrolls inside the page, so charts low on a long tab (Project's) are not in it."""
        for i, chart in enumerate(self.page.locator(".js-plotly-plot").filter(visible=True).all()):
            chart.scroll_into_view_if_needed()
            self.n += 1
            chart.screenshot(path=str(self.artifacts / f"{self.n:02d}-{name}-chart{i + 1}.png"))

    def scrollbars(self) -> list[str]:
        """Boxes that show a scrollbar they should not: a horizontal one anywhere but a log or the page itself, a
        vertical one on a box under 60 px tall (the layer rows' tiny scrollbars)."""
        return self.page.evaluate(SCROLLBARS)

    def field(self, label: str):
        """The visible input, select or textarea whose widget label reads ``label``."""
        box = self.page.locator(".widget-inline-hbox").filter(visible=True).filter(
            has=self.page.locator("label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$")))
        return box.locator("input, select, textarea").first

    def fill(self, label: str, value) -> None:
        f = self.field(label)
        f.fill(str(value))
        f.press("Enter")
        f.blur()

    def button(self, name: str):
        """The visible button reading ``name`` (by its text: an icon's glyph is part of its accessible name)."""
        text = re.compile(rf"^\s*{re.escape(name)}\s*$")
        return self.page.locator("button").filter(visible=True, has_text=text).first

    def wait_text(self, text: str | re.Pattern, timeout: int = STEP_TIMEOUT_MS):
        loc = self.page.get_by_text(text).filter(visible=True).first
        loc.wait_for(timeout=timeout)
        return loc

    def done(self, name: str) -> str:
        """The step finished: no widget errors or tracebacks, nothing left loading; a screenshot."""
        deadline = time.time() + 60
        while "Loading widget..." in self.page.inner_text("body") and time.time() < deadline:
            time.sleep(0.5)
        self.shot(name)
        body = self.page.inner_text("body")
        for bad in WIDGET_ERRORS + ("Loading widget...",):
            assert bad not in body, f"after '{name}' the page shows '{bad}'"
        stray = self.scrollbars()
        if stray:  # asserted once the walk is over, so that one finding does not cost the rest of the screenshots
            self.stray[name] = stray
        missing = [e for e in self.console_errors if "model not found" in e]
        assert not missing, f"after '{name}': {missing[:2]}"
        outside = [u for u in self.requests if _outside(u)]
        assert not outside, f"after '{name}' the page requested from another host: {outside[:3]}"
        now = time.perf_counter()
        self.seconds[name], self._t = round(now - self._t, 1), now
        return body

    def visible_charts(self) -> int:
        return self.page.locator(".js-plotly-plot").filter(visible=True).count()


SCROLLBARS = """() => {
    const out = [];
    for (const el of document.querySelectorAll('.workbench-app *')) {
        if (!el.offsetParent) continue;  // hidden (another tab)
        const st = getComputedStyle(el);
        if (el.closest('.jp-OutputArea, .widget-output, .jupyter-widget-output, select, textarea, .js-plotly-plot'))
            continue;  // a log that scrolls on purpose, a menu, a chart's own layers
        const x = ['auto', 'scroll'].includes(st.overflowX) && el.scrollWidth > el.clientWidth + 1;
        const y = ['auto', 'scroll'].includes(st.overflowY) && el.scrollHeight > el.clientHeight + 1
                  && el.clientHeight < 60;
        if (x || y) out.push(`${el.className || el.tagName} ${x ? 'x' : ''}${y ? 'y' : ''}`
                             + ` ${el.scrollWidth}x${el.scrollHeight} in ${el.clientWidth}x${el.clientHeight}`);
    }
    return out;
}"""

ICONS = """() => {
    const icon = document.querySelector('button i.fa');
    if (!icon) return null;
    return {family: getComputedStyle(icon).fontFamily, glyph: getComputedStyle(icon, '::before').content,
            loaded: [...document.fonts].filter(f => f.status === 'loaded').map(f => f.family.replace(/["']/g, ''))};
}"""


def test_the_page_loads_everything_from_this_machine(served_app):
    """Every request the page makes, websockets included, goes to 127.0.0.1; the buttons' Font Awesome icons
    (which Voila's stock page links from a CDN) still draw, from Voila's own bundle."""
    url, _ = served_app
    requests, refused = [], []

    def only_here(route):
        if _outside(route.request.url):
            refused.append(route.request.url)
            return route.abort()  # nothing leaves the machine during the test either
        return route.continue_()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.on("request", lambda r: requests.append(r.url))
            page.on("websocket", lambda ws: requests.append(ws.url))
            page.route("**/*", only_here)
            page.goto(url, timeout=300_000)
            page.locator(".lm-TabBar-tab").first.wait_for(timeout=300_000)
            page.get_by_text("quantizable layers").first.wait_for(timeout=300_000)
            page.wait_for_function(f"({ICONS})()?.loaded.includes('Font Awesome 5 Free')", timeout=60_000)
            icons = page.evaluate(ICONS)
            page.wait_for_load_state("networkidle")
        finally:
            browser.close()
    assert [u for u in requests if _outside(u)] == [] and refused == []
    assert any(u.startswith("ws://127.0.0.1") for u in requests)  # the widgets' kernel websocket, loopback too
    assert "Font Awesome" in icons["family"] and icons["glyph"] not in ("none", "normal", ""), icons


def test_whole_flow_in_headless_chromium(served_app, tmp_path):
    url, workspace = served_app
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            # tall: Voila scrolls inside the page, so a screenshot shows the viewport, not the whole document
            page = browser.new_page(viewport={"width": 1300, "height": 2400}, accept_downloads=True)
            page.set_default_timeout(120_000)
            w = Walk(page, ARTIFACTS)
            page.goto(url, timeout=300_000)
            page.locator(".lm-TabBar-tab").first.wait_for(timeout=300_000)
            w.wait_text("quantizable layers")
            body = w.done("loaded")
            assert "loaded demo: 30 quantizable layers" in body and str(workspace) in body  # outputs: the workspace

            # Calibrate (small sample counts keep the walk quick); before it runs, each sub-tab says what will appear
            assert "after Run calibration: how much of the text became samples" in body and not w.visible_charts()
            w.fill("samples", 8)
            w.fill("seq len", 128)
            w.click("Run calibration")
            w.wait_text("layers over 1,024 tokens")
            expect(page.locator(".js-plotly-plot").filter(visible=True).first).to_be_visible()
            body = w.done("calibrate")
            assert "8 samples, 1,024 tokens kept" in body and w.visible_charts() >= 1
            assert "after Run calibration" not in body
            for sub in ("Layers", "Channels", "Heat map"):  # each chart of the calibration, as a person opens it
                w.tab(sub)
                expect(page.locator(".js-plotly-plot").filter(visible=True).first).to_be_visible()
                w.done(f"calibrate-{sub.lower().replace(' ', '-')}")
            heat = page.locator(".js-plotly-plot").filter(visible=True).first.inner_text()
            assert "largest |x|" in heat and "max_to_median" not in heat  # words, not field names
            w.tab("Coverage")

            # Precisions: the default sensitivity (the Fisher estimate) fills the chart, one layer to FP16 by its
            # row's button, Evaluate, Use this plan
            w.tab("Precisions")
            w.click("Run sensitivity")
            w.wait_text(re.compile(r"estimated KL \(Fisher proxy\) of 30 layers .*the chart below"))
            chart = page.locator(".js-plotly-plot").filter(visible=True).first
            expect(chart.locator(".scatterlayer .point").first).to_be_attached()  # filled as the sweep ends
            w.done("sweep")
            row = page.locator(".widget-hbox").filter(has=page.locator("code", has_text=re.compile(
                r"^layers\.0\.mlp\.down_proj$")))
            row.locator("button", has_text=re.compile(r"^\s*FP16\s*$")).first.click()
            expect(row.locator("button.mod-active", has_text="FP16").first).to_be_visible()
            w.click("Evaluate")
            w.wait_text(re.compile(r"perplexity \d+\.\d+ \(float"))
            chart = page.locator(".js-plotly-plot").filter(visible=True).first
            expect(chart.locator(".scatterlayer .point").first).to_be_attached()
            w.done("evaluate")
            w.click("Use this plan")
            w.wait_text("Quantize and Export use this plan")
            body = w.done("use-plan")
            plan_label = re.search(r"plan ([0-9a-f]{8}) \(RTN", body)
            assert plan_label, "the Precisions tab names the plan it hands on"

            # Quantize with AWQ (calibration from the Calibrate tab)
            w.tab("Quantize")
            w.field("method").select_option(label="AWQ")
            w.fill("tokens scored (0: all)", 2048)
            w.click("Run")
            w.wait_text(re.compile(r"plan AWQ g128: \d+ integer layers"))
            body = w.done("quantize-awq")
            assert re.search(r"quantized model: .*/quantized/awq-[0-9a-f]{8}", body)
            assert w.visible_charts() >= 2  # cost table and per-layer errors

            # Export: ort-int4, then MNN, both of that AWQ model
            w.tab("Export")
            w.fill("tokens scored (0: all)", 2048)
            w.click("Convert")
            status = w.wait_text(re.compile(r"ort-int4: KL \d")).inner_text()
            sim = re.search(r"simulation here: ([0-9.]+)", status)
            measured = re.search(r"Quantize tab measured this model at KL ([0-9.]+)", status)
            assert sim and measured and sim.group(1) == measured.group(1), status  # the AWQ model, same tokens
            assert "GAP" not in status
            w.done("convert-ort-int4")
            w.field("target").select_option(label="mnn (runs here)")
            w.click("Convert")
            w.wait_text(re.compile(r"mnn: KL \d"))
            table = page.locator("table").filter(visible=True).last.inner_text()
            assert "ort-int4" in table and "mnn" in table
            w.done("convert-mnn")

            # Profile what Export wrote
            w.tab("Profile")
            w.fill("prompt tokens", 16)
            w.fill("repeats", 1)
            w.click("Profile")
            w.wait_text("2 model(s) timed")
            body = w.done("profile")
            assert "onnxruntime" in body and "MNN" in body and w.visible_charts() >= 1

            # Generate: the AWQ model's INT4 ONNX streams beside the float model, each with its tokens/s
            w.tab("Generate")
            choose = w.field("choose")
            options = [o.replace("\xa0", " ") for o in choose.locator("option").all_inner_texts()]
            assert options[0].startswith("mnn: "), options  # the latest conversion is offered first
            choose.select_option(index=next(i for i, o in enumerate(options) if o.startswith("ort-int4: ")))
            w.fill("max tokens", 24)
            w.click("Generate")
            w.wait_text(re.compile(r"ort-int4 \(ort-int4, onnxruntime\): 24 tokens, [\d,]+\.\d tok/s"))
            body = w.done("generate")
            assert len(re.findall(r"[\d,]+\.\d tok/s", body)) >= 4 and "demo (float, PyTorch)" in body  # columns too

            # Project: the session's plan and the evaluated ones on the default devices; the speed chart
            w.tab("Project")
            w.click("Project")
            w.wait_text(re.compile(r"\d plan\(s\) on 6 device\(s\)"))
            body = w.done("project")
            # the answer first: tok/s, first token, whether it fits; every device has a RAM figure or says why not
            assert "tokens/s" in body and "first token" in body and "fits in memory" in body
            assert "decode bound tok/s" not in body and "unknown: set by the phone" in body  # the rest folded
            assert not re.search(r"fits in memory\b.*\bunknown\s*$", body, re.M)
            page.locator("summary", has_text="details").filter(visible=True).first.click()  # the rest, folded
            body = w.done("project-details")
            assert "Snapdragon 8 Gen 3" in body and "layers the NPU cannot run" in body and w.visible_charts() >= 3
            # each device's own runtime, fitted to the vendor's measurements: the held-out error and the nearest
            # measurement beside each projection, the vendor's points on their own chart
            assert "nearest vendor measurement" in body and "Samsung Galaxy S25" in body and "held out" in body
            assert w.page.locator(".js-plotly-plot", has_text="Vendor measurements").filter(visible=True).count() == 1
            w.charts("project")
            w.field("runtime").select_option(label="Qualcomm QAIRT through GenieX (qairt)")
            page.evaluate("document.querySelectorAll('details').forEach(d => d.dataset.old = '1')")
            w.click("Project")
            new_table = page.locator("details:not([data-old])").filter(visible=True).first
            new_table.wait_for(timeout=STEP_TIMEOUT_MS)  # the table of this run, not the last one's
            new_table.locator("summary").click()
            w.wait_text(re.compile(r"qairt w4a16"))
            body = w.done("project-qairt")
            assert "qairt does not run on rknpu devices" not in body and "rkllm" in body  # the board keeps its own
            # Compress: importance per head and channel, then a pruned model measured beside the plans
            w.tab("Compress")
            w.click("Score")
            w.wait_text(re.compile(r"scored [\d,]+ tokens"))
            w.shot("compress-scored")
            w.click("Prune")
            w.wait_text(re.compile(r"heads \d+ -> \d+"))
            body = w.done("compress")
            w.charts("compress")
            assert "parameters" in body and w.visible_charts() >= 2

            w.tab("Precisions")
            page.screenshot(path=str(ARTIFACTS / "app.png"),  # the README's picture of the app
                            clip={"x": 0, "y": 0, "width": 1300, "height": 1000})

            # Download the run; the model in it is one `workbench eval` reads
            with page.expect_download(timeout=STEP_TIMEOUT_MS) as dl:
                w.click("Download run (zip)")
            archive = tmp_path / dl.value.suggested_filename
            dl.value.save_as(archive)
            w.wait_text("downloading")
            body = w.done("download")
            assert re.search(r"downloading run-[\d-]+\.zip \([\d.]+ [kMG]?B\)", body)
            link = page.locator(".workbench-download-link").filter(visible=True)
            expect(link).to_have_count(1)
            assert re.match(rf"save {re.escape(archive.name)} again", link.inner_text())

            # Fine-tune: two steps, and the tab draws its loss curve
            w.tab("Fine-tune")
            w.fill("steps", 2)
            w.fill("batch", 2)
            w.fill("seq len", 64)
            w.click("Fine-tune")
            w.wait_text("held-out perplexity")
            w.done("finetune")
            assert w.visible_charts() >= 1

            # A second model: a new run folder, and its zip holds that model's results alone
            second = build_tiny_model(tmp_path / "second-model", "qwen2")
            w.tab("Calibrate")  # the Fine-tune tab has a model field of its own
            w.fill("model", second)
            w.button("Load").first.click()
            try:
                w.wait_text(re.compile(r"a new run folder"), timeout=90_000)
            finally:
                w.shot("second-load")
            assert not page.get_by_text("held-out perplexity").filter(visible=True).count()  # nothing left over
            # issue 55.8: the first run's "save again" link went with its run
            expect(page.locator(".workbench-download-link").filter(visible=True)).to_have_count(0)
            w.tab("Quantize")
            w.click("Run")
            w.wait_text(re.compile(r"integer layers in"))
            with page.expect_download(timeout=STEP_TIMEOUT_MS) as dl2:
                w.click("Download run (zip)")
            second_archive = tmp_path / dl2.value.suggested_filename
            dl2.value.save_as(second_archive)
            w.wait_text("downloading")
            body = w.done("second-model")
            assert "integer layers in" not in body  # the Quantize status went once Download succeeded
        finally:
            browser.close()
    seconds = round(time.perf_counter() - t0, 1)
    (ARTIFACTS / "timings.json").write_text(json.dumps({"total": seconds, **w.seconds}, indent=1))
    (ARTIFACTS / "scrollbars.json").write_text(json.dumps(w.stray, indent=1))
    assert not w.stray, f"boxes that scroll where they should not (issue 55.12): {json.dumps(w.stray)[:1500]}"

    assert second_archive.stem != archive.stem  # another run folder
    with zipfile.ZipFile(second_archive) as z:
        report = json.loads(z.read(f"{second_archive.stem}/report.json"))
        record = json.loads(z.read(f"{second_archive.stem}/run.json"))
        page = z.read(f"{second_archive.stem}/report.html").decode()
        names2 = set(z.namelist())
    assert report["model"]["path"] == str(second) and record["fingerprint"] == report["model"]["fingerprint"]
    assert not any("devices-gap" in n or "calibrate" in n or "compress" in n for n in names2)
    assert "demo-model" not in page and "precision_evaluations" in report and not report["precision_evaluations"]

    run = archive.stem
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "unpacked")
    for member in ("model/quantization.json", "convert/ort-int4/conversion.json", "convert/mnn/prefill.mnn",
                   "plan.json", "report.json", "report.md", "report.html", "overrides/llamacpp-tensor-types.txt",
                   "figures/figures.html"):
        assert f"{run}/{member}" in names, sorted(names)[:20]
    conversion = json.loads((tmp_path / "unpacked" / run / "convert/ort-int4/conversion.json").read_text())
    assert conversion["plan"]["method"] == "awq" and conversion["quantized_model"]["manifest_sha256"]
    report = json.loads((tmp_path / "unpacked" / run / "report.json").read_text())
    assert report["quantized"]["method"] == "awq" and len(report["profiles"]) == 2
    model_dir = tmp_path / "unpacked" / run / "model"
    out = subprocess.run([sys.executable, "-m", "workbench", "eval", str(model_dir), "--max-tokens", "1024", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout[out.stdout.index("{"):])["perplexity"] > 1
    shutil.rmtree(tmp_path / "unpacked", ignore_errors=True)
