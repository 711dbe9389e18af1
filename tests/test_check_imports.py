"""scripts/check_imports.py: the package has no import cycle and imports no private name across modules,
and the check finds both when they are there."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_the_package_has_no_cycle_and_no_private_import():
    result = run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no import cycle, no private name imported" in result.stdout


def test_a_cycle_and_a_private_import_are_both_found(tmp_path):
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A toy package."""\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import helper\n\n\ndef f():\n    return helper()\n")
    (pkg / "b.py").write_text("def helper():\n    from .sub.c import g  # a function-level import counts\n    return g()\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..d import _secret, __version__\n\n\ndef g():\n    return a\n")
    (pkg / "d.py").write_text('__version__ = "1"\n_secret = 1\n')
    result = run(pkg)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1
    assert lines == ["cycle: toy.a -> toy.b -> toy.sub.c -> toy.a",
                     "private: toy.sub.c imports _secret from toy.d"], result.stdout  # a dunder name is not private


def test_a_package_without_problems_passes_and_a_folder_that_is_no_package_is_refused(tmp_path):
    pkg = tmp_path / "fine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import json\n\nfrom . import b\nfrom .b import public\n")
    (pkg / "b.py").write_text("public = 1\n")
    assert run(pkg).returncode == 0
    assert run(tmp_path).returncode == 2
