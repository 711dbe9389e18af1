"""Open the Voila app in headless Chromium and click through the whole flow: the browser test, by hand.

    python scripts/check_app_in_browser.py [--artifacts DIR]

Runs ``tests/test_app_browser.py`` (which ``make test`` runs too when Chromium and playwright are
there): Voila on a free loopback port, the demo model through calibrate, sweep, a layer to FP16,
Evaluate, Use this plan, AWQ, ort-int4 and MNN, profile, generate, project, compress, download, fine-tune and a
second model, with a screenshot after every action and tab (``NN-tab-*``, ``NN-pressed-*`` and each step's end) in
the artifacts folder (default tests/artifacts/), the step times in timings.json and any box that scrolls where it
should not in scrollbars.json. The served kernel imports this checkout (PYTHONPATH), not an installed copy.
Needs Chromium (``apt-get install -y chromium``) and playwright (in requirements.txt).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", default=str(ROOT / "tests" / "artifacts"), help="screenshots and timings")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the project's Python")
    args = ap.parse_args()
    env = {**os.environ, "WORKBENCH_TEST_ARTIFACTS": str(Path(args.artifacts).resolve()),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [args.python, "-m", "pytest", str(ROOT / "tests" / "test_app_browser.py"), "-q", "-rs"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
