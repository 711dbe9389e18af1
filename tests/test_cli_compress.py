"""``workbench prune`` and ``workbench distill``: JSON reports, outputs other commands load, bad input as one line."""
import json

import pytest

from workbench.cli import main


@pytest.fixture(autouse=True)
def scratch_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_WORKSPACE", str(tmp_path / "ws"))


def test_prune_then_distill_then_eval(tiny_model_dir, tmp_path, capsys):
    pruned, distilled = tmp_path / "pruned", tmp_path / "distilled"
    assert main(["prune", str(tiny_model_dir), "--heads", "0.5", "--mlp", "0.25", "--out", str(pruned),
                 "--eval-tokens", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["geometry_after"]["heads"] == 2 and report["geometry_after"]["intermediate"] == 96
    assert report["parameters_after"] == report["parameters_predicted"] and report["evaluation"]["kl"] > 0
    assert main(["distill", str(pruned), "--teacher", str(tiny_model_dir), "--out", str(distilled), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--temperature", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["losses"]) == 2 and d["config"]["temperature"] == 3 and d["student_after"]["kl"] > 0
    assert main(["eval", str(distilled), "--ref", str(tiny_model_dir), "--max-tokens", "128", "--ctx", "64",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kl_divergence"] > 0


def test_prune_with_a_plan_file_and_a_table(tiny_model_dir, tmp_path, capsys):
    plan = tmp_path / "prune.json"
    plan.write_text(json.dumps({"layers": {"0": {"heads_keep": [0], "mlp_keep": list(range(64))},
                                           "1": {"heads_keep": [1], "mlp_keep": list(range(64, 128))}}}))
    assert main(["prune", str(tiny_model_dir), "--plan", str(plan), "--out", str(tmp_path / "p"),
                 "--eval-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "heads 4 -> 2 (KV 2 -> 1), MLP 128 -> 64" in out and "held-out" not in out


@pytest.mark.parametrize("args,message", [
    (["--heads", "0.5", "--plan", "p.json"], "give --plan or --heads/--mlp, not both"),
    ([], "say what to prune"),
    (["--plan", "missing.json"], "missing.json"),
])
def test_prune_refusals_are_one_line(tiny_model_dir, tmp_path, capsys, args, message):
    assert main(["prune", str(tiny_model_dir), "--out", str(tmp_path / "p"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_removing_every_unit_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    """--heads 1 (every head) is out of the option's range: argparse's one line and its hint, nothing written."""
    with pytest.raises(SystemExit) as e:
        main(["prune", str(tiny_model_dir), "--out", str(tmp_path / "p"), "--heads", "1.0"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2 and "--heads: must be a finite number >= 0 and < 1, got 1.0" in err[0]
    assert not (tmp_path / "p").exists()


def test_distill_refusals_are_one_line(tiny_model_dir, tmp_path, capsys):
    plan = tmp_path / "int4.json"
    from workbench.quantize.plan import QuantPlan
    QuantPlan.uniform("int4").save(plan)
    assert main(["distill", str(tiny_model_dir), "--teacher", str(tiny_model_dir), "--out", str(tmp_path / "d"),
                 "--plan", str(plan), "--mode", "lora"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "use mode 'full'" in err
    assert main(["distill", str(tiny_model_dir), "--teacher", str(tmp_path / "nowhere"), "--out",
                 str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
