"""scripts/check_imports.py: the package has no import cycle, imports no private name across modules and no
higher layer, and the check finds each when it is there."""
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
    assert "no import of a higher layer, no import cycle, no private name imported" in result.stdout
    assert "inside functions" in result.stdout


def test_the_root_holds_only_the_basics_and_the_layers_are_documented_in_order():
    import ast
    init = (ROOT / "workbench" / "__init__.py").read_text()
    layers = next(ast.literal_eval(n.value) for n in ast.parse(init).body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__layers__")
    basics = set(layers[0])
    root_modules = {p.stem for p in (ROOT / "workbench").glob("*.py")} - {"__init__", "__main__"}
    assert root_modules == basics, root_modules ^ basics
    packages = [p.name for p in sorted((ROOT / "workbench").iterdir()) if (p / "__init__.py").is_file()]
    assert sorted(packages) == sorted(layers[1:])
    for name in packages:  # each package says what it holds
        assert ast.get_docstring(ast.parse((ROOT / "workbench" / name / "__init__.py").read_text())), name
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[2].strip() for line in doc.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [r.strip("`/") for r in rows[1:]] == list(layers[1:])  # the table lists the packages in layer order


def test_an_import_of_a_higher_layer_is_refused_even_inside_a_function(tmp_path):
    pkg = tmp_path / "tower"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('__layers__ = (("base",), "low", "high")\n')
    (pkg / "base.py").write_text("X = 1\n")
    (pkg / "low" / "a.py").write_text("from ..base import X\n\n\ndef f():\n    from ..high.b import g  # lazy, still a dependency\n    return g() + X\n")
    (pkg / "high" / "b.py").write_text("from ..low import a\n\n\ndef g():\n    return 1\n")
    (pkg / "stray.py").write_text("")
    result = run(pkg)
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert "layer: tower.low.a (layer 1) imports tower.high.b (layer 2)" in lines, result.stdout
    assert "unplaced: tower.stray is in no layer of __layers__" in lines
    (pkg / "low" / "a.py").write_text("from ..base import X\n\n\ndef f():\n    import json  # a third-party deferral is fine\n    return X\n")
    (pkg / "stray.py").unlink()
    fine = run(pkg)
    assert fine.returncode == 0, fine.stdout
    assert "3 layers, no import of a higher layer" in fine.stdout


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
