import json
import subprocess
import sys

import pytest

from workbench.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_info_json(capsys, tiny_model_dir):
    out = run_json(capsys, "info", str(tiny_model_dir), "--json")
    assert out["vocab_size"] == 4096 and out["parameters"] > 0
    names = [layer["name"] for layer in out["layers"]]
    assert "model.layers.1.mlp.up_proj" in names
    q = next(layer for layer in out["layers"] if layer["name"].endswith("0.self_attn.q_proj"))
    assert q["shape"] == [64, 64] and q["parameters"] == 4096
    assert out["size_bytes"]["int4"] < out["size_bytes"]["int8"] < out["size_bytes"]["fp16"]


def test_info_table(capsys, tiny_model_dir):
    assert main(["info", str(tiny_model_dir)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in text and "int4" in text and "(tied)" in text


def test_eval_against_itself(capsys, tiny_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = run_json(capsys, "eval", str(tiny_model_dir), "--ref", str(tiny_model_dir), "--text", str(text),
                   "--ctx", "64", "--json")
    assert out["kl_divergence"] == pytest.approx(0.0, abs=1e-7) and out["top1_agreement"] == 1.0
    assert out["tokens"] > 100 and out["perplexity"] > 1


def test_eval_stride(capsys, tiny_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Lists are mutable sequences, typically used to store collections. " * 30)
    a = run_json(capsys, "eval", str(tiny_model_dir), "--text", str(text), "--ctx", "64", "--json")
    b = run_json(capsys, "eval", str(tiny_model_dir), "--text", str(text), "--ctx", "64", "--stride", "32", "--json")
    assert b["tokens"] > a["tokens"] and b["stride"] == 32 and "kl_divergence" in a and a["kl_divergence"] is None


@pytest.mark.parametrize("argv, message", [
    (["info", "/nonexistent/model"], "does not exist"),
    (["eval", "demo", "--text", "/nonexistent.txt"], "does not exist"),
    (["eval", "demo", "--ctx", "4096"], "max_position_embeddings"),
])
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith(f"workbench {argv[0]}: error:")


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "info", "/nonexistent"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "does not exist" in r.stderr


@pytest.mark.parametrize("exc", [RuntimeError("boom\nsecond line"), KeyError("x"), AttributeError("no attr")])
def test_unexpected_exception_says_bug_and_logs_the_traceback(capsys, monkeypatch, tmp_path, exc):
    import workbench.cli.info as info
    import workbench.files.workspace as workspace

    def broken(args):
        raise exc
    monkeypatch.setattr(info, "run", broken)
    monkeypatch.setattr(workspace, "DEFAULT_WORKSPACE", tmp_path / "ws")
    assert main(["info", "demo"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("workbench info: internal error (") and "bug in the workbench" in err
    logs = list((tmp_path / "ws" / "logs").glob("error-*-info.log"))
    assert len(logs) == 1 and str(logs[0]) in err
    text = logs[0].read_text()
    assert text.startswith("workbench info demo\n") and "Traceback" in text and "in broken" in text


def test_library_error_with_newlines_stays_one_line(capsys, monkeypatch):
    import workbench.cli.info as info
    from workbench.errors import ModelLoadError

    def broken(args):
        raise ModelLoadError("first\nsecond")
    monkeypatch.setattr(info, "run", broken)
    assert main(["info", "demo"]) == 2
    assert capsys.readouterr().err == "workbench info: error: first; second\n"


# options of other programs that messages and generated commands name -> the program they belong to,
# which the same source file must name
OTHER_PROGRAMS_OPTIONS = {
    "--tensor-type": "llama", "--tensor-type-file": "llama-quantize", "--outtype": "convert_hf_to_gguf",
    "--outfile": "convert_hf_to_gguf", "--sym": "llmexport", "--path": "llmexport", "--export": "llmexport",
    "--no-deps": "pip install", "--platform": "build_rknn.py", "--port": "workbench.ui.serve",
    "--notebook": "workbench.ui.serve", "--no-browser": "voila", "--object-store-memory": "ray start",
    "--temp": "llama-mtmd-cli", "--jinja": "llama-mtmd-cli", "--image-min-tokens": "llama-mtmd-cli",
    "--image-max-tokens": "llama-mtmd-cli", "--ignore-eos": "llama-mtmd-cli",
}


def _workbench_options() -> set[str]:
    import argparse

    from workbench.cli import build_parser
    opts = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                opts.update(o for a in sub._actions for o in a.option_strings if o.startswith("--"))
    return opts


def test_every_option_a_message_names_exists_on_the_command_line():
    """Hints must be something the user can type: each --option in workbench's strings is a real option."""
    import ast
    import re
    from pathlib import Path

    import workbench
    known = _workbench_options()
    option = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w=-])")
    unknown = []
    for f in sorted(Path(workbench.__file__).parent.rglob("*.py")):
        source = f.read_text(encoding="utf-8")
        tree = ast.parse(source)
        defined = set()  # an add_argument call defines options; a list literal is another program's argv
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                defined.update(id(a) for a in node.args)
            if isinstance(node, (ast.List, ast.Tuple)):
                defined.update(id(a) for a in node.elts)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in defined:
                for name in option.findall(node.value):
                    program = OTHER_PROGRAMS_OPTIONS.get(name)
                    if name not in known and (program is None or program not in source):
                        unknown.append(f"{f.name}:{node.lineno}: {name}")
    assert not unknown, "messages name options the command line does not have: " + ", ".join(unknown)
    assert {"--out", "--seq-len", "--ctx", "--trust-remote-code", "--overwrite", "--score"} <= known


def test_option_scan_catches_a_made_up_option(tmp_path, monkeypatch):
    """The scan above is not vacuous: an option no parser has is reported."""
    import re
    option = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w=-])")
    found = option.findall("give longer texts or lower --min-tokens; not x--y or --opt=1 or --flag_name")
    assert found == ["--min-tokens"] and "--min-tokens" not in _workbench_options()


def _count_options():
    from workbench.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for cmd, p in sub.choices.items():
        for a in p._actions:
            if getattr(a.type, "__name__", "").startswith("whole number >= "):
                yield cmd, a.option_strings[-1], int(a.type.__name__.rsplit(" ", 1)[1])


@pytest.mark.parametrize("cmd, option, minimum", list(_count_options()))
def test_every_whole_number_option_refuses_below_its_minimum_in_one_line(cmd, option, minimum, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, option, str(minimum - 1)])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2, err
    assert err[0].startswith(f"workbench {cmd}: error: argument {option}: must be at least {minimum}") and \
        err[0].endswith(f", got {minimum - 1}"), err
    assert err[1] == f"workbench {cmd}: see `workbench {cmd} --help` for the options"


def _number_options():
    from workbench.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for cmd, p in sub.choices.items():
        for a in p._actions:
            yield cmd, a.option_strings[-1] if a.option_strings else a.dest, a.type


def _out_of_range(bounds) -> list[str]:
    low, high, low_open, high_open = bounds
    bad = ["nan", "inf", "x"]
    if low is not None:
        bad.append(f"{low:g}" if low_open else f"{low - 0.5:g}")
    if high is not None:
        bad.append(f"{high:g}" if high_open else f"{high + 0.5:g}")
    return bad


def test_no_option_takes_an_unchecked_float():
    """Every real-valued option is a range-checked ``number``: a bare ``float`` takes nan, inf and any sign."""
    bare = [f"{cmd} {opt}" for cmd, opt, t in _number_options() if t is float]
    assert not bare, "options parsed with a bare float: " + ", ".join(bare)
    assert len([1 for *_, t in _number_options() if hasattr(t, "bounds")]) >= 15


@pytest.mark.parametrize("cmd, option, parse", [o for o in _number_options() if hasattr(o[2], "bounds")])
def test_every_number_option_refuses_what_is_out_of_its_range_in_one_line(cmd, option, parse, capsys):
    for value in _out_of_range(parse.bounds):
        with pytest.raises(SystemExit) as e:
            main([cmd, f"{option}={value}"])
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(err) == 2, err
        assert err[0].startswith(f"workbench {cmd}: error: argument {option}: must be "), err
    low, high, low_open, high_open = parse.bounds
    inside = (low + (1e-3 if low_open else 0)) if low is not None else (high - 1 if high is not None else 1.0)
    assert parse(f"{inside:g}") == pytest.approx(inside)


def test_eval_ctx_stride_batch_are_checked_before_any_work(capsys):
    for argv, what in ((["--ctx", "0"], "--ctx: must be at least 2"), (["--ctx", "1"], "--ctx: must be at least 2"),
                       (["--stride", "0"], "--stride: must be at least 1"),
                       (["--batch-size", "0"], "--batch-size: must be at least 1")):
        with pytest.raises(SystemExit):
            main(["eval", "demo", *argv])
        assert what in capsys.readouterr().err


def test_one_window_prints_no_plus_minus_nan(capsys):
    assert main(["eval", "demo", "--ctx", "512", "--max-tokens", "300", "--ref", "demo"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "±" not in out and "perplexity" in out and "1 windows" in out


def test_eval_text_that_is_a_directory_says_so(tmp_path, capsys):
    assert main(["eval", "demo", "--text", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"text path '{tmp_path}' is a directory; pass a UTF-8 text file")


def test_a_command_prints_no_third_party_noise():
    """torchao, installed for the executorch target, is imported by transformers and logs the GPU kernels it cannot
    load; a user's command shows none of that."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "workbench", "info", "demo"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and "4.20 M parameters" in proc.stdout
    for noise in ("Failed to load", "register_constant", "_C_mxfp8"):
        assert noise not in proc.stderr, proc.stderr[-1000:]
