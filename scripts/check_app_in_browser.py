"""Open the Voila app in headless Chromium, press Run calibration, and check the charts draw.

    python scripts/check_app_in_browser.py [--port 8866] [--screenshot app.png]

A manual check, not part of `make test`: it needs Chromium (`apt-get install chromium`) and the
`playwright` package (in any Python, e.g. a separate venv), neither of which the project installs.
It starts `python -m workbench.ui.serve` on 127.0.0.1, waits for the tabs, clicks Run calibration,
waits for the plotly charts (the first one loads plotly.js, which takes a while), and exits 1 if
fewer than four charts were drawn.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8866)
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the project's Python")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--screenshot", help="write a PNG of the page after the charts drew")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    server = subprocess.Popen([args.python, "-m", "workbench.ui.serve", "--port", str(args.port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}/"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url, timeout=120)
                break
            except OSError:
                time.sleep(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.goto(url, timeout=180_000)
            page.wait_for_selector(".lm-TabBar-tab", timeout=180_000)
            page.click("button:has-text('Run calibration')")
            page.wait_for_selector("text=layers over", timeout=300_000)
            deadline = time.time() + 120
            while page.locator(".js-plotly-plot").count() < 4 and time.time() < deadline:
                time.sleep(1)
            charts = page.locator(".js-plotly-plot").count()
            if args.screenshot:
                page.click(".lm-TabBar-tab:has-text('Heat map')")
                time.sleep(2)
                page.screenshot(path=args.screenshot, full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"{charts} plotly chart(s) drawn after Run calibration")
    return 0 if charts >= 4 else 1


if __name__ == "__main__":
    sys.exit(main())
