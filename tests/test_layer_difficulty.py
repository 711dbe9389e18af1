"""layer_difficulty: each layer's damage beside the traits that explain it, on a tiny model with planted traits."""
import pytest
import torch

from conftest import build_tiny_model
from workbench.precision.layer_difficulty import TRAIT_FACTOR, difficulty_summary, layer_difficulty, spearman


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    from workbench.model.calibrate import calibrate
    from workbench.model.load import load_model
    from workbench.precision.sensitivity import run_sensitivity
    lm = load_model(str(build_tiny_model(tmp_path_factory.mktemp("d") / "m", "llama", layers=3, tie=False)))
    with torch.no_grad():  # one weight far out in block 1's up projection: its groups lose their levels
        lm.model.model.layers[1].mlp.up_proj.weight[3, 7] = 40 * lm.model.model.layers[1].mlp.up_proj.weight.abs().max()
    _set, stats = calibrate(lm, samples=8, seq_len=64, workspace=_ws(tmp_path_factory), progress=False)
    report = run_sensitivity(lm, tokens=256, precisions=("int4",), group_size=32, score="kl", progress=False)
    return lm, report, stats


def _ws(factory):
    from workbench.files.workspace import Workspace
    return Workspace(factory.mktemp("ws"))


def test_rows_are_hardest_first_with_shares_that_sum_to_one_and_places_named(swept):
    lm, report, stats = swept
    rows = layer_difficulty(lm, report, stats)
    assert [r.damage for r in rows] == sorted((r.damage for r in rows), reverse=True)
    assert len(rows) == len(report.layers) and abs(sum(r.share for r in rows) - 1) < 1e-9
    by = {r.name: r for r in rows}
    assert "first block" in by["model.layers.0.self_attn.q_proj"].why
    assert "last block" in by["model.layers.2.mlp.down_proj"].why
    assert any("embedding" in w for w in by["model.embed_tokens"].why) and by["model.embed_tokens"].block is None
    assert by["model.embed_tokens"].input_max_to_median is None  # a lookup has no input statistics
    assert by["model.layers.1.self_attn.v_proj"].input_max_to_median == pytest.approx(
        stats.layers["model.layers.1.self_attn.v_proj"].max_to_median)


def test_a_planted_outlier_weight_is_named_on_its_layer_alone(swept):
    lm, report, stats = swept
    by = {r.name: r for r in layer_difficulty(lm, report, stats)}
    planted = by["model.layers.1.mlp.up_proj"]
    assert any(w.startswith("heavy-tailed weights") for w in planted.why)
    others = [r for r in by.values() if r.role == "up_proj" and r is not planted]
    assert all(planted.weight_max_to_rms >= TRAIT_FACTOR * r.weight_max_to_rms for r in others)
    assert not any(w.startswith("heavy-tailed weights") for r in others for w in r.why)
    assert planted.damage > 0


def test_summary_correlates_traits_with_damage_and_splits_it_by_place_and_role(swept):
    lm, report, stats = swept
    rows = layer_difficulty(lm, report, stats)
    s = difficulty_summary(rows)
    assert set(s["correlation"]) == {"input_max_to_median", "weight_max_to_rms", "weight_kurtosis"}
    assert all(v is None or -1 <= v <= 1 for v in s["correlation"].values())
    assert s["places"]["first block"]["layers"] == 7 and s["places"]["embedding"]["layers"] == 1
    inside = sum(r.share for r in rows if r.block is not None)
    assert sum(s["roles"].values()) == pytest.approx(inside)


def test_spearman_is_the_rank_correlation():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 5]) is None and spearman([1, 2], [1, 2]) is None
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)  # ties share their rank


def test_the_figure_has_a_trace_per_layer_type_on_both_panels(swept):
    from workbench.charts.precision import make_difficulty_figure
    lm, report, stats = swept
    rows = layer_difficulty(lm, report, stats)
    fig = make_difficulty_figure(rows, score_label=report.score_label)
    roles = {r.role for r in rows}
    left = {t.name for t in fig.data if t.xaxis == "x"}
    right = {t.name for t in fig.data if t.xaxis == "x2"}
    assert left == roles and right == roles - {"embed_tokens"}
    assert fig.layout.yaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert fig.layout.yaxis.title.text.startswith("measured KL at int4")
