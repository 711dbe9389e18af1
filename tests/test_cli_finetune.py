"""``workbench finetune``: JSON report, a model directory the other commands load, bad input as one line."""
import json

from workbench.cli import main


def test_json_report_and_a_loadable_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tuned"
    assert main(["finetune", str(tiny_model_dir), "--out", str(out), "--steps", "3", "--batch-size", "2",
                 "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["losses"]) == 3 and report["out_dir"] == str(out)
    assert report["perplexity_before"] > 0 and report["perplexity_after"] > 0
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"]
    again = ["finetune", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
             "--json"]
    assert main(again) == 2  # an earlier fine-tuned model is replaced only when asked
    assert "holds an earlier fine-tuned model; pass --overwrite" in capsys.readouterr().err
    assert main([*again, "--overwrite"]) == 0
    assert len(json.loads(capsys.readouterr().out)["losses"]) == 2
    assert json.loads((out / "manifest.json").read_text())["format"] == "workbench-finetune"


def test_missing_data_file_is_one_line(tiny_model_dir, tmp_path, capsys):
    assert main(["finetune", str(tiny_model_dir), "--out", str(tmp_path / "t"), "--data",
                 str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "training file" in err and "does not exist" in err
