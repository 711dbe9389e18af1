"""What you measure is what you ship: a `workbench quantize` directory given to later steps is the quantized model."""
import json

import pytest

from workbench.cli import main


@pytest.fixture
def heldout(tmp_path):
    from workbench.assets import demo_text_path
    p = tmp_path / "heldout.txt"
    p.write_text(demo_text_path("heldout").read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return p


@pytest.mark.parametrize("bits", ["4", "8"])
def test_eval_of_a_quantize_output_equals_its_report(tiny_model_dir, tmp_path, heldout, capsys, bits):
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_model_dir), "--out", str(out), "--bits", bits, "--group-size", "32",
                 "--text", str(heldout), "--ctx", "128", "--json"]) == 0
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert main(["eval", str(out), "--text", str(heldout), "--ctx", "128", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["tokens"] == report["tokens"]
    # the same model; only the summation order of the two evaluation paths differs
    assert measured["perplexity"] == pytest.approx(report["perplexity"], rel=1e-6)
    assert measured["perplexity"] != pytest.approx(report["reference_perplexity"], rel=1e-6)
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "model.layers.0.mlp.down_proj" in json.dumps(info)


def test_a_mismatched_directory_exits_with_the_tensor_names(tiny_model_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert main(["eval", str(d), "--json"]) != 0
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.down_proj.weight [64, 128] vs [64, 96]" in err


@pytest.mark.slow
@pytest.mark.parametrize("command", [["sensitivity"], ["plan", "--bits-per-weight", "6", "--out", "unused.json"]])
def test_steps_that_requantize_refuse_a_quantized_directory_by_name(command, tmp_path, capsys):
    """A quantize output is not swept or re-planned from its dequantized weights: one line names the float source."""
    from workbench.cli import main
    out = tmp_path / "q"
    assert main(["quantize", "demo", "--bits", "4", "--out", str(out), "--max-tokens", "600", "--json"]) == 0
    capsys.readouterr()
    assert main([command[0], str(out), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "is already quantized" in err and "float model it was made from" in err


def test_convert_of_a_16_level_model_to_a_device_target_offers_the_command_that_makes_one(tiny_model_dir, tmp_path,
                                                                                          heldout, capsys):
    """The default grid's model to qnn: one line, exit 2, naming the one command (same plan, qnn's grid) with the
    first model's measured KL; that command writes a model the refusal no longer stops."""
    import shlex
    q = tmp_path / "q"
    common = ["--text", str(heldout), "--ctx", "128", "--no-importance"]
    assert main(["quantize", str(tiny_model_dir), "--out", str(q), "--bits", "4", "--group-size", "32",
                 *common]) == 0
    capsys.readouterr()
    kl = json.loads((q / "report.json").read_text())["kl_divergence"]
    assert main(["convert", str(q), "--target", "qnn", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which qnn cannot hold: make one it holds with `workbench quantize " in err[0]
    assert f"q measured KL {kl:.4g}" in err[0] and not (tmp_path / "c").exists()
    command = shlex.split(err[0].split("`")[1])
    assert command[:2] == ["workbench", "quantize"] and command[command.index("--target") + 1] == "qnn"
    assert main([*command[1:], *common, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "qnn" in data["reaches"] and data["plan"]["group_size"] == 32 and not data["plan"].get("full_range")
